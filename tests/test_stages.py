"""The stage interface and the streaming LLM stages, on a real local Ray cluster with the
fast deterministic test engine (``engine.backend: test``): registry order, skip-if-done,
the cache join, per-batch cache writes, exactly-once output and the error-rate bound."""

from __future__ import annotations

import hashlib
import json
import shutil

import pyarrow as pa
import pytest

from atlas import runner, schemas, stage, storage
from atlas.config import EngineConfig, JudgeConfig, RunConfig, Stage1Config
from atlas.engine import GenerationCache
from tests.conftest import DEMO_CORPUS
from tests.engine_fixtures import alive_engine_servers, demo_chunks


def _cfg(**kw) -> RunConfig:
    base = dict(
        engine=EngineConfig(backend="test", batch_size=8, cpus_per_replica=0.5),
        stage1=Stage1Config(max_tags=4),
        judge=JudgeConfig(sample_chunks=4),
        # Stage 1 and the runner are under test here; Stages 2/3 run end to end in test_pipeline_e2e.
        stage2={"enabled": False},
        stage3={"enabled": False},
    )
    base.update(kw)
    return RunConfig(**base)


def _checksum(tbl: pa.Table, drop=("cached",)) -> str:
    rows = sorted(json.dumps({k: v for k, v in r.items() if k not in drop}, sort_keys=True) for r in tbl.to_pylist())
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()


# ------------------------------------------------------------------ no Ray


def test_pipeline_order_does_not_depend_on_import_order():
    """A caller that imports Stage 2 before Stage 1's module registers its stages first; the
    order must still be the data-flow order with ties in STAGE_MODULES order."""
    expected = stage.pipeline_order()
    saved = dict(stage.REGISTRY)
    try:
        late_first = sorted(saved, key=lambda n: not n.startswith(("stage2", "stage3")))
        stage.REGISTRY.clear()
        stage.REGISTRY.update({n: saved[n] for n in late_first})
        assert list(stage.REGISTRY)[0].startswith("stage2")
        assert stage.pipeline_order() == expected
    finally:
        stage.REGISTRY.clear()
        stage.REGISTRY.update(saved)


def test_registry_order_and_register_checks():
    assert stage.pipeline_order()[:4] == ["ingest", "chunk", "stage1_tags", "stage1_judge"]
    assert stage.pipeline_order(["stage1_judge", "chunk"]) == ["chunk", "stage1_judge"]
    with pytest.raises(Exception, match=r"unknown stage\(s\) \['tagging'\]"):
        stage.pipeline_order(["tagging"])
    with pytest.raises(TypeError, match="Stage protocol"):
        stage.register(object())
    tags = stage.REGISTRY["stage1_tags"]
    assert tags.inputs == ("chunks",) and tags.outputs == ("chunk_tags",)
    assert not tags.enabled(_cfg(stage1=Stage1Config(enabled=False)))
    assert not stage.REGISTRY["stage1_judge"].enabled(_cfg(stage1=Stage1Config(enabled=False)))


def test_fingerprint_follows_config_sections_and_input_versions(tmp_path):
    root = storage.resolve(str(tmp_path))
    storage.write_table(root, "chunks", demo_chunks(1, 1))
    tags = stage.REGISTRY["stage1_tags"]
    fp0, inputs = stage.fingerprint(tags, _cfg(), root)
    assert inputs == {"chunks": storage.current_version(root, "chunks")}
    assert stage.fingerprint(tags, _cfg(run_id="other", output="/elsewhere"), root)[0] == fp0  # not part of it
    assert stage.fingerprint(tags, _cfg(judge=JudgeConfig(sample_chunks=9)), root)[0] == fp0  # judge's section
    assert stage.fingerprint(tags, _cfg(stage1=Stage1Config(max_tags=5)), root)[0] != fp0
    storage.write_table(root, "chunks", demo_chunks(1, 1))  # same content, new version
    assert stage.fingerprint(tags, _cfg(), root)[0] != fp0


def test_error_rate_check_names_stage_rate_and_records():
    stage.check_error_rate("s", 2, 10, 0.2, [["c1", "bad"]])  # at the bound: fine
    with pytest.raises(stage.StageError) as e:
        stage.check_error_rate("stage1_tags", 3, 10, 0.2, [["chunk-7", "chunk chunk-7: not JSON"]])
    msg = str(e.value)
    assert "stage1_tags" in msg and "30.0%" in msg and "20.0%" in msg and "chunk-7" in msg and "not JSON" in msg


# ------------------------------------------------------------------ on Ray


@pytest.fixture()
def chunks_root(ray_cluster, tmp_path):
    root = storage.resolve(str(tmp_path / "out"))
    chunks = demo_chunks(n_docs=6, per_doc=3)
    storage.write_table(root, "chunks", chunks)
    return root, chunks


def test_tag_stage_streams_caches_per_batch_and_reruns_from_cache(chunks_root):
    from atlas.stage1_tags import tag_chunks

    root, chunks = chunks_root
    n = chunks.num_rows
    cfg = _cfg()
    first = tag_chunks(root, cfg)
    t1 = storage.read_table(root, "chunk_tags")
    assert t1.schema.equals(schemas.CHUNK_TAGS, check_metadata=False)
    assert sorted(t1.column("chunk_id").to_pylist()) == sorted(chunks.column("chunk_id").to_pylist())
    assert first["rows"] == n and first["generated"] == n and first["cached"] == 0 and first["errors"] == 0
    assert all(1 <= len(t) <= 4 for t in t1.column("tags").to_pylist())
    cache = GenerationCache(root)
    files = cache._files()
    # Written per engine batch (8 rows), not once at the end.
    assert len(files) >= -(-n // 8) and cache.rows() == n

    # Duplicate every cache entry (as two runs generating the same request would): the
    # join then matches twice, and the stage must still publish each chunk once.
    for f in files:
        shutil.copy(f, f.replace(".parquet", "-dup.parquet"))
    second = tag_chunks(root, cfg)
    t2 = storage.read_table(root, "chunk_tags")
    assert second["rows"] == n and second["cached"] == n and second["generated"] == 0 and not second["engine_started"]
    assert sorted(t2.column("chunk_id").to_pylist()) == sorted(chunks.column("chunk_id").to_pylist())
    assert all(t2.column("cached").to_pylist())
    assert _checksum(t1) == _checksum(t2)
    assert cache.rows() == 2 * n  # nothing generated, nothing appended


def test_error_rate_bound_fails_stage_and_keeps_previous_version(chunks_root):
    from atlas.stage1_tags import tag_chunks

    root, chunks = chunks_root
    bad = _cfg(engine=EngineConfig(backend="test", batch_size=8, cpus_per_replica=0.5, test_invalid_rate=0.5))
    with pytest.raises(stage.StageError) as e:
        tag_chunks(root, bad.model_copy(update={"stage1": Stage1Config(max_tags=4, max_error_rate=0.2)}))
    msg = str(e.value)
    assert "stage stage1_tags" in msg and "exceeds the configured bound 20.0%" in msg
    assert "not valid JSON" in msg and "chunk " in msg
    ids = set(chunks.column("chunk_id").to_pylist())
    assert any(i in msg for i in ids), msg  # names the records
    assert not storage.table_exists(root, "chunk_tags")  # nothing half-good was published

    ok = tag_chunks(root, bad.model_copy(update={"stage1": Stage1Config(max_tags=4, max_error_rate=0.9)}))
    t = storage.read_table(root, "chunk_tags")
    errs = [r for r in t.to_pylist() if r["error"]]
    assert ok["errors"] == len(errs) > 0 and ok["rows"] == chunks.num_rows
    assert all(r["tags"] == [] and r["chunk_id"] in r["error"] for r in errs)


def test_judge_small_and_scale_paths_agree(chunks_root, monkeypatch):
    """The judge attaches texts by value and aggregates in one group-by for small samples, and
    uses a Ray Data join + hash repartition at scale: both must publish the same tables."""
    from atlas import stage1_tags
    from atlas.stage1_tags import judge_tags, tag_chunks

    root, chunks = chunks_root
    cfg = _cfg(judge=JudgeConfig(sample_chunks=5))
    tag_chunks(root, cfg)
    small = judge_tags(root, cfg)
    tables = {t: storage.read_table(root, t) for t in ("tag_judgements", "tag_judge_by_chunk", "tag_judge_by_tag")}
    monkeypatch.setattr(stage1_tags, "SMALL_SAMPLE", 0)
    monkeypatch.setattr(stage1_tags, "SMALL_AGGREGATE", 0)
    scale = judge_tags(root, cfg)
    assert scale["cached"] == scale["rows"] == small["rows"] == small["generated"] > 0
    for t, before in tables.items():
        after = storage.read_table(root, t)
        assert _checksum(after) == _checksum(before), t
    j = tables["tag_judgements"].to_pylist()
    assert len({r["chunk_id"] for r in j}) == small["chunks"] == 5
    tag_rows = {r["chunk_id"]: r["tags"] for r in storage.read_table(root, "chunk_tags").to_pylist()}
    assert {(r["chunk_id"], r["tag"]) for r in j} == {(c, t) for c in {r["chunk_id"] for r in j} for t in tag_rows[c]}
    for rc in tables["tag_judge_by_chunk"].to_pylist():
        s = [r["expected_score"] for r in j if r["chunk_id"] == rc["chunk_id"]]
        assert rc["n_tags"] == len(s) and rc["mean_score"] == pytest.approx(sum(s) / len(s))
    # The stage keeps the engine's choice probabilities: the test engine puts most mass on 5
    # for a tag whose words occur in the chunk (its tags are such words), so these pairs score
    # high, with the expected score below the argmax (the distribution is not one-hot).
    assert all(r["error"] is None and len(r["answer_probs"]) == 5 for r in j)
    assert all(r["score"] == 5 and 3.5 < r["expected_score"] < 5.0 for r in j), j[:2]
    assert small["mean_score"] == pytest.approx(sum(r["expected_score"] for r in j) / len(j), abs=1e-3)


def test_runner_skips_up_to_date_stages_and_reruns_from_a_changed_one(ray_cluster, tmp_path, minilm_tokenizer_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for p in sorted(DEMO_CORPUS.glob("*.txt"))[:2]:
        (corpus / p.name).write_text(p.read_text()[:3000])
    out = tmp_path / "out"
    cfg = _cfg(input=str(corpus), output=str(out), chunking={"tokenizer": minilm_tokenizer_path}, run_id="r1")
    m1 = runner.run(cfg)
    stage1 = ("ingest", "chunk", "stage1_tags", "stage1_judge")
    assert [m1["stages"][n]["status"] for n in stage1] == ["done"] * 4
    root = storage.resolve(str(out))
    versions = {t: storage.current_version(root, t) for t in ("documents", "chunks", "chunk_tags", "tag_judgements")}
    assert m1["stages"]["stage1_judge"]["stats"]["chunks"] == 4
    assert m1["stages"]["stage1_tags"]["tables"]["chunk_tags"]["rows"] == m1["stages"]["chunk"]["tables"]["chunks"]["rows"]
    assert (out / "plots" / "tag_judge.png").read_bytes()[:4] == b"\x89PNG"
    # Tagging and judging use different models: each stage loads its own, and the run freed both.
    assert [m1["stages"][n]["stats"]["engine_loads"] for n in stage1] == [0, 0, 1, 1]
    assert alive_engine_servers() == 0

    m2 = runner.run(cfg.model_copy(update={"run_id": "r2"}))
    assert {n: m2["stages"][n]["status"] for n in stage1} == dict.fromkeys(stage1, "skipped")
    assert all("up to date (completed in run r1)" == m2["stages"][n]["reason"] for n in stage1)
    assert m2["stages"]["chunk"]["tables"]["chunks"]["version"] == versions["chunks"]
    assert {t: storage.current_version(root, t) for t in versions} == versions

    m3 = runner.run(cfg.model_copy(update={"run_id": "r3", "stage1": Stage1Config(max_tags=2)}))
    status = {n: m3["stages"][n]["status"] for n in stage1}
    assert [m3["stages"][n]["stats"]["engine_loads"] for n in stage1[2:]] == [1, 0]
    # The judge's questions (a chunk and one of its first tags) were all asked in r1: answered
    # from the cache, so its engine never started.
    assert m3["stages"]["stage1_judge"]["stats"]["generated"] == 0 < m3["stages"]["stage1_judge"]["stats"]["cached"]
    assert status == {"ingest": "skipped", "chunk": "skipped", "stage1_tags": "done", "stage1_judge": "done"}
    assert storage.current_version(root, "chunks") == versions["chunks"]
    assert storage.current_version(root, "chunk_tags") != versions["chunk_tags"]
    assert all(len(t) <= 2 for t in storage.read_table(root, "chunk_tags").column("tags").to_pylist())
    rec = json.loads((out / "_stages" / "stage1_tags.json").read_text())
    assert rec["run_id"] == "r3" and rec["inputs"] == {"chunks": versions["chunks"]}


def test_missing_input_table_is_a_clear_error(ray_cluster, tmp_path):
    cfg = _cfg(input=str(tmp_path), output=str(tmp_path / "o"))
    with pytest.raises(stage.StageError, match=r"stage stage1_tags needs table\(s\) \['chunks'\]"):
        runner.run(cfg, ("stage1_tags",))
    m = json.loads((tmp_path / "o" / "_manifest.json").read_text())
    assert m["status"] == "failed" and "needs table" in m["stages"]["stage1_tags"]["error"]
