"""Ingest and chunking on a real Ray cluster, reading from and writing to a real S3 server."""

import io
import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from atlas import chunking, ingest, storage
from atlas.config import ChunkingConfig, IngestConfig, StorageConfig

GOOD_TXT = {
    "docs/a.txt": "# Alpha\n\nThe alpha particle is a helium nucleus. It was named by Rutherford.\n",
    "docs/nested/b.txt": "Beta decay turns a neutron into a proton.\n\nIt emits an electron and an antineutrino.",
    "docs/c.md": "Gamma rays are photons of high energy.",
}
BAD_TXT = {
    "docs/empty.txt": (b"   \n\n  ", "empty"),
    "docs/binary.txt": (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)), "undecodable"),
    "docs/latin1.txt": ("caf\u00e9 cr\u00e8me".encode("latin-1"), "undecodable"),
    "docs/huge.txt": (b"word " * 3000, "oversized"),
}
JSONL_LINES = [
    json.dumps({"id": "j1", "text": "Photosynthesis converts light into chemical energy."}),
    "{not json",
    json.dumps({"id": "j3", "body": "wrong field"}),
    json.dumps({"id": "j4", "text": 42}),
    json.dumps({"id": "j5", "text": ""}),
    json.dumps(["a", "list"]),
    "",
    json.dumps({"id": "j8", "text": "Mitochondria are the powerhouse of the cell."}),
]
PARQUET_ROWS = [{"id": "p0", "text": "Volcanoes form where magma reaches the surface."}, {"id": "p1", "text": "  "}, {"id": "p2", "text": "Glaciers carve valleys."}]
MAX_BYTES = 10_000


def _put(client, bucket, key, data: bytes):
    client.put_object(Bucket=bucket, Key=key, Body=data)


@pytest.fixture(scope="module")
def s3_corpus(s3_client):
    bucket = "corpus-bad"
    s3_client.create_bucket(Bucket=bucket)
    for k, v in GOOD_TXT.items():
        _put(s3_client, bucket, k, v.encode())
    for k, (v, _) in BAD_TXT.items():
        _put(s3_client, bucket, k, v)
    _put(s3_client, bucket, "docs/records.jsonl", "\n".join(JSONL_LINES).encode())
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(PARQUET_ROWS), buf)
    _put(s3_client, bucket, "docs/rows.parquet", buf.getvalue())
    buf = io.BytesIO()
    pq.write_table(pa.table({"content": ["no text column"]}), buf)
    _put(s3_client, bucket, "docs/wrong.parquet", buf.getvalue())
    _put(s3_client, bucket, "docs/corrupt.parquet", b"PAR1 this is not parquet")
    _put(s3_client, bucket, "docs/ignored.csv", b"a,b\n1,2\n")  # not an input format
    _put(s3_client, bucket, "docs/_SUCCESS", b"")
    return f"s3://{bucket}/docs"


def _read_back(s3_client, bucket, prefix, table):
    """Read a published table with boto3 + pyarrow only (not our storage layer)."""
    ptr = json.loads(s3_client.get_object(Bucket=bucket, Key=f"{prefix}/{table}/_CURRENT")["Body"].read())
    objs = s3_client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/{table}/{ptr['version']}/")["Contents"]
    parts = [pq.read_table(io.BytesIO(s3_client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read())) for o in objs if o["Key"].endswith(".parquet")]
    return ptr, pa.concat_tables(parts)


def test_bad_input_is_quarantined_and_no_valid_record_lost(ray_cluster, s3_server, s3_client, s3_corpus):
    scfg = StorageConfig(s3_endpoint=s3_server, s3_allow_http=True)
    s3_client.create_bucket(Bucket="runs")
    root = storage.resolve("s3://runs/bad-input", scfg)
    stats = ingest.ingest(s3_corpus, root, IngestConfig(max_bytes=MAX_BYTES), scfg)

    ptr, docs = _read_back(s3_client, "runs", "bad-input", "documents")
    texts = sorted(docs.column("text").to_pylist())
    expected = sorted(
        list(GOOD_TXT.values())
        + [json.loads(JSONL_LINES[0])["text"], json.loads(JSONL_LINES[7])["text"]]
        + [PARQUET_ROWS[0]["text"], PARQUET_ROWS[2]["text"]]
    )
    assert texts == expected  # every valid record, exactly once
    assert ptr["rows"] == len(expected) == stats["documents"]
    assert len(set(docs.column("doc_id").to_pylist())) == len(expected)
    assert docs.column("doc_id").to_pylist() == sorted(docs.column("doc_id").to_pylist())

    _, q = _read_back(s3_client, "runs", "bad-input", "quarantine")
    got = {(r["source"].rsplit("/", 1)[-1], r["record"]): (r["reason"], r["detail"]) for r in q.to_pylist()}
    want = {
        ("empty.txt", "file"): "empty",
        ("binary.txt", "file"): "undecodable",
        ("latin1.txt", "file"): "undecodable",
        ("huge.txt", "file"): "oversized",
        ("records.jsonl", "line:2"): "malformed",
        ("records.jsonl", "line:3"): "wrong_schema",
        ("records.jsonl", "line:4"): "wrong_schema",
        ("records.jsonl", "line:5"): "empty",
        ("records.jsonl", "line:6"): "wrong_schema",
        ("rows.parquet", "row:1"): "empty",
        ("wrong.parquet", "file"): "wrong_schema",
        ("corrupt.parquet", "file"): "malformed",
    }
    assert {k: v[0] for k, v in got.items()} == want
    assert "missing field 'text'" in got[("records.jsonl", "line:3")][1]
    assert "is int, not a string" in got[("records.jsonl", "line:4")][1]
    assert str(MAX_BYTES) in got[("huge.txt", "file")][1]
    assert stats["quarantined"] == len(want) and stats["quarantine_reasons"]["wrong_schema"] == 4


def test_doc_ids_stable_across_storage(ray_cluster, tmp_path, s3_server, s3_corpus, s3_client):
    """The same corpus read from S3 and from a local copy gets the same ids."""
    scfg = StorageConfig(s3_endpoint=s3_server, s3_allow_http=True)
    local = tmp_path / "docs"
    for k, v in GOOD_TXT.items():
        p = tmp_path / k
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(v)
    root = storage.resolve(str(tmp_path / "out"))
    ingest.ingest(str(local), root, IngestConfig(), scfg)
    local_ids = dict(zip(*[storage.read_table(root, "documents").column(c).to_pylist() for c in ("text", "doc_id")]))
    s3_root = storage.resolve("s3://runs/bad-input", scfg)
    s3_ids = dict(zip(*[storage.read_table(s3_root, "documents").column(c).to_pylist() for c in ("text", "doc_id")]))
    assert all(s3_ids[t] == i for t, i in local_ids.items())


def test_missing_input_is_a_clear_error(tmp_path):
    with pytest.raises(ingest.IngestError, match="input not found"):
        ingest.list_inputs(str(tmp_path / "nope"), StorageConfig(), ["txt"])
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(ingest.IngestError, match="no .txt / .jsonl / .parquet files"):
        ingest.list_inputs(str(tmp_path), StorageConfig(), ["txt", "jsonl", "parquet"])


def _squash(s):
    return re.sub(r"\s+", "", s)


def test_chunker_covers_text_with_exact_slices(minilm_tokenizer_path):
    from tests.conftest import DEMO_CORPUS

    cfg = ChunkingConfig(target_tokens=96, max_tokens=128, min_tokens=16)
    chunker = chunking.Chunker(chunking.load_tokenizer(minilm_tokenizer_path), cfg)
    for path in sorted(DEMO_CORPUS.glob("*.txt"))[:4]:
        text = path.read_text()
        spans = chunker.chunk(text)
        assert spans and all(s.tokens <= cfg.max_tokens for s in spans)
        assert all(a.end <= b.start for a, b in zip(spans, spans[1:]))  # ordered, disjoint
        # nothing but whitespace falls between chunks
        assert _squash("".join(text[s.start : s.end] for s in spans)) == _squash(text)
        assert all(s.tokens == chunker.count(text[s.start : s.end]) for s in spans)


def test_rust_tokenizer_counts_like_transformers_and_never_truncates(minilm_tokenizer_path):
    """The chunker's tokenizer (tokenizer.json through `tokenizers`, no transformers import)
    gives transformers' ids and offsets, also past MiniLM's 128-token limit in that file."""
    from transformers import AutoTokenizer

    from tests.conftest import DEMO_CORPUS

    rust, hf = chunking.load_tokenizer(minilm_tokenizer_path), AutoTokenizer.from_pretrained(minilm_tokenizer_path)
    for path in sorted(DEMO_CORPUS.glob("*.txt")):
        text = path.read_text()
        want = hf(text, add_special_tokens=False, return_offsets_mapping=True)
        got = rust.encode(text, add_special_tokens=False)
        assert got.ids == want["input_ids"] and got.offsets == [tuple(o) for o in want["offset_mapping"]], path.name
        assert len(got.ids) > 128


def test_chunker_prefers_paragraph_and_sentence_boundaries(minilm_tokenizer_path):
    cfg = ChunkingConfig(target_tokens=24, max_tokens=40, min_tokens=4)
    chunker = chunking.Chunker(chunking.load_tokenizer(minilm_tokenizer_path), cfg)
    para1 = "The first paragraph talks about rivers. Rivers flow to the sea and carry sediment."
    para2 = "A second paragraph is about mountains. Mountains rise where plates collide."
    text = para1 + "\n\n" + para2
    chunks = [text[s.start : s.end] for s in chunker.chunk(text)]
    assert all(c.rstrip().endswith(".") for c in chunks)  # every cut is at a sentence end
    assert not any("\n\n" in c for c in chunks)
    long_sentence = " ".join(["word"] * 200) + "."
    spans = chunker.chunk(long_sentence)
    assert len(spans) > 1 and all(s.tokens <= cfg.max_tokens for s in spans)


def test_chunk_stage_on_ray_is_stable(ray_cluster, tmp_path, minilm_tokenizer_path):
    from tests.conftest import DEMO_CORPUS

    src = tmp_path / "corpus"
    src.mkdir()
    for p in sorted(DEMO_CORPUS.glob("*.txt"))[:3]:
        (src / p.name).write_text(p.read_text())
    cfg = ChunkingConfig()
    runs = []
    for i in range(2):
        root = storage.resolve(str(tmp_path / f"out{i}"))
        ingest.ingest(str(src), root, IngestConfig(), StorageConfig())
        stats = chunking.chunk(root, minilm_tokenizer_path, cfg)
        runs.append(storage.read_table(root, "chunks"))
    a, b = runs
    assert a.equals(b)  # same ids, texts and offsets on a rerun
    assert a.column("chunk_id").to_pylist() == sorted(a.column("chunk_id").to_pylist())
    assert len([f for f in os.listdir(storage.table_path(root, "chunks").path) if f.endswith(".parquet")]) == 1  # a small table is one file
    assert stats["chunks"] == a.num_rows and 40 <= stats["mean_tokens"] <= cfg.max_tokens
    docs = {r["doc_id"]: r["text"] for r in storage.read_table(root, "documents").to_pylist()}
    for r in a.to_pylist()[:50]:
        assert docs[r["doc_id"]][r["char_start"] : r["char_end"]] == r["text"]
        assert r["chunk_id"] == f"{r['doc_id']}-{r['chunk_index']:05d}"
