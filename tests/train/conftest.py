"""Fixtures for the trainer tests: annotation shards (local and on the moto S3 server; the
module-scoped Ray cluster is ``ray_local`` in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

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
