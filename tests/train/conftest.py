"""Fixtures for the trainer tests: annotation shards (local and on the moto S3 server) and
a private local Ray cluster (fractional CPUs, capped object store)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from atlas.cluster import LOCAL_SYSTEM_CONFIG

ROOT = Path(__file__).resolve().parents[2]
DEMO_CORPUS = ROOT / "atlas" / "demo" / "corpus"
N_CONCEPTS = 16
ID_OFFSET = 1000  # library ids are not 0..n-1: the trainer must map them


@pytest.fixture(scope="session")
def annotation_tables():
    """(annotations, concepts) built from the demo corpus by the STAND-IN labeller, with
    documents alternately assigned to sources "wiki" and "web" (for mixtures)."""
    import hashlib

    from model.corpus import read_documents
    from model.data import standin_annotations

    docs = read_documents(DEMO_CORPUS)
    ids = [hashlib.sha256(d.encode("utf-8", "ignore")).hexdigest()[:20] for d in docs]
    sources = {d: ("wiki" if i % 2 == 0 else "web") for i, d in enumerate(ids)}
    return standin_annotations(DEMO_CORPUS, N_CONCEPTS, sources=sources, id_offset=ID_OFFSET)


@pytest.fixture(scope="session")
def annotation_root(annotation_tables, tmp_path_factory) -> str:
    from model.data import write_annotation_run

    ann, con = annotation_tables
    return write_annotation_run(str(tmp_path_factory.mktemp("ann") / "run"), ann, con, run_id="fixture-run")


@pytest.fixture(scope="session")
def annotation_root_s3(annotation_tables, s3_server, s3_client) -> str:
    from model.data import write_annotation_run

    s3_client.create_bucket(Bucket="train-shards")
    ann, con = annotation_tables
    return write_annotation_run("s3://train-shards/atlas-run", ann, con, s3_endpoint=s3_server, run_id="fixture-s3")


@pytest.fixture(scope="module")
def ray_local():
    import ray

    if ray.is_initialized():
        yield ray
        return
    temp = tempfile.mkdtemp(prefix="rtr-", dir="/tmp")
    ray.init(address="local", num_cpus=2, object_store_memory=256 * 2**20, include_dashboard=False,
             _temp_dir=temp, log_to_driver=False, _system_config=LOCAL_SYSTEM_CONFIG,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
                                       "OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)
