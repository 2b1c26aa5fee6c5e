"""Helpers and fixtures for the engine / Stage 1 tests: prepared models and a small chunks table.

Imported by tests/test_engine.py and tests/test_stage1.py and the Stage 1 benchmark; the Ray
cluster fixture (``ray_cluster``) is the session one in tests/conftest.py.
"""

from __future__ import annotations

import os
import re
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
def gemma_dir():
    from atlas.engine import resolve_model

    return resolve_model("embedded:gemma3-270m")


@pytest.fixture(scope="session")
def smollm_dir():
    from atlas.engine import resolve_model

    return resolve_model("embedded:smollm2-135m-instruct")


def small_engine_cfg(**kw):
    from atlas.config import EngineConfig

    # 0.5 GiB of KV cache holds ~28k Gemma 3 270M tokens (~23k SmolLM2), the tests ask for < 17k;
    # each GiB more costs ~1.2 s of engine start to allocate.
    base = dict(max_model_len=1024, max_num_seqs=32, batch_size=32, kv_cache_gib=0.5, cpus_per_replica=1.0)
    base.update(kw)
    return EngineConfig(**base)


def engine_server_processes() -> int:
    """Engine server actor processes (atlas.engine.runner.EngineServer) alive on this host
    (Ray titles an actor's process ``ray::<class>``)."""
    import psutil

    n = 0
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        n += bool(cmd) and cmd[0].startswith("ray::EngineServer")
    return n


def alive_engine_servers(at_most: int = 0, wait_s: float = 30) -> int:
    """:func:`engine_server_processes`, once at most ``at_most`` are left or after ``wait_s``
    (ray.kill is asynchronous)."""
    import time

    deadline = time.time() + wait_s
    while (n := engine_server_processes()) > at_most and time.time() < deadline:
        time.sleep(0.5)
    return n
