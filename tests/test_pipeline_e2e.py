"""The whole pipeline as a user runs it: Stage 1 -> 2 -> 3 with S3 in and S3 out (the local
S3-compatible server), real vLLM and MiniLM, a local Ray cluster; then a rerun from cache."""

import io
import json

import pyarrow.parquet as pq
import pytest

from atlas import runner
from atlas.config import load_config

from tests.conftest import DEMO_CORPUS

pytestmark = pytest.mark.slow


def _read(s3_client, bucket, prefix, table):
    ptr = json.loads(s3_client.get_object(Bucket=bucket, Key=f"{prefix}/{table}/_CURRENT")["Body"].read())
    keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/{table}/{ptr['version']}/")["Contents"]]
    import pyarrow as pa

    parts = [pq.read_table(io.BytesIO(s3_client.get_object(Bucket=bucket, Key=k)["Body"].read())) for k in keys if k.endswith(".parquet")]
    if not parts:
        return ptr, None
    tbl = pa.concat_tables(parts)
    return ptr, tbl.sort_by("chunk_id") if "chunk_id" in tbl.column_names else tbl


def test_pipeline_on_s3_and_cached_rerun(ray_cluster, s3_server, s3_client):
    s3_client.create_bucket(Bucket="e2e")
    for p in sorted(DEMO_CORPUS.glob("*.txt"))[:2]:
        s3_client.put_object(Bucket="e2e", Key=f"corpus/{p.name}", Body=p.read_bytes())
    s3_client.put_object(Bucket="e2e", Key="corpus/blank.txt", Body=b"\n\n")
    # 16 tagged chunks: the assertions below allow 4 errors (25%), above the default bound.
    overrides = [f"storage.s3_endpoint={s3_server}", "storage.s3_allow_http=true", "stage1.max_chunks=16", "judge.sample_chunks=3",
                 "stage1.max_error_rate=0.5", "stage2.label_max_new_tokens=64", "stage2.judge_chunks=4", "stage3.epochs=4",
                 "engine.kv_cache_gib=0.5"]
    cfg = load_config(overrides=overrides, input="s3://e2e/corpus", output="s3://e2e/run", run_id="e2e-1")

    first = runner.run(cfg)
    st = first["stages"]
    print("stage seconds:", {n: s.get("seconds") for n, s in st.items()})
    assert first["status"] == "done"
    # Consecutive LLM stages on the same model share its engine (concepts reuses labelling's);
    # the judges run another model, which frees the one before it.
    loads = {n: s["stats"]["engine_loads"] for n, s in st.items() if s["status"] == "done"}
    assert loads == {"ingest": 0, "chunk": 0, "stage1_tags": 1, "stage1_judge": 1, "stage2_embed": 0, "stage2_cluster": 0,
                     "stage2_label": 1, "stage2_concepts": 0, "stage2_judge": 1, "stage3_train": 0, "stage3_annotate": 0}, loads
    assert st["ingest"]["stats"]["documents"] == 2 and st["ingest"]["stats"]["quarantine_reasons"] == {"empty": 1}
    tags_stats = st["stage1_tags"]["stats"]
    assert tags_stats["rows"] == 16 and tags_stats["engine_started"] and tags_stats["cached"] == 0
    ptr, tags = _read(s3_client, "e2e", "run", "chunk_tags")
    assert ptr["rows"] == tags.num_rows == 16
    ok = [r for r in tags.to_pylist() if r["error"] is None]
    assert len(ok) >= 12, tags.column("error").to_pylist()  # a real model tags most chunks
    for r in ok:
        assert 1 <= len(r["tags"]) <= cfg.stage1.max_tags
        assert all(t == t.strip().lower() and t for t in r["tags"])
    judge = st["stage1_judge"]["stats"]
    assert judge["chunks"] == 3 and judge["scored"] > 0
    png = s3_client.get_object(Bucket="e2e", Key="run/plots/tag_judge.png")["Body"].read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    manifest = json.loads(s3_client.get_object(Bucket="e2e", Key="run/_manifest.json")["Body"].read())
    assert manifest["run_id"] == "e2e-1" and manifest["stages"]["stage1_tags"]["tables"]["chunk_tags"]["rows"] == 16
    assert "atlas-test-secret" not in json.dumps(manifest)

    _check_concepts_and_annotations(s3_client, st, {t for r in ok for t in r["tags"]}, s3_server)

    # Up-to-date stages are skipped; --force (force=True) reruns them, from the cache (the LLM
    # stages only: rerunning Stages 2-3 too would add minutes and check nothing cache-related).
    skipped = runner.run(cfg.model_copy(update={"run_id": "e2e-2"}))
    assert {s["status"] for s in skipped["stages"].values()} == {"skipped"}
    second = runner.run(cfg.model_copy(update={"run_id": "e2e-3"}), stages=("stage1_tags", "stage1_judge"), force=True)
    again = second["stages"]["stage1_tags"]["stats"]
    assert again["cached"] == again["rows"] == 16 and not again["engine_started"] and again["engine_loads"] == 0
    assert second["stages"]["stage1_judge"]["stats"]["engine_started"] is False
    _, tags2 = _read(s3_client, "e2e", "run", "chunk_tags")
    cols = [c for c in tags.column_names if c != "cached"]
    assert tags2.select(cols).equals(tags.select(cols))
    assert all(tags2.column("cached").to_pylist())


def _check_concepts_and_annotations(s3_client, st, tags: set[str], endpoint: str) -> None:
    """Stage 2 turned the real tags into a library; Stage 3 annotated every chunk exactly once
    against that library; the tables answer the README's query."""
    from atlas import query, storage
    from atlas.cli import SAMPLE_QUERY
    from atlas.config import StorageConfig

    assert all(st[n]["status"] == "done" for n in ("stage2_embed", "stage2_cluster", "stage2_label", "stage2_concepts",
                                                     "stage3_train", "stage3_annotate")), {n: s["status"] for n, s in st.items()}
    _, concepts = _read(s3_client, "e2e", "run", "concepts")
    assert concepts.num_rows >= 2 and all(concepts.column("name").to_pylist())
    assert len(set(concepts.column("concept_id").to_pylist())) == concepts.num_rows
    _, tag_map = _read(s3_client, "e2e", "run", "tag_concepts")
    rows = tag_map.to_pylist()
    assert {r["tag"] for r in rows} == tags  # every tag of Stage 1 is mapped or recorded as dropped
    assert all((r["concept_id"] is None) != (r["drop_reason"] is None) for r in rows)
    assert {r["concept_id"] for r in rows if r["concept_id"]} <= set(concepts.column("concept_id").to_pylist())

    chunks_ptr, chunks = _read(s3_client, "e2e", "run", "chunks")
    scfg = StorageConfig(s3_endpoint=endpoint)
    ann = storage.read_table(storage.resolve("s3://e2e/run", scfg), "annotations")
    ids = ann.column("chunk_id").to_pylist()
    assert len(ids) == len(set(ids)) == chunks_ptr["rows"] and set(ids) == set(chunks.column("chunk_id").to_pylist())
    n = concepts.num_rows
    for r in ann.to_pylist():
        assert len(r["concept_ids"]) == len(r["concept_scores"]) and all(0 <= c < n for c in r["concept_ids"])
    assert len(set(ann.column("library_version").to_pylist())) == 1
    long = storage.read_table(storage.resolve("s3://e2e/run", scfg), "annotation_concepts")
    assert sorted(zip(long.column("chunk_id").to_pylist(), long.column("concept_id").to_pylist())) == sorted(
        (r["chunk_id"], c) for r in ann.to_pylist() for c in r["concept_ids"])
    assert st["stage3_train"]["stats"]["library_version"] == ann.column("library_version")[0].as_py()
    # Fig. 10's judge ratings ran through the real judge engine: every sampled pair and its control scored.
    ev = storage.read_json(storage.resolve(st["stage3_train"]["stats"]["annotator_uri"], scfg).join("eval.json"))
    judged = next(iter(ev.values())).get("judge")
    if judged:
        assert judged["predicted"]["rated"] == judged["random_concept"]["rated"] == judged["difference"]["pairs"] > 0, judged
        assert 1 <= judged["predicted"]["mean"] <= 5 and 1 <= judged["random_concept"]["mean"] <= 5
    # Fig. 9 through the real judge engine: the assigned concepts of 4 labelled chunks, each beside its control.
    j = st["stage2_judge"]
    assert j["status"] == "done" and 1 <= j["stats"]["chunks"] <= 4 and j["stats"]["pairs"] > 0, j
    rated = storage.read_table(storage.resolve("s3://e2e/run", scfg), "concept_judgements")
    assert rated.num_rows == 2 * j["stats"]["pairs"] and rated.column("expected_score").null_count < rated.num_rows
    top = query.sql("s3://e2e/run", SAMPLE_QUERY, scfg)
    assert top.columns == ["concept", "chunks"] and set(top["concept"].to_list()) <= set(concepts.column("name").to_pylist())
