"""A separately started Ray head (`ray start --head`, token auth on): a run submitted through the
Jobs API, code shipped to workers by ray_session, and local paths refused on two nodes.

The head runs in its own temp dir on free ports and is stopped by PID (never `ray stop`);
RAY_ADDRESS is never set in this process, and the auth token lives only in the head's and the
clients' environments, so the session's other Ray cluster is not affected.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request

import pytest

from atlas import storage

from tests.conftest import DEMO_CORPUS, REPO, _free_port

pytestmark = pytest.mark.slow

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
PORT_FLAGS = (
    "--node-manager-port", "--object-manager-port", "--ray-client-server-port", "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port",
)


def _env(token: str) -> dict[str, str]:
    """Environment for the head, the worker node and client subprocesses: token auth on with
    our own token; no RAY_ADDRESS; no PYTHONPATH, so workers import only code that was shipped."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH", "RAY_AUTH_TOKEN_PATH")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    return env


def _start_node(args: list[str], env: dict[str, str], log_path: str) -> subprocess.Popen:
    ports = [a for flag in PORT_FLAGS for a in (flag, str(_free_port()))]
    log = open(log_path, "wb")
    # Own session: the node's raylet, GCS and dashboard can be stopped as one group by our PID.
    return subprocess.Popen([RAY, "start", *args, *ports, "--block", "--disable-usage-stats"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def ray_head():
    token = secrets.token_hex(32)
    env = _env(token)
    temp = tempfile.mkdtemp(prefix="rh-", dir="/tmp")  # short: Ray's socket paths have a length limit
    gcs, dash = _free_port(), _free_port()
    head = _start_node(
        ["--head", "--temp-dir", temp, "--port", str(gcs), "--node-ip-address", "127.0.0.1",
         "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash), "--include-dashboard", "true",
         "--num-cpus", "2", "--object-store-memory", str(200 * 2**20)],
        env, os.path.join(temp, "head.log"),
    )
    info = {"gcs": f"127.0.0.1:{gcs}", "http": f"http://127.0.0.1:{dash}", "token": token, "env": env,
            "temp": temp, "head": head, "extra": []}
    try:
        deadline = time.time() + 120
        while True:
            try:
                req = urllib.request.Request(f"{info['http']}/api/jobs/", headers={"Authorization": f"Bearer {token}"})
                urllib.request.urlopen(req, timeout=2)
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                if head.poll() is not None or time.time() > deadline:
                    raise RuntimeError("ray head did not start:\n" + open(os.path.join(temp, "head.log"), errors="replace").read()[-3000:])
                time.sleep(1)
        yield info
    finally:
        for p in info["extra"]:
            _stop(p)
        _stop(head)
        shutil.rmtree(temp, ignore_errors=True)


def _driver(info, code: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """Run a driver script in a fresh interpreter (this process may hold another Ray session).

    The driver imports this checkout through PYTHONPATH and runs in another directory: Ray
    puts a driver's working directory on its workers' path, which on one host would let the
    workers import the checkout directly instead of the shipped code."""
    env = {**info["env"], "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=info["temp"], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_jobs_api_run_with_token_auth(ray_head, tmp_path, minilm_tokenizer_path):
    from ray.job_submission import JobStatus, JobSubmissionClient

    # Token auth is on: a request without the token is refused.
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{ray_head['http']}/api/jobs/", timeout=5)
    assert refused.value.code in (401, 403)

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for p in sorted(DEMO_CORPUS.glob("*.txt"))[:2]:
        shutil.copy(p, corpus / p.name)
    out = tmp_path / "out"
    client = JobSubmissionClient(ray_head["http"], headers={"Authorization": f"Bearer {ray_head['token']}"})
    job = client.submit_job(
        entrypoint=(
            f"{sys.executable} -m pipelines.run_atlas --input {corpus} --output file://{out} --stages ingest chunk "
            f"--run-id remote-1 --set chunking.tokenizer={minilm_tokenizer_path}"
        ),
        # The project as the job's working dir: the driver and every worker import this checkout.
        runtime_env={"working_dir": str(REPO), "excludes": [".git", "**/__pycache__", "*.pyc", ".pytest_cache", "atlas-demo-output"]},
    )
    deadline = time.time() + 400
    while (status := client.get_job_status(job)) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        assert time.time() < deadline, f"job still {status}:\n{client.get_job_logs(job)[-3000:]}"
        time.sleep(2)
    logs = client.get_job_logs(job)
    assert status == JobStatus.SUCCEEDED, logs[-4000:]
    root = storage.resolve(f"file://{out}")
    assert storage.table_exists(root, "documents") and storage.table_exists(root, "chunks")
    assert storage.read_table(root, "documents").num_rows == 2
    assert storage.read_table(root, "chunks").num_rows > 10
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["run_id"] == "remote-1" and manifest["status"] == "done"
    assert ray_head["token"] not in logs and ray_head["token"] not in json.dumps(manifest)


SHIP_CHECK = """
    import json, ray, atlas
    from atlas.cluster import ray_session, alive_nodes
    from atlas.config import RayConfig

    @ray.remote
    def where():
        import atlas, model, pipelines
        return [atlas.__file__, model.__file__, pipelines.__file__]

    with ray_session(RayConfig(address="{gcs}"), shared_uris=["file:///tmp/x", "s3://b/p"]):
        print(json.dumps({{"driver": atlas.__file__, "workers": ray.get(where.remote()), "nodes": alive_nodes()}}))
"""


def test_ray_session_ships_project_code(ray_head):
    proc = _driver(ray_head, SHIP_CHECK.format(gcs=ray_head["gcs"]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["driver"].startswith(str(REPO)) and got["nodes"] == 1  # one node: a local path is fine
    for path in got["workers"]:
        # imported from the head's runtime_resources (uploaded py_modules), not from a checkout
        assert path.startswith(ray_head["temp"]) and "runtime_resources" in path, path


REFUSE_CHECK = """
    from atlas.cluster import ray_session
    from atlas.config import ConfigError, RayConfig

    with ray_session(RayConfig(address="{gcs}"), shared_uris=["s3://bucket/runs/r1"]):
        print("s3 ok")
    try:
        with ray_session(RayConfig(address="{gcs}"), shared_uris=["s3://bucket/in", "file:///tmp/out"]):
            print("NOT REFUSED")
    except ConfigError as e:
        print("refused:", e)

    import ray
    from atlas import storage
    with ray_session(RayConfig(address="{gcs}")):
        try:
            storage.write_dataset(storage.resolve("file://{never}"), "documents", ray.data.range(3))
            print("NOT REFUSED")
        except storage.StorageError as e:
            print("storage refused:", e)
"""


def _join_worker(ray_head, attempt: int) -> bool:
    """Start a second node (no CPUs) and wait until the cluster shows two live nodes."""
    log_path = os.path.join(ray_head["temp"], f"worker-{attempt}.log")
    worker = _start_node(["--address", ray_head["gcs"], "--node-ip-address", "127.0.0.1", "--num-cpus", "0",
                          "--object-store-memory", str(80 * 2**20)], ray_head["env"], log_path)
    ray_head["extra"].append(worker)
    deadline = time.time() + 240  # each probe is a fresh driver: slow on a loaded host
    while time.time() < deadline and worker.poll() is None:
        nodes = _driver(ray_head, f"""
            import ray
            ray.init(address="{ray_head['gcs']}", log_to_driver=False)
            print(sum(1 for n in ray.nodes() if n["Alive"]))
        """, timeout=60)
        if nodes.returncode == 0 and nodes.stdout.strip().splitlines()[-1] == "2":
            return True
        time.sleep(2)
    print(f"worker node attempt {attempt} did not join:\n" + open(log_path, errors="replace").read()[-3000:])
    _stop(worker)
    return False


def test_local_output_refused_on_multi_node_cluster(ray_head):
    # Retries with fresh ports: a port picked free can be taken before the node binds it, and
    # Ray gives a raylet a fixed 30 s to register, which a heavily loaded host can miss.
    assert any(_join_worker(ray_head, i) for i in (1, 2)), "worker node did not join (see stdout)"
    never = os.path.join(ray_head["temp"], "never-written")
    proc = _driver(ray_head, REFUSE_CHECK.format(gcs=ray_head["gcs"], never=never))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "s3 ok" in proc.stdout and "NOT REFUSED" not in proc.stdout
    assert "refused: file:///tmp/out: a local path cannot be used with a 2-node Ray cluster" in proc.stdout
    assert f"storage refused: cannot write table 'documents' to the local path file://{never} from a 2-node" in proc.stdout
    assert not os.path.exists(never)
