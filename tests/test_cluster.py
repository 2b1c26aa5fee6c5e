"""What ray_session asks Ray for: code shipped only to remote clusters, and never twice inside
a submitted job (Ray refuses a driver runtime_env that repeats the job's keys)."""

import json
from pathlib import Path

from atlas import cluster


def test_local_cluster_gets_env_vars_only(monkeypatch):
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert cluster.driver_runtime_env(remote=False) == {"env_vars": cluster.BASE_ENV_VARS}


def test_remote_cluster_gets_the_project_packages(monkeypatch):
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    env = cluster.driver_runtime_env(remote=True)
    mods = [Path(p) for p in env["py_modules"]]
    assert [m.name for m in mods] == ["atlas", "model", "pipelines"]
    assert all((m / "__init__.py").is_file() and m.parent == cluster.project_root() for m in mods)
    assert "__pycache__" in env["excludes"] and "*.pyc" in env["excludes"]
    assert env["env_vars"]["HF_HUB_OFFLINE"] == "1"


def test_inside_a_job_nothing_is_repeated(monkeypatch):
    job = {"runtime_env": {"working_dir": "gcs://_ray_pkg_abc.zip", "excludes": [".git"], "env_vars": {"HF_HUB_OFFLINE": "0"}}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(job))
    env = cluster.driver_runtime_env(remote=True)
    # the job ships the code (working_dir) and set HF_HUB_OFFLINE itself
    assert env == {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {}}))
    env = cluster.driver_runtime_env(remote=True)
    assert [Path(p).name for p in env["py_modules"]] == ["atlas", "model", "pipelines"] and env["excludes"]
