"""Fixtures for the engine / Stage 1 tests: a real local Ray cluster and a small chunks table.

Imported by tests/test_engine.py and tests/test_stage1.py (``from tests.engine_fixtures import *``
style imports of the fixture names), so they work whether or not tests/conftest.py exists.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import pyarrow as pa
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

CORPUS = Path(__file__).resolve().parents[1] / "atlas" / "demo" / "corpus"


def demo_chunks(n_docs: int = 4, per_doc: int = 2, max_chars: int = 600) -> pa.Table:
    """A small table conforming to schemas.CHUNKS from paragraphs of the demo corpus."""
    from atlas import schemas

    rows = []
    for f in sorted(CORPUS.glob("*.txt"))[:n_docs]:
        text = f.read_text(encoding="utf-8")
        doc_id = re.sub(r"[^a-z0-9]+", "-", f.stem.lower())[:24]
        pos, i = 0, 0
        for para in text.split("\n\n"):
            start = text.find(para, pos)
            pos = start + len(para)
            para = para.strip()
            if len(para) < 250 or para.startswith("#"):
                continue
            body = para[:max_chars]
            rows.append(
                dict(
                    chunk_id=f"{doc_id}-{i:05d}",
                    doc_id=doc_id,
                    chunk_index=i,
                    text=body,
                    n_tokens=len(body.split()),
                    char_start=start,
                    char_end=start + len(body),
                )
            )
            i += 1
            if i >= per_doc:
                break
    return schemas.conform(pa.Table.from_pylist(rows), schemas.CHUNKS)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    if ray.is_initialized():  # someone else's session fixture started one: share it
        yield ray
        return
    tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    ray.init(
        num_cpus=2,
        object_store_memory=400 * 1024 * 1024,
        include_dashboard=False,
        _temp_dir=tmp,
        log_to_driver=False,
        runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}},
    )
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def gemma_dir():
    from atlas.engine import resolve_model

    return resolve_model("embedded:gemma3-270m")


@pytest.fixture(scope="session")
def smollm_dir():
    from atlas.engine import resolve_model

    return resolve_model("embedded:smollm2-135m-instruct")


def small_engine_cfg(**kw):
    from atlas.config import EngineConfig

    base = dict(max_model_len=1024, max_num_seqs=32, batch_size=32, kv_cache_gib=1.0, cpus_per_replica=1.0)
    base.update(kw)
    return EngineConfig(**base)
