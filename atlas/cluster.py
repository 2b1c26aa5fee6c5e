"""The one Ray connection helper shared by pipelines, the trainer and the scaling sweep.

``ray_session(ray_cfg)`` uses a Ray that is already initialised, connects to
``ray_cfg.address`` when one is given, or starts a private local cluster (its own temp dir,
``address="local"`` so it never attaches to another cluster on the host) and stops it after.

Connecting to an existing cluster ships the project's code to the workers (runtime_env
``py_modules`` of the ``atlas``, ``model`` and ``pipelines`` packages, caches and bytecode
excluded): a worker then imports the same code as the driver even when its image holds an
older copy or none. Inside a Ray job whose own runtime_env already ships code
(``--working-dir`` / ``py_modules``), nothing is shipped twice and only missing environment
variables are added (Ray refuses a driver runtime_env that repeats the job's keys).

Models are not resolved here: an ``embedded:`` spec is prepared on the node that loads it
(:func:`atlas.engine.resolve_model` inside the engine actor), since a path on the driver's
disk means nothing on another node.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

from atlas.config import ConfigError, RayConfig

# Workers on every node need these; nothing may reach a model hub at run time.
BASE_ENV_VARS = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
PROJECT_PACKAGES = ("atlas", "model", "pipelines")
# Never uploaded: bytecode, caches, editors' and build leftovers.
CODE_EXCLUDES = ["__pycache__", "*.pyc", "*.pyo", "*.egg-info", ".pytest_cache", ".mypy_cache", "*.so.tmp", ".DS_Store"]
_JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
# A local cluster keeps idle worker processes for reuse. Ray's default keeps only as many as
# CPUs and kills the rest after 1 s idle, so on a small host every stage's Ray Data tasks and
# actor pools start fresh processes, each importing ray + ray.data again (~0.7 s CPU): 77 processes
# in one stage-1 judge test on 2 CPUs, 72 s -> 46 s with these values. An idle worker that ran
# a Ray Data task holds ~110 MiB of its own memory (USS; 200 MiB RSS), more once it imported torch.
LOCAL_SYSTEM_CONFIG = {"num_workers_soft_limit": 6, "idle_worker_killing_time_threshold_ms": 600_000}


def project_root() -> Path:
    return Path(__file__).resolve().parents[1]


def code_runtime_env() -> dict[str, Any]:
    """runtime_env fields that make the project's packages importable on every worker."""
    root = project_root()
    modules = [str(root / p) for p in PROJECT_PACKAGES if (root / p / "__init__.py").exists()]
    return {"py_modules": modules, "excludes": list(CODE_EXCLUDES)}


def _job_runtime_env() -> dict[str, Any] | None:
    """The runtime_env of the Ray job this driver runs in (None outside a submitted job)."""
    raw = os.environ.get(_JOB_CONFIG_ENV)
    if not raw:
        return None
    try:
        return json.loads(raw).get("runtime_env") or {}
    except ValueError:
        return {}


def driver_runtime_env(remote: bool) -> dict[str, Any]:
    """The runtime_env this driver passes to ``ray.init``: env vars always; the project's code
    when connecting to a cluster (``remote``), unless the enclosing job ships it already."""
    job = _job_runtime_env()
    if job is None:
        env: dict[str, Any] = {"env_vars": dict(BASE_ENV_VARS)}
        if remote:
            env.update(code_runtime_env())
        return env
    # Inside a submitted job: add only what the job's runtime_env lacks (no repeated keys).
    job_vars = job.get("env_vars") or {}
    env = {"env_vars": {k: v for k, v in BASE_ENV_VARS.items() if k not in job_vars}}
    if remote and not (job.get("working_dir") or job.get("py_modules")):
        env["py_modules"] = code_runtime_env()["py_modules"]
        if "excludes" not in job:
            env["excludes"] = list(CODE_EXCLUDES)
    return {k: v for k, v in env.items() if v}


def alive_nodes() -> int:
    import ray

    return sum(1 for n in ray.nodes() if n.get("Alive"))


def check_shared_storage(uris: Iterable[str | None]) -> None:
    """Refuse node-local (``file://`` / plain path) URIs when the cluster has several nodes.

    Every node writes its part of a table where it runs, so on a multi-node cluster a local
    path would scatter the table over several disks (and the pointer would name files other
    nodes cannot see). Call after connecting."""
    local = [u for u in uris if u and not u.startswith(("s3://",))]
    if not local:
        return
    nodes = alive_nodes()
    if nodes > 1:
        raise ConfigError(
            f"{', '.join(local)}: a local path cannot be used with a {nodes}-node Ray cluster "
            "(each node would read or write its own disk); use an s3:// URI for --input and --output"
        )


@contextlib.contextmanager
def ray_session(ray_cfg: RayConfig, shared_uris: Iterable[str | None] = ()) -> Iterator[None]:
    """Connect to (or start) Ray for the duration of the block.

    ``shared_uris``: the run's input and output URIs; a local path is refused when the cluster
    has more than one node (:func:`check_shared_storage`)."""
    import ray

    if ray.is_initialized():
        check_shared_storage(shared_uris)
        yield
        return
    temp = None
    if ray_cfg.address:
        ray.init(address=ray_cfg.address, runtime_env=driver_runtime_env(remote=True), log_to_driver=False)
    else:
        temp = tempfile.mkdtemp(prefix="atlas-ray-", dir=os.environ.get("ATLAS_RAY_TMP", "/tmp"))
        ray.init(
            address="local",
            num_cpus=ray_cfg.num_cpus,
            object_store_memory=(ray_cfg.object_store_memory_mb or 0) * 2**20 or None,
            include_dashboard=False,
            _temp_dir=temp,
            _system_config=LOCAL_SYSTEM_CONFIG,
            runtime_env=driver_runtime_env(remote=False),
            log_to_driver=False,
        )
    ok = False
    try:
        check_shared_storage(shared_uris)
        yield
        ok = True
    finally:
        ray.shutdown()
        if temp is not None and ok:  # the private cluster's files; a failed run keeps Ray's logs
            shutil.rmtree(temp, ignore_errors=True)
