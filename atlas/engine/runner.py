"""Run generation requests through the engine on a Ray cluster, with the request cache.

A request table has columns ``key`` (caller's row id), ``prompt`` and ``sampling`` (the
:meth:`Sampling.key` JSON). :func:`generate` returns it with ``request_hash``, ``text``,
``output_tokens``, ``finish_reason``, ``error`` and ``cached`` added. Cache hits never reach
the engine; when every request is cached no engine actor is created at all.

Uncached requests go through Ray Data: ``map_batches`` with :class:`EngineActor`, a callable
class that owns one engine (``vllm.LLM`` or transformers) per actor, ``engine.replicas``
actors in parallel. Resources per actor:

* CPU: ``num_cpus=cpus_per_replica`` (a scheduling share; keep it fractional on small hosts),
  ``VLLM_CPU_KVCACHE_SPACE=kv_cache_gib``. vLLM binds its own OMP threads ('auto': all cores
  but one, which its scheduler keeps; measured fastest on 2 cores); ``cpu_threads`` overrides
  that, and sets the torch thread count of the transformers backend (default: host cores /
  replicas; Ray would otherwise leave OMP_NUM_THREADS at num_cpus).
* GPU: ``num_gpus = gpus_per_replica * tensor_parallel_size`` (tensor parallelism inside one
  actor, vLLM's multiprocessing executor over the GPUs Ray assigned it, so one replica stays
  on one node), ``accelerator_type`` as a Ray scheduling constraint, and
  ``gpu_memory_utilization``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from atlas.config import EngineConfig
from atlas.engine.cache import GenerationCache
from atlas.engine.core import Result, Sampling, make_backend, request_hash
from atlas.storage import Location

RESULT_COLUMNS = ["text", "output_tokens", "finish_reason", "error", "permanent"]


class EngineActor:
    """Ray Data callable class: one engine per actor, a batch of requests per call."""

    def __init__(self, model_dir: str, engine_cfg: dict[str, Any]):
        cfg = EngineConfig.model_validate(engine_cfg)
        if cfg.device == "cpu" and cfg.backend == "transformers":
            import torch

            torch.set_num_threads(cpu_threads(cfg))
        self.backend = make_backend(model_dir, cfg)
        # Warm-up: first-call costs (kernels, sampler set-up) belong to start-up, not to a batch.
        self.backend.generate(["Warm-up."], Sampling(max_tokens=1))
        self.ready_at = time.time()  # wall clock when the engine was ready (benchmarks)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        prompts = [str(p) for p in batch["prompt"]]
        samplings = [str(s) for s in batch["sampling"]]
        results: list[Result | None] = [None] * len(prompts)
        groups: dict[str, list[int]] = {}
        for i, s in enumerate(samplings):
            groups.setdefault(s, []).append(i)
        for skey, idx in groups.items():
            try:
                sampling = Sampling.from_key(skey)
                outs = self.backend.generate([prompts[i] for i in idx], sampling)
            except Exception as e:  # noqa: BLE001 - never fail the job for one batch
                outs = [Result(None, error=f"engine failure: {type(e).__name__}: {e}")] * len(idx)
            for i, r in zip(idx, outs):
                results[i] = r
        return {
            "key": batch["key"],
            "request_hash": batch["request_hash"],
            "text": [r.text for r in results],  # type: ignore[union-attr]
            "output_tokens": [r.output_tokens for r in results],  # type: ignore[union-attr]
            "finish_reason": [r.finish_reason for r in results],  # type: ignore[union-attr]
            "error": [r.error for r in results],  # type: ignore[union-attr]
            "permanent": [bool(r.permanent) for r in results],  # type: ignore[union-attr]
            "actor_ready_at": [self.ready_at] * len(results),
        }


def cpu_threads(cfg: EngineConfig) -> int:
    """Compute threads of one CPU engine replica."""
    return cfg.cpu_threads or max(1, (os.cpu_count() or 1) // cfg.replicas)


def actor_resources(cfg: EngineConfig) -> dict[str, Any]:
    """Ray resources and environment of one engine actor (see the module docstring)."""
    env = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    # Workers import atlas too: when it runs from a source checkout (not installed), put the
    # checkout on the workers' path (harmless on nodes where that path does not exist).
    src = str(Path(__file__).resolve().parents[2])
    if "site-packages" not in src:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    if cfg.device == "gpu":
        res: dict[str, Any] = {"num_cpus": cfg.cpus_per_replica, "num_gpus": cfg.gpus_per_replica * cfg.tensor_parallel_size}
        if cfg.accelerator_type:
            res["accelerator_type"] = cfg.accelerator_type
    else:
        threads = cpu_threads(cfg)
        if cfg.backend == "transformers" or cfg.cpu_threads:
            env["OMP_NUM_THREADS"] = str(threads)
        if cfg.cpu_threads and cfg.backend == "vllm":
            # vLLM binds its OMP threads itself ('auto': one core kept for its scheduler);
            # an explicit thread count asks for that many cores.
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(max(0, (os.cpu_count() or 1) - threads))
        env.update(
            VLLM_CPU_KVCACHE_SPACE=str(max(1, int(round(cfg.kv_cache_gib)))),
            VLLM_WORKER_MULTIPROC_METHOD="spawn",
        )
        res = {"num_cpus": cfg.cpus_per_replica}
    res["runtime_env"] = {"env_vars": env}
    return res


@dataclass
class GenerationStats:
    rows: int = 0
    cached: int = 0
    generated: int = 0
    errors: int = 0
    output_tokens: int = 0
    engine_started: bool = False
    seconds: float = 0.0
    engine_seconds: float = 0.0
    engine_ready_at: float | None = None  # wall clock when the first engine actor was ready
    finished_at: float | None = None
    extra: dict = field(default_factory=dict)


def _result_table(keys: list, hashes: list[str], rows: dict[str, dict], cached: set[str]) -> pa.Table:
    cols: dict[str, list] = {"key": keys, "request_hash": hashes, **{c: [] for c in RESULT_COLUMNS}, "cached": []}
    for h in hashes:
        r = rows[h]
        for c in RESULT_COLUMNS:
            cols[c].append(r.get(c))
        cols["cached"].append(h in cached)
    return pa.table(
        {
            "key": pa.array(keys),
            "request_hash": pa.array(hashes, pa.string()),
            "text": pa.array(cols["text"], pa.string()),
            "output_tokens": pa.array(cols["output_tokens"], pa.int32()),
            "finish_reason": pa.array(cols["finish_reason"], pa.string()),
            "error": pa.array(cols["error"], pa.string()),
            "cached": pa.array(cols["cached"], pa.bool_()),
        }
    )


def generate(
    requests: pa.Table,
    cfg: EngineConfig,
    model_dir: str,
    model_id: str,
    cache_root: Location | None = None,
    use_cache: bool = True,
) -> tuple[pa.Table, GenerationStats]:
    """Serve ``requests`` (key, prompt, sampling) through the cache and the Ray Data engine."""
    import ray.data

    t0 = time.perf_counter()
    stats = GenerationStats(rows=requests.num_rows)
    keys = requests.column("key").to_pylist()
    prompts = requests.column("prompt").to_pylist()
    samplings = requests.column("sampling").to_pylist()
    hashes = [request_hash(model_id, p, s) for p, s in zip(prompts, samplings)]
    cache = GenerationCache(cache_root) if (cache_root is not None and use_cache) else None
    hits = cache.lookup(hashes) if cache else {}
    rows: dict[str, dict] = dict(hits)
    todo: dict[str, int] = {}
    for i, h in enumerate(hashes):
        if h not in rows and h not in todo:
            todo[h] = i  # identical requests in one run are generated once
    if todo:
        idx = list(todo.values())
        miss = pa.table(
            {
                "key": pa.array([str(keys[i]) for i in idx], pa.string()),
                "request_hash": pa.array([hashes[i] for i in idx], pa.string()),
                "prompt": pa.array([prompts[i] for i in idx], pa.string()),
                "sampling": pa.array([samplings[i] for i in idx], pa.string()),
            }
        )
        stats.engine_started = True
        t1 = time.perf_counter()
        res = actor_resources(cfg)
        # Blocks of ~batch_size rows: one engine call sees a full batch (vLLM schedules up to
        # max_num_seqs of them at once); at least one block per replica.
        n_blocks = max(cfg.replicas, -(-len(idx) // cfg.batch_size))
        ds = ray.data.from_arrow(miss).repartition(n_blocks)
        out = ds.map_batches(
            EngineActor,
            fn_constructor_kwargs={"model_dir": model_dir, "engine_cfg": cfg.model_dump()},
            batch_size=cfg.batch_size,
            batch_format="numpy",
            concurrency=cfg.replicas,
            **res,
        ).to_arrow_refs()
        new_rows = pa.concat_tables(ray.get(out)).to_pylist() if out else []
        stats.engine_seconds = time.perf_counter() - t1
        stats.finished_at = time.time()
        ready = [r.get("actor_ready_at") for r in new_rows if r.get("actor_ready_at")]
        stats.engine_ready_at = min(ready) if ready else None
        fresh = []
        for r in new_rows:
            rows[r["request_hash"]] = r
            if (r.get("error") is None and r.get("text") is not None) or r.get("permanent"):
                fresh.append({**r, "model": model_id})
        if cache is not None:
            cache.put(fresh)
        missing = [h for h in todo if h not in rows]
        for h in missing:  # defensive: a lost row is an error row, not a crash
            rows[h] = {"text": None, "output_tokens": None, "finish_reason": None, "error": "engine returned no result for this request"}
    table = _result_table(keys, hashes, rows, set(hits))
    stats.cached = sum(1 for h in hashes if h in hits)
    stats.generated = len(todo)
    errs = table.column("error").to_pylist()
    stats.errors = sum(e is not None for e in errs)
    stats.output_tokens = sum(t or 0 for t in table.column("output_tokens").to_pylist())
    stats.seconds = time.perf_counter() - t0
    return table, stats
