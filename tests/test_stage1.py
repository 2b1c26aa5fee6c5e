"""Stage 1 on a real local Ray cluster and the real vLLM CPU engine (prepared Gemma 3 270M):
tagging, structured output, per-row errors, the request cache on rerun, and the judge."""

from __future__ import annotations

import hashlib
import json
import struct

import pyarrow as pa
import pytest

from atlas import schemas, storage
from atlas.config import JudgeConfig, RunConfig, Stage1Config
from atlas.engine import prompts
from atlas.stage1_tags import aggregate_judgements, normalize_tag, normalize_tags, parse_judgements, parse_tags
from tests.engine_fixtures import demo_chunks, small_engine_cfg  # ray_cluster comes from tests/conftest.py

BAD_CHUNK = "zz-injected-00000"  # sorts last; its prompt exceeds max_model_len


# ------------------------------------------------------------------ unit


def test_normalize_tags():
    raw = ['  "Naval  History" ', "naval history", "Naval history.", "BATTLESHIPS!", "", "  ", "1998",
           "a b c d e f g h", "Japan's navy", "«Russo-Japanese War»", "x" * 80, "extra", "more"]
    out = normalize_tags(raw, max_tags=4, max_words=6)
    assert out == ["naval history", "battleships", "japan s navy", "russo-japanese war"]
    assert normalize_tag("'Tokyo'", 6) == "tokyo"
    assert normalize_tag("one two three", 2) is None
    assert normalize_tag("--", 6) is None


def test_parse_tags_reasons():
    schema = prompts.tag_schema(3)
    assert parse_tags('["a", "b"]', schema) == (["a", "b"], None)
    assert "not valid JSON" in parse_tags('["a", "b', schema)[1]
    assert "not a JSON list of strings" in parse_tags('{"a": 1}', schema)[1]
    assert "4 items" in parse_tags('["a","b","c","d"]', schema)[1]
    assert parse_tags(None, schema)[1] == "no output"


def test_aggregate_judgements_means():
    j = pa.table(
        {
            "chunk_id": ["c1", "c1", "c2", "c2"],
            "tag": ["t1", "t2", "t1", "t3"],
            "expected_score": pa.array([4.5, 3.25, 1.5, None], pa.float64()),
            "score": pa.array([5, 3, 1, None], pa.int8()),
            "error": [None, None, None, "bad"],
            "model": ["m"] * 4,
        }
    )
    by_c, by_t = aggregate_judgements(j)
    assert by_c.to_pylist() == [
        {"chunk_id": "c1", "n_tags": 2, "mean_score": pytest.approx(3.875)},
        {"chunk_id": "c2", "n_tags": 2, "mean_score": 1.5},
    ]
    assert {r["tag"]: r["mean_score"] for r in by_t.to_pylist()} == {"t1": 3.0, "t2": 3.25, "t3": None}


def test_parse_judgements_expected_score_argmax_and_errors():
    from atlas.engine import score_text

    choices = prompts.JUDGE_CHOICES
    ok = score_text(choices, [0.1, 0.0, 0.2, 0.3, 0.4], 0.75)
    flat = score_text(choices, [0.2] * 5, 0.5)
    wrong = score_text(["a", "b"], [0.5, 0.5], 1.0)
    cols = parse_judgements([ok, flat, "5", wrong, None], [None, None, None, None, "engine failure: boom"])
    assert cols["expected_score"][0] == pytest.approx(0.1 + 0.6 + 1.2 + 2.0)  # 3.9
    assert cols["score"][:2] == [5, 1]  # argmax (ties: the lowest answer)
    assert cols["expected_score"][1] == pytest.approx(3.0)
    assert cols["answer_probs"][0] == pytest.approx([0.1, 0.0, 0.2, 0.3, 0.4]) and cols["choice_mass"][0] == pytest.approx(0.75)
    assert cols["error"][:2] == [None, None]
    # a sampled answer (old judge) or other choices are not scoring output; an engine error passes through
    assert "not a choice-scoring output" in cols["error"][2] and "not 1..5" in cols["error"][3]
    assert cols["error"][4] == "engine failure: boom"
    for k in ("expected_score", "score", "answer_probs"):
        assert cols[k][2:] == [None, None, None]


# ------------------------------------------------------------------ integration


def _checksum(tbl: pa.Table, drop=("cached",)) -> str:
    rows = sorted(json.dumps({k: v for k, v in r.items() if k not in drop}, sort_keys=True) for r in tbl.to_pylist())
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()


@pytest.fixture(scope="module")
def stage1_run(ray_cluster, tmp_path_factory):
    from atlas.engine.runner import engine_session
    from atlas.stage1_tags import judge_tags, tag_chunks

    out = tmp_path_factory.mktemp("stage1")
    root = storage.resolve(str(out))
    chunks = demo_chunks(n_docs=6, per_doc=2)
    bad = {
        "chunk_id": BAD_CHUNK, "doc_id": "zz-injected", "chunk_index": 0,
        "text": "lobster " * 3000, "n_tokens": 3000, "char_start": 0, "char_end": 24000,
    }
    chunks = pa.concat_tables([chunks, schemas.conform(pa.Table.from_pylist([bad]), schemas.CHUNKS)])
    storage.write_table(root, "chunks", chunks)
    cfg = RunConfig(
        engine=small_engine_cfg(max_model_len=2048),  # the judge's chat prompts are ~1.5k tokens
        # The injected over-long chunk is 1 error in 13 by design; the small model may add a few.
        stage1=Stage1Config(max_tags=5, max_new_tokens=48, max_error_rate=0.5),
        judge=JudgeConfig(sample_chunks=6),
    )
    with engine_session():  # as in a run: engines on shared servers, the judge's model replacing the tagger's
        first = tag_chunks(root, cfg)
        t1 = storage.read_table(root, "chunk_tags")
        second = tag_chunks(root, cfg)
        t2 = storage.read_table(root, "chunk_tags")
        judge = judge_tags(root, cfg)
    return dict(root=root, cfg=cfg, chunks=chunks, first=first, second=second, t1=t1, t2=t2, judge=judge, out=out)


@pytest.mark.slow
def test_tag_chunks_first_run(stage1_run):
    s, t, cfg = stage1_run["first"], stage1_run["t1"], stage1_run["cfg"]
    n = stage1_run["chunks"].num_rows
    assert t.schema.equals(schemas.CHUNK_TAGS, check_metadata=False)
    assert s["rows"] == t.num_rows == n and s["cached"] == 0 and s["engine_started"]
    assert s["ok"] + s["errors"] == n and s["output_tokens"] > 0
    assert sorted(t.column("chunk_id").to_pylist()) == sorted(stage1_run["chunks"].column("chunk_id").to_pylist())
    rows = {r["chunk_id"]: r for r in t.to_pylist()}
    bad = rows[BAD_CHUNK]
    assert bad["tags"] == [] and BAD_CHUNK in bad["error"] and "prompt too long" in bad["error"]
    good = [r for cid, r in rows.items() if cid != BAD_CHUNK]
    ok = [r for r in good if r["error"] is None]
    assert len(ok) >= 0.6 * len(good), [r["error"] for r in good if r["error"]]
    for r in good:
        if r["error"]:
            assert r["chunk_id"] in r["error"] and r["tags"] == []
    for r in ok:
        assert 1 <= len(r["tags"]) <= cfg.stage1.max_tags
        assert len(set(r["tags"])) == len(r["tags"])
        for tag in r["tags"]:
            assert tag == normalize_tag(tag, cfg.stage1.max_tag_words), f"{r['chunk_id']}: tag {tag!r} not normalised"
        assert r["model"] == "embedded:gemma3-270m" and len(r["request_hash"]) == 64 and not r["cached"]
    # tags are topical, not the prompt's examples parroted back for every chunk
    distinct = {tag for r in ok for tag in r["tags"]}
    assert len(distinct) >= len(ok), distinct


@pytest.mark.slow
def test_structured_output_parses_as_schema(stage1_run):
    schema = prompts.tag_schema(stage1_run["cfg"].stage1.max_tags)
    for r in stage1_run["t1"].to_pylist():
        if r["error"] is None:
            val = json.loads(r["raw_output"])
            assert isinstance(val, list) and schema["minItems"] <= len(val) <= schema["maxItems"], r
            assert all(isinstance(x, str) and 1 <= len(x) <= schema["items"]["maxLength"] for x in val), r


@pytest.mark.slow
def test_rerun_uses_cache_and_does_not_start_engine(stage1_run):
    s2, t1, t2 = stage1_run["second"], stage1_run["t1"], stage1_run["t2"]
    assert s2["cached"] == s2["rows"] == t1.num_rows
    assert s2["engine_started"] is False and s2["generated"] == 0
    assert all(t2.column("cached").to_pylist())
    assert _checksum(t1) == _checksum(t2)
    assert s2["seconds"] < stage1_run["first"]["seconds"]


@pytest.mark.slow
def test_judge_scores_tables_and_plot(stage1_run):
    root, js = stage1_run["root"], stage1_run["judge"]
    j = storage.read_table(root, "tag_judgements")
    assert j.schema.equals(schemas.TAG_JUDGEMENTS, check_metadata=False)
    tags = stage1_run["t1"]
    expected_pairs = {
        (r["chunk_id"], tag)
        for r in sorted(tags.to_pylist(), key=lambda r: r["chunk_id"])
        if r["error"] is None
        for tag in r["tags"]
    }
    got_pairs = {(r["chunk_id"], r["tag"]) for r in j.to_pylist()}
    assert got_pairs <= expected_pairs and len(got_pairs) == j.num_rows == js["pairs"] > 0
    assert len({c for c, _ in got_pairs}) == min(6, len({c for c, _ in expected_pairs}))
    for r in j.to_pylist():
        if r["error"] is None:
            # probabilities from the real engine: a distribution over 1..5, not one sampled token
            p = r["answer_probs"]
            assert len(p) == 5 and sum(p) == pytest.approx(1.0, abs=1e-4) and 0 < r["choice_mass"] <= 1.0 + 1e-6, r
            assert r["expected_score"] == pytest.approx(sum((k + 1) * x for k, x in enumerate(p)), abs=1e-4), r
            assert 1.0 <= r["expected_score"] <= 5.0 and r["score"] == 1 + p.index(max(p)), r
        else:
            assert r["score"] is None and r["expected_score"] is None and r["chunk_id"] in r["error"]
    assert js["scored"] > 0
    by_c = storage.read_table(root, "tag_judge_by_chunk").to_pylist()
    by_t = storage.read_table(root, "tag_judge_by_tag").to_pylist()
    rows = j.to_pylist()
    for rc in by_c:
        s = [r["expected_score"] for r in rows if r["chunk_id"] == rc["chunk_id"] and r["expected_score"] is not None]
        assert rc["n_tags"] == sum(r["chunk_id"] == rc["chunk_id"] for r in rows)
        assert rc["mean_score"] == pytest.approx(sum(s) / len(s))
    for rt in by_t:
        s = [r["expected_score"] for r in rows if r["tag"] == rt["tag"] and r["expected_score"] is not None]
        assert rt["n_chunks"] == sum(r["tag"] == rt["tag"] for r in rows)
        assert rt["mean_score"] == pytest.approx(sum(s) / len(s))
    assert {r["chunk_id"] for r in by_c} == {c for c, _ in got_pairs}
    png = (stage1_run["out"] / "plots" / "tag_judge.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert width > 300 and height > 200
    import matplotlib.image as mpimg

    assert mpimg.imread(str(stage1_run["out"] / "plots" / "tag_judge.png")).shape[:2] == (height, width)
