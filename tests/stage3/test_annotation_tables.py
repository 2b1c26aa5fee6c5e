"""The annotation job's two tables without Ray: parts written by the job's own ``write_group``,
verified and published by ``verify_and_publish``; ``annotation_concepts`` is exactly the long
form of ``annotations``; a missing or short twin part stops publication; the README's query
examples run and agree with the list-table formulation."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pyarrow as pa
import pytest

from atlas import query, schemas, storage
from atlas.stage3 import annotate as job
from tests.stage3.fixtures import planted

README = Path(__file__).resolve().parents[2] / "README.md"
BUCKETS = 3


def _annotated(n: int = 60) -> tuple[pa.Table, pa.Table]:
    """Planted chunks with 0-3 distinct concept ids each, two sources; and the concepts table."""
    chunks, _, _ = planted(n, n_docs=6)
    rng = random.Random(1)
    n_concepts = 10  # the README's examples name concept index 7
    concepts = pa.table({"concept_id": [f"c-{i:02d}" for i in range(n_concepts)], "name": [f"concept {i}" for i in range(n_concepts)]})
    ids = [sorted(rng.sample(range(n_concepts), rng.choice([0, 1, 2, 3, 4]))) for _ in range(n)]
    t = pa.table({
        "chunk_id": chunks.column("chunk_id"), "doc_id": chunks.column("doc_id"), "chunk_index": chunks.column("chunk_index").cast(pa.int32()),
        "source": ["wiki" if int(d[1:]) % 2 else "news" for d in chunks.column("doc_id").to_pylist()],
        "text": chunks.column("text"),
        "concept_ids": pa.array(ids, pa.list_(pa.int32())),
        "concept_scores": pa.array([[round(rng.random(), 3) for _ in x] for x in ids], pa.list_(pa.float32())),
        "annotator": ["test"] * n, "library_version": ["lib-test"] * n,
    })
    t = t.append_column("bucket", pa.array(job.bucket_of(t.column("chunk_id").to_pylist(), BUCKETS)))
    return t, concepts


def _write_parts(root: storage.Location, t: pa.Table) -> storage.Location:
    out = job.output_location(root, "input-test", "annotator-test", BUCKETS)
    for source in ("news", "wiki"):
        for b in range(BUCKETS):
            group = t.filter(pa.compute.and_(pa.compute.equal(t["source"], source), pa.compute.equal(t["bucket"], b)))
            if group.num_rows:
                stats = job.write_group(group, out.uri, job.concepts_location(out).uri, BUCKETS)
                assert stats.column("labels")[0].as_py() == sum(len(x) for x in group.column("concept_ids").to_pylist())
    return out


def test_long_form_is_exact_and_published_with_annotations(tmp_path):
    t, concepts = _annotated()
    root = storage.resolve(str(tmp_path / "run"))
    out = _write_parts(root, t)
    stats = job.verify_and_publish(root, out, t.num_rows, {"buckets": BUCKETS})
    n_labels = sum(len(x) for x in t.column("concept_ids").to_pylist())
    assert stats["rows"] == t.num_rows and stats["labels"] == n_labels
    long = storage.read_table(root, job.CONCEPTS_TABLE)
    assert long.schema.equals(schemas.ANNOTATION_CONCEPTS, check_metadata=False)
    expected = sorted((c, s, i) for c, s, ids in zip(*(t.column(n).to_pylist() for n in ("chunk_id", "source", "concept_ids"))) for i in ids)
    assert sorted(zip(*(long.column(n).to_pylist() for n in ("chunk_id", "source", "concept_id")))) == expected
    # Same version name, same part layout: one listing answers for both tables.
    ann_dir = Path(storage.table_path(root, "annotations").path)
    long_dir = Path(storage.table_path(root, job.CONCEPTS_TABLE).path)
    assert ann_dir.name == long_dir.name
    assert sorted(p.relative_to(ann_dir) for p in ann_dir.rglob("*.parquet")) == sorted(p.relative_to(long_dir) for p in long_dir.rglob("*.parquet"))


@pytest.mark.parametrize("fault", ["missing", "short"])
def test_a_bad_twin_part_stops_publication(tmp_path, fault):
    t, _ = _annotated()
    root = storage.resolve(str(tmp_path / "run"))
    out = _write_parts(root, t)
    twin = sorted(Path(job.concepts_location(out).path).rglob("*.parquet"))[0]
    if fault == "missing":
        twin.unlink()
    else:  # a twin from other rows: one label fewer than its annotations part
        part = pa.parquet.read_table(twin)
        pa.parquet.write_table(part.slice(1), twin)
    with pytest.raises(job.AnnotateError, match=re.escape(twin.name)):
        job.verify_and_publish(root, out, t.num_rows, {"buckets": BUCKETS})
    assert not storage.table_exists(root, "annotations") and not storage.table_exists(root, job.CONCEPTS_TABLE)
    # A rerun annotates the group of a missing twin again, and only that group.
    done = job.done_groups(out, BUCKETS)
    all_groups = job.written_parts(out, BUCKETS)
    group = (twin.parent.name[len("source="):], int(twin.name.split("-b")[1].split("-")[0]))
    if fault == "missing":
        assert set(all_groups) - set(done) == {group}
    else:
        assert done == all_groups


def _readme_queries() -> list[str]:
    text = README.read_text()
    block = text[text.index("Query examples"):]
    block = block[block.index("```bash"):block.index("```", block.index("```bash") + 7)]
    return [m.group(1) for m in re.finditer(r'atlas query RUN "(.*?)"', block, re.S)]


def test_readme_query_examples_run_and_agree_with_the_list_table(tmp_path):
    t, concepts = _annotated()
    root = storage.resolve(str(tmp_path / "run"))
    storage.write_table(root, "concepts", concepts)
    job.verify_and_publish(root, _write_parts(root, t), t.num_rows, {"buckets": BUCKETS})
    examples = _readme_queries()
    assert len(examples) == 3, examples
    top, for_concept, pairs = (query.sql(root.uri, q) for q in examples)

    rows = list(zip(*(t.column(n).to_pylist() for n in ("chunk_id", "source", "concept_ids"))))
    per_source: dict[tuple[str, int], int] = {}
    for _, s, ids in rows:
        for i in ids:
            per_source[(s, i)] = per_source.get((s, i), 0) + 1
    assert {(r["source"], r["concept_id"]): r["n"] for r in top.to_dicts()} == per_source
    assert sorted(for_concept["chunk_id"].to_list()) == sorted(c for c, _, ids in rows if 7 in ids) != []
    assert set(for_concept["name"].to_list()) == {"concept 7"}
    co: dict[tuple[int, int], int] = {}
    for _, _, ids in rows:
        for a in ids:
            for b in ids:
                if a < b:
                    co[(a, b)] = co.get((a, b), 0) + 1
    assert pairs.height == min(20, len(co))
    assert all(co[(r["a"], r["b"])] == r["n"] for r in pairs.to_dicts())
    assert sorted(pairs["n"].to_list(), reverse=True) == sorted(co.values(), reverse=True)[: pairs.height]
    # The list table answers the first example identically (polars' UNNEST turns an empty list
    # into one null row, hence the filter the long form does not need).
    via_lists = query.sql(root.uri, "WITH ex AS (SELECT source, UNNEST(concept_ids) AS concept_id FROM annotations) "
                                    "SELECT source, concept_id, count(*) AS n FROM ex WHERE concept_id IS NOT NULL GROUP BY source, concept_id")
    assert {(r["source"], r["concept_id"]): r["n"] for r in via_lists.to_dicts()} == per_source
