"""Resume after a crash: a real ``atlas run`` subprocess (its own local Ray, the fast test
engine slowed per row) is SIGKILLed during stage1_tags once some cache parts exist; the
same command then finishes the job, generating only what was not cached, and publishes
every chunk exactly once - the same table an uninterrupted run publishes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from atlas import storage
from atlas.engine import GenerationCache
from tests.conftest import DEMO_CORPUS, REPO, kill_marked_processes

pytestmark = pytest.mark.slow


def _cmd(corpus, out, tokenizer, delay: float) -> list[str]:
    sets = [
        f"chunking.tokenizer={tokenizer}", "engine.backend=test", "engine.batch_size=4", "engine.cpus_per_replica=0.5",
        f"engine.test_delay_s={delay}", "judge.enabled=false", "stage2.enabled=false", "stage3.enabled=false", "ray.num_cpus=2", "ray.object_store_memory_mb=300",
    ]
    args = [sys.executable, "-m", "atlas.cli", "run", "--input", str(corpus), "--output", str(out)]
    for s in sets:
        args += ["--set", s]
    return args


def _env(ray_tmp: str = "/tmp") -> dict:
    # The worktree's code must win in the subprocess and its Ray workers alike; ATLAS_RAY_TMP
    # marks every process of the run's Ray cluster (see kill_marked_processes).
    return {
        **os.environ, "HF_HUB_OFFLINE": "1", "RAY_ADDRESS": "", "RAY_AUTH_MODE": "disabled",
        "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "ATLAS_RAY_TMP": ray_tmp,
    }


def _run(args, timeout=1500) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"atlas run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _table_checksum(root) -> tuple[list[str], str]:
    t = storage.read_table(root, "chunk_tags").drop_columns(["cached"]).sort_by("chunk_id")
    ids = t.column("chunk_id").to_pylist()
    rows = [json.dumps(r, sort_keys=True) for r in t.to_pylist()]
    return ids, hashlib.sha256("\n".join(rows).encode()).hexdigest()


def test_sigkill_mid_tagging_then_rerun_generates_only_what_was_not_cached(tmp_path, minilm_tokenizer_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for p in sorted(DEMO_CORPUS.glob("*.txt"))[:2]:
        (corpus / p.name).write_text(p.read_text())

    # Reference: the same pipeline, uninterrupted (no delay; the delay is not part of any key).
    ref = tmp_path / "ref"
    _run(_cmd(corpus, ref, minilm_tokenizer_path, 0.0))
    ref_ids, ref_sum = _table_checksum(storage.resolve(str(ref)))
    n = len(ref_ids)
    assert n >= 40 and len(set(ref_ids)) == n

    # The killed run starts from the reference's ingest + chunk outputs and records: the same
    # config and inputs, so it skips straight to stage1_tags (and saves minutes on 2 cores).
    out = tmp_path / "out"
    for t in ("documents", "quarantine", "chunks"):
        shutil.copytree(ref / t, out / t)
    (out / "_stages").mkdir()
    for s in ("ingest", "chunk"):
        shutil.copy(ref / "_stages" / f"{s}.json", out / "_stages" / f"{s}.json")
    cmd = _cmd(corpus, out, minilm_tokenizer_path, 0.15)
    cache_dir = out / "_cache" / "generations"
    ray_tmp = tempfile.mkdtemp(prefix="resume-ray-")
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(ray_tmp), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.time() + 900
        while len(list(cache_dir.glob("*.parquet"))) < 3:
            assert proc.poll() is None, f"run ended before it could be killed:\n{proc.stderr.read()[-3000:]}"
            assert time.time() < deadline, "no cache part appeared within 900 s"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and what it started in its group
        proc.wait(timeout=60)
        proc.stderr.close()
        kill_marked_processes(ray_tmp)  # Ray's own sessions: nothing may write after the count below
        shutil.rmtree(ray_tmp, ignore_errors=True)
    root = storage.resolve(str(out))
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["stages"]["chunk"]["status"] == "skipped"
    assert manifest["stages"]["stage1_tags"]["status"] == "running"  # killed mid-stage
    assert not storage.table_exists(root, "chunk_tags")
    cached_at_kill = GenerationCache(root).rows()
    print(f"chunks={n} cached when killed={cached_at_kill}")
    assert 0 < cached_at_kill < n

    _run(cmd)
    manifest = json.loads((out / "_manifest.json").read_text())
    st = manifest["stages"]
    assert st["ingest"]["status"] == st["chunk"]["status"] == "skipped"  # unchanged config + inputs
    tags = st["stage1_tags"]["stats"]
    print(f"rerun: generated={tags['generated']} cached={tags['cached']} (expected {n - cached_at_kill} / {cached_at_kill})")
    assert tags["cached"] == cached_at_kill
    assert tags["generated"] == n - cached_at_kill  # a rerun that redid everything fails here
    assert GenerationCache(root).rows() == n
    ids, checksum = _table_checksum(root)
    assert ids == ref_ids and len(set(ids)) == n  # every chunk exactly once
    assert checksum == ref_sum
