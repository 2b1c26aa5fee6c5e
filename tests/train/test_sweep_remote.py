"""The scaling sweep, run through the Ray Train + DeepSpeed trainer, against a separately
started Ray head reached by --address (atlas.cluster.ray_session)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import polars as pl
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture()
def ray_head():
    """`ray start --head --block` in its own temp dir on free ports; killed by PID."""
    temp = tempfile.mkdtemp(prefix="rhd-", dir="/tmp")
    gcs, nm, om, rc, agent, agent_grpc, metrics, renv = _free_ports(8)
    ray_exe = str(Path(sys.executable).with_name("ray"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # a private test head bound to this host; the driver connects without a token
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", RAY_AUTH_MODE="disabled")
    cmd = [ray_exe, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
           f"--temp-dir={temp}", "--num-cpus=2", f"--object-store-memory={256 * 2**20}",
           "--include-dashboard=false", f"--node-manager-port={nm}", f"--object-manager-port={om}",
           f"--ray-client-server-port={rc}", f"--dashboard-agent-listen-port={agent}",
           f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
           f"--runtime-env-agent-port={renv}", "--disable-usage-stats"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"127.0.0.1:{gcs}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", gcs)) == 0:
                break
        time.sleep(1)
    time.sleep(3)  # raylet registers after the GCS port opens
    yield address
    os.killpg(proc.pid, 15)  # the head and the processes it started (own session), by PID
    try:
        proc.wait(timeout=5)  # `ray start --block` often outlasts a longer wait; nothing to save
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
    shutil.rmtree(temp, ignore_errors=True)


# The sweep's driver runs in a process of its own: this pytest process may already be
# connected to the session's local cluster, and one process holds one Ray connection.
DRIVER = """
import json, sys
import ray
from model.scaling.plan import plan_isoflop
from model.sweep import run_sweep

address, out = sys.argv[1], sys.argv[2]
plan = plan_isoflop([3e8], ["cdlm_concept"], n_sizes=1, batch_size=4, seq_len=64,
                    train_overrides={"dtype": "fp32", "eval_batches": 1})
res = run_sweep(plan, out, address=address, fit=False, progress=False, max_retries=0,
                trainer_options={"dist": {"num_workers": 2, "cpus_per_worker": 0.5}})
print(json.dumps({"steps": plan.runs[0].steps, "run_id": plan.runs[0].run_id,
                  "ray_closed": not ray.is_initialized(), "rows": res.table.to_dicts()}, default=str))
"""


@pytest.mark.slow
def test_remote_sweep_runs_through_ray_train(ray_head, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", RAY_AUTH_MODE="disabled")
    proc = subprocess.run([sys.executable, "-c", DRIVER, ray_head, str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(next(ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith('{"steps"')))
    assert got["steps"] <= 40, got["steps"]  # keep the test tiny
    assert got["ray_closed"]  # the sweep closed its session
    rows = got["rows"]
    assert len(rows) == 1 and rows[0]["status"] == "ok", rows
    man = json.loads((tmp_path / "manifest.json").read_text())
    assert man["trainer"] == "model.train:train" and man["ray"]["address"] == ray_head
    rid = got["run_id"]
    run_man = json.loads((tmp_path / "runs" / rid / "_manifest.json").read_text())
    assert run_man["last_report"]["engine"] == "DeepSpeedEngine" and run_man["last_report"]["world_size"] == 2
    assert run_man["annotation_run"]["annotator"].startswith("STAND-IN")
    row = rows[0]
    assert row["loss"] == row["val_loss"] and row["concept_auc"] is not None
    steps = pl.read_parquet(tmp_path / "runs" / rid / "metrics" / "steps.parquet")
    assert steps.height == got["steps"]
