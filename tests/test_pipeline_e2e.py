"""The whole pipeline built so far, as a user runs it: S3 in, S3 out, real vLLM, rerun from cache."""

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
    return ptr, pa.concat_tables(parts).sort_by("chunk_id") if parts else None


def test_pipeline_on_s3_and_cached_rerun(ray_cluster, s3_server, s3_client):
    s3_client.create_bucket(Bucket="e2e")
    for p in sorted(DEMO_CORPUS.glob("*.txt"))[:2]:
        s3_client.put_object(Bucket="e2e", Key=f"corpus/{p.name}", Body=p.read_bytes())
    s3_client.put_object(Bucket="e2e", Key="corpus/blank.txt", Body=b"\n\n")
    # 6 chunks: the assertions below allow 2 errors (33%), above the default bound.
    overrides = [f"storage.s3_endpoint={s3_server}", "storage.s3_allow_http=true", "stage1.max_chunks=6", "judge.sample_chunks=3", "stage1.max_error_rate=0.5"]
    cfg = load_config(overrides=overrides, input="s3://e2e/corpus", output="s3://e2e/run", run_id="e2e-1")

    first = runner.run(cfg)
    assert first["status"] == "done"
    st = first["stages"]
    assert st["ingest"]["stats"]["documents"] == 2 and st["ingest"]["stats"]["quarantine_reasons"] == {"empty": 1}
    tags_stats = st["stage1_tags"]["stats"]
    assert tags_stats["rows"] == 6 and tags_stats["engine_started"] and tags_stats["cached"] == 0
    ptr, tags = _read(s3_client, "e2e", "run", "chunk_tags")
    assert ptr["rows"] == tags.num_rows == 6
    ok = [r for r in tags.to_pylist() if r["error"] is None]
    assert len(ok) >= 4, tags.column("error").to_pylist()  # a real model tags most chunks
    for r in ok:
        assert 1 <= len(r["tags"]) <= cfg.stage1.max_tags
        assert all(t == t.strip().lower() and t for t in r["tags"])
    judge = st["stage1_judge"]["stats"]
    assert judge["chunks"] == 3 and judge["scored"] > 0
    png = s3_client.get_object(Bucket="e2e", Key="run/plots/tag_judge.png")["Body"].read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    manifest = json.loads(s3_client.get_object(Bucket="e2e", Key="run/_manifest.json")["Body"].read())
    assert manifest["run_id"] == "e2e-1" and manifest["stages"]["stage1_tags"]["tables"]["chunk_tags"]["rows"] == 6
    assert "atlas-test-secret" not in json.dumps(manifest)

    # Up-to-date stages are skipped; --force (force=True) reruns them, from the cache.
    skipped = runner.run(cfg.model_copy(update={"run_id": "e2e-2"}))
    assert {s["status"] for s in skipped["stages"].values()} == {"skipped"}
    second = runner.run(cfg.model_copy(update={"run_id": "e2e-3"}), force=True)
    again = second["stages"]["stage1_tags"]["stats"]
    assert again["cached"] == again["rows"] == 6 and not again["engine_started"]
    assert second["stages"]["stage1_judge"]["stats"]["engine_started"] is False
    _, tags2 = _read(s3_client, "e2e", "run", "chunk_tags")
    cols = [c for c in tags.column_names if c != "cached"]
    assert tags2.select(cols).equals(tags.select(cols))
    assert all(tags2.column("cached").to_pylist())
