"""Annotation at scale: a real Ray Data job, SIGKILLed mid-run and restarted, against an
uninterrupted run of the same job on S3 (moto on 127.0.0.1); tables read back by pyarrow,
polars and duckdb.

The annotator here is the real MiniLM encoder with a seeded, untrained linear head: what is
under test is the job (exactly-once output, resume), not annotation quality (see
test_stage3_train.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from atlas import schemas, storage
from atlas.config import Stage3Config, StorageConfig
from atlas.stage3 import annotate as job
from atlas.stage3.annotators import Annotator, AnnotatorConfig, LinearHead
from tests.conftest import kill_marked_processes
from tests.stage3.fixtures import planted

REPO = Path(__file__).resolve().parents[2]
N_CHUNKS = 360
ROWS_PER_PART = 30


def _publish_inputs(root: storage.Location, chunks: pa.Table) -> None:
    doc_ids = sorted(set(chunks.column("doc_id").to_pylist()))
    docs = pa.table({
        "doc_id": doc_ids,
        # two sources: the folder holding each file
        "source": [f"file:///corpus/{'wiki' if i % 2 else 'news'}/{d}.txt" for i, d in enumerate(doc_ids)],
        "record": ["file"] * len(doc_ids), "source_id": [None] * len(doc_ids), "title": [None] * len(doc_ids),
        "text": ["x"] * len(doc_ids), "n_chars": [1] * len(doc_ids),
    })
    storage.write_table(root, "documents", schemas.conform(docs, schemas.DOCUMENTS))
    storage.write_table(root, "chunks", schemas.conform(chunks, schemas.CHUNKS))


def _annotator(concepts: list[str]) -> Annotator:
    torch.manual_seed(0)
    head = LinearHead(384, len(concepts))
    cfg = AnnotatorConfig(kind="encoder", concept_ids=concepts, library_version="lib-test", thresholds=[0.5] * len(concepts))
    return Annotator(cfg, head)


def _digest(t: pa.Table) -> tuple[list[str], str]:
    t = t.sort_by("chunk_id")
    h = hashlib.sha256()
    for cid, ids, sc, lib in zip(*(t.column(c).to_pylist() for c in ("chunk_id", "concept_ids", "concept_scores", "library_version"))):
        h.update(json.dumps([cid, ids, [round(s, 5) for s in sc], lib]).encode())
    return t.column("chunk_id").to_pylist(), h.hexdigest()


def _read(root: storage.Location, table: str = "annotations") -> pa.Table:
    loc = storage.table_path(root, table)
    return pq.read_table(loc.path, filesystem=loc.fs, partitioning=None)


def _check_long_form(root: storage.Location, annotations: pa.Table) -> None:
    """``annotation_concepts`` holds exactly the (chunk, concept, score) labels of ``annotations``, once each."""
    long = _read(root, job.CONCEPTS_TABLE)
    assert long.schema.equals(schemas.ANNOTATION_CONCEPTS, check_metadata=False)
    expected = sorted(
        (c, s, i, round(x, 5))
        for c, s, ids, sc in zip(*(annotations.column(n).to_pylist() for n in ("chunk_id", "source", "concept_ids", "concept_scores")))
        for i, x in zip(ids, sc)
    )
    got = sorted(zip(*(long.column(n).to_pylist() for n in ("chunk_id", "source", "concept_id")), [round(x, 5) for x in long.column("score").to_pylist()]))
    assert got == expected
    assert storage.read_json(root.join(job.CONCEPTS_TABLE, storage.POINTER))["rows"] == len(expected)


@pytest.mark.slow
def test_sigkill_and_restart_writes_every_chunk_once(tmp_path, ray_cluster, s3_server, s3_client):
    chunks, _, concepts = planted(N_CHUNKS, n_docs=24)
    concept_ids = sorted(concepts.column("concept_id").to_pylist())
    ann = _annotator(concept_ids)

    # Reference: one uninterrupted run of the same job, on S3.
    bucket = f"stage3-{uuid.uuid4().hex[:8]}"
    s3_client.create_bucket(Bucket=bucket)
    scfg = StorageConfig(s3_endpoint=s3_server)
    s3_root = storage.resolve(f"s3://{bucket}/run", scfg)
    _publish_inputs(s3_root, chunks)
    ann.save(s3_root.join("_annotators", "enc"))
    # Two annotator actors on the 2-CPU cluster (their CPU reservation must leave room for the
    # read and shuffle tasks, or the job never progresses); the killed command below runs one.
    s3 = Stage3Config(rows_per_part=ROWS_PER_PART, actors=2, inference_batch_size=64)
    ref_stats = job.annotate_run(s3_root, s3_root.join("_annotators", "enc").uri, s3, scfg)
    assert ref_stats["rows"] == N_CHUNKS and ref_stats["annotated_rows"] == N_CHUNKS
    ref = _read(s3_root)

    # The same job as a command, SIGKILLed after a few parts are on disk, then rerun.
    root = storage.resolve(str(tmp_path / "run"))
    _publish_inputs(root, chunks)
    ann_uri = ann.save(root.join("_annotators", "enc")).uri
    ray_tmp = f"/tmp/s3k-{uuid.uuid4().hex[:6]}"
    os.makedirs(ray_tmp)
    env = {**os.environ, "PYTHONPATH": str(REPO), "ATLAS_RAY_TMP": ray_tmp, "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "atlas.stage3.annotate", root.uri, ann_uri, "--rows-per-part", str(ROWS_PER_PART)]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    parts_dir = tmp_path / "run" / "annotations"
    deadline = time.time() + 240
    killed_with = 0
    try:
        while time.time() < deadline and proc.poll() is None:
            n = len(list(parts_dir.glob("v-*/source=*/part-*.parquet")))
            if n >= 2:
                os.killpg(proc.pid, signal.SIGKILL)
                killed_with = n
                break
            time.sleep(0.05)
    finally:
        if proc.poll() is None and not killed_with:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        kill_marked_processes(ray_tmp)
    assert killed_with, f"the run ended before it could be killed: {proc.stdout.read().decode()[-2000:]}"
    assert not storage.table_exists(root, "annotations"), "a killed run must not have published"
    parts = list(parts_dir.glob("v-*/source=*/part-*.parquet"))
    groups = 2 * job.n_buckets(N_CHUNKS, ROWS_PER_PART)  # two sources
    assert 2 <= len(parts) < groups, "the kill must leave a partial output"
    rows_before = sum(pq.ParquetFile(p).metadata.num_rows for p in parts)

    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    kill_marked_processes(ray_tmp)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    # Only what was not yet written was annotated.
    assert stats["skipped_rows"] == rows_before
    assert stats["annotated_rows"] == N_CHUNKS - rows_before
    assert stats["parts_skipped"] == len(parts)

    got = _read(root)
    ids, digest = _digest(got)
    ref_ids, ref_digest = _digest(ref)
    assert ids == ref_ids == sorted(chunks.column("chunk_id").to_pylist())
    assert len(set(ids)) == N_CHUNKS
    assert digest == ref_digest
    assert set(got.column("library_version").to_pylist()) == {"lib-test"}
    assert got.schema.equals(job.annotations_schema(), check_metadata=False)
    assert sum(len(c) for c in got.column("concept_ids").to_pylist()) > 0, "the seeded head must emit some labels"
    _check_long_form(root, got)
    _check_long_form(s3_root, ref)
    assert storage.current_version(root, job.CONCEPTS_TABLE) == storage.current_version(root, "annotations")

    # Partitioned by source; readable by polars and duckdb with the same rows.
    loc = storage.table_path(root, "annotations")
    assert sorted(p.name for p in Path(loc.path).iterdir() if p.is_dir()) == ["source=news", "source=wiki"]
    import duckdb
    import polars as pl

    lf = pl.scan_parquet(f"{loc.path}/**/*.parquet", hive_partitioning=False)
    assert lf.select(pl.len()).collect().item() == N_CHUNKS
    per_source = dict(duckdb.sql(f"SELECT source, count(*) FROM read_parquet('{loc.path}/**/*.parquet', hive_partitioning=false) GROUP BY 1").fetchall())
    assert per_source == {k: v for k, v in zip(*np.unique(got.column("source").to_numpy(zero_copy_only=False), return_counts=True))}
    manifest = storage.read_json(loc.join(job.MANIFEST))
    assert manifest["rows"] == N_CHUNKS and manifest["library_version"] == "lib-test"

    # A rerun after completion annotates nothing.
    again = job.annotate_run(s3_root, s3_root.join("_annotators", "enc").uri, s3, scfg)
    assert again["annotated_rows"] == 0 and again["skipped_rows"] == N_CHUNKS
