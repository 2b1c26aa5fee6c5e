"""Run generation requests through the engine on a Ray cluster, with the request cache.

A request has columns ``key`` (the caller's row id, unique per stage), ``prompt`` and
``sampling`` (the :meth:`Sampling.key` JSON), plus any columns the caller wants carried
through to its parser. :func:`stream_generate` turns a request *Dataset* into a Dataset of
the same rows (``prompt``/``sampling`` dropped) with the answer columns ``_a_text``,
``_a_output_tokens``, ``_a_finish_reason``, ``_a_error``, ``_a_cached``, ``_a_generated``
and ``request_hash`` added. Nothing is collected on the driver:

1. ``map_batches`` computes each request's cache key (:func:`request_hash`).
2. When the cache holds anything, a Ray Data hash join (``left_outer`` on ``request_hash``)
   attaches cached answers; both sides are hash-partitioned, so neither the requests nor the
   cache ever sit in one process. With an empty cache there is no join: a first run streams.
3. Blocks are cut to ``engine.batch_size`` rows (streaming repartition), so answers leave the
   engine batch by batch instead of when a whole input block is done.
4. :class:`EngineActor` (``map_batches``, ``engine.replicas`` actors) fills the cached rows
   from the join and generates the rest; it loads its engine only when a batch has a miss,
   so a fully cached rerun never starts vLLM, and it appends that batch's new generations
   to the cache before returning it: a crash loses at most the batches in flight.

:func:`generate` is the same path for a small in-memory request table (benchmarks).

Resources per actor:
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
import pyarrow.compute as pc

from atlas.config import EngineConfig
from atlas.engine.cache import GenerationCache
from atlas.engine.core import Result, Sampling, make_backend, request_hash
from atlas.storage import Location

ANSWER = "_a_"  # prefix of the answer columns in a streamed Dataset
CACHED = "_c_"  # prefix of the cache columns attached by the join
ANSWER_COLUMNS = ("text", "output_tokens", "finish_reason", "error", "cached", "generated")
_CACHE_FIELDS = ("text", "output_tokens", "finish_reason", "error")
_ANSWER_TYPES = {
    "text": pa.string(),
    "output_tokens": pa.int32(),
    "finish_reason": pa.string(),
    "error": pa.string(),
    "cached": pa.bool_(),
    "generated": pa.bool_(),
}


def add_request_hash(batch: pa.Table, model_id: str) -> pa.Table:
    """Append the cache key of every request row."""
    hashes = [
        request_hash(model_id, p, s)
        for p, s in zip(batch.column("prompt").to_pylist(), batch.column("sampling").to_pylist())
    ]
    return batch.append_column("request_hash", pa.array(hashes, pa.string()))


def dedupe_keys(batch: pa.Table) -> pa.Table:
    """Keep one row per ``key``. A left join yields two rows for a request whose answer is in
    the cache twice (two identical requests of one run generated in different batches); the
    join partitions by ``request_hash``, so such twins always share a block."""
    if batch.num_rows < 2 or pc.count_distinct(batch.column("key")).as_py() == batch.num_rows:
        return batch
    idx = batch.append_column("_i", pa.array(np.arange(batch.num_rows))).group_by("key").aggregate([("_i", "min")])
    return batch.take(np.sort(idx.column("_i_min").to_numpy()))


class EngineActor:
    """Ray Data callable class: one engine per actor (started on the first cache miss), a
    batch of requests per call; new generations go to the cache per batch."""

    def __init__(
        self, model_dir: str, engine_cfg: dict[str, Any], model_id: str = "", cache_uri: str | None = None, storage_cfg: dict | None = None
    ):
        self.cfg = EngineConfig.model_validate(engine_cfg)
        self.model_dir = model_dir
        self.model_id = model_id or model_dir
        self.backend = None
        self.ready_at: float | None = None  # wall clock when the engine was ready (benchmarks)
        self.cache = None
        if cache_uri is not None:
            from atlas import storage
            from atlas.config import StorageConfig

            self.cache = GenerationCache(storage.resolve(cache_uri, StorageConfig.model_validate(storage_cfg or {})))

    def _engine(self):
        if self.backend is None:
            cfg = self.cfg
            if cfg.backend == "test":
                from atlas.engine.testing import TestBackend

                self.backend = TestBackend(self.model_dir, cfg)
            else:
                if cfg.device == "cpu" and cfg.backend == "transformers":
                    import torch

                    torch.set_num_threads(cpu_threads(cfg))
                self.backend = make_backend(self.model_dir, cfg)
            # Warm-up: first-call costs (kernels, sampler set-up) belong to start-up, not to a batch.
            self.backend.generate(["Warm-up."], Sampling(max_tokens=1))
            self.ready_at = time.time()
        return self.backend

    def _drop_engine(self) -> None:
        """Close the engine (its child processes die with it) so the next batch starts anew."""
        b, self.backend = getattr(self, "backend", None), None
        if b is not None:
            try:
                b.close()
            except Exception:  # noqa: BLE001 - best effort; the reaper kills what is left
                pass

    def __del__(self) -> None:
        self._drop_engine()

    def __call__(self, batch: pa.Table) -> pa.Table:
        n = batch.num_rows
        hashes = batch.column("request_hash").to_pylist()
        hit = [False] * n
        if CACHED + "model" in batch.column_names:
            hit = [m is not None for m in batch.column(CACHED + "model").to_pylist()]
        out: dict[str, list] = {c: [None] * n for c in ANSWER_COLUMNS}
        out["cached"] = list(hit)
        out["generated"] = [False] * n
        if any(hit):
            for c in _CACHE_FIELDS:
                col = batch.column(CACHED + c).to_pylist()
                for i in range(n):
                    if hit[i]:
                        out[c][i] = col[i]
        todo: dict[str, list[int]] = {}  # identical requests in one batch are generated once
        for i in range(n):
            if not hit[i]:
                todo.setdefault(hashes[i], []).append(i)
        if todo:
            prompts = batch.column("prompt").to_pylist()
            samplings = batch.column("sampling").to_pylist()
            groups: dict[str, list[int]] = {}
            for rows in todo.values():
                groups.setdefault(samplings[rows[0]], []).append(rows[0])
            fresh = []
            for skey, idx in groups.items():
                try:
                    results = self._engine().generate([prompts[i] for i in idx], Sampling.from_key(skey))
                except Exception as e:  # noqa: BLE001 - never fail the job for one batch
                    results = [Result(None, error=f"engine failure: {type(e).__name__}: {e}")] * len(idx)
                    self._drop_engine()  # the next batch starts a fresh engine
                for i, r in zip(idx, results):
                    for j in todo[hashes[i]]:
                        out["text"][j], out["output_tokens"][j] = r.text, r.output_tokens
                        out["finish_reason"][j], out["error"][j] = r.finish_reason, r.error
                    out["generated"][i] = True
                    # Transient failures (engine crash) are not cached, so a rerun retries them.
                    if (r.error is None and r.text is not None) or r.permanent:
                        fresh.append(
                            {"request_hash": hashes[i], "model": self.model_id, "text": r.text, "output_tokens": r.output_tokens,
                             "finish_reason": r.finish_reason, "error": r.error}
                        )
            if self.cache is not None:
                self.cache.put(fresh)
        keep = [c for c in batch.column_names if c not in ("prompt", "sampling") and not c.startswith(CACHED)]
        res = batch.select(keep)
        for c in ANSWER_COLUMNS:
            res = res.append_column(ANSWER + c, pa.array(out[c], _ANSWER_TYPES[c]))
        return res.append_column("_actor_ready_at", pa.array([self.ready_at] * n, pa.float64()))


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


def join_partitions(expected_rows: int | None) -> int:
    """Hash partitions of the cache join: ~20k requests each (a few tens of MB of prompts),
    so one join task never holds more than that."""
    return max(1, min(4096, -(-(expected_rows or 1) // 20_000)))


def stream_generate(
    requests: Any,
    cfg: EngineConfig,
    model_dir: str,
    model_id: str,
    cache_root: Location | None = None,
    use_cache: bool = True,
    storage_cfg: Any = None,
    expected_rows: int | None = None,
) -> Any:
    """Requests Dataset -> answered Dataset (see the module docstring). Lazy: nothing runs
    until the caller consumes the result."""
    import ray.data

    ds = requests.map_batches(add_request_hash, fn_kwargs={"model_id": model_id}, batch_format="pyarrow", zero_copy_batch=True)
    cache = GenerationCache(cache_root) if cache_root is not None else None
    if cache is not None and use_cache and cache.has_entries():
        ds = ds.join(cache.dataset(prefix=CACHED), join_type="left_outer", num_partitions=join_partitions(expected_rows), on=("request_hash",))
        ds = ds.map_batches(dedupe_keys, batch_size=None, batch_format="pyarrow", zero_copy_batch=True)
    # One engine batch per block: a Ray Data task emits its output only when its input block is
    # done, so a block of thousands of chunks on a slow engine would publish nothing for an
    # hour and trip Ray Data's no-progress timeout (seen: 2,200 chunks in one block, 30 min).
    ds = ds.repartition(target_num_rows_per_block=cfg.batch_size)
    res = actor_resources(cfg)
    return ds.map_batches(
        EngineActor,
        fn_constructor_kwargs={
            "model_dir": model_dir,
            "engine_cfg": cfg.model_dump(),
            "model_id": model_id,
            "cache_uri": cache_root.uri if (cache is not None and use_cache) else None,
            "storage_cfg": storage_cfg.model_dump() if storage_cfg is not None else None,
        },
        batch_size=cfg.batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=cfg.replicas),
        **res,
    )


def split_answers(batch: pa.Table) -> tuple[pa.Table, pa.Table]:
    """A streamed batch -> (request columns, answers with plain names + key + request_hash)."""
    req = [c for c in batch.column_names if not c.startswith(ANSWER) and c != "_actor_ready_at"]
    answers = batch.select(["key", "request_hash", *[ANSWER + c for c in ANSWER_COLUMNS]])
    answers = answers.rename_columns(["key", "request_hash", *ANSWER_COLUMNS])
    return batch.select(req), answers


def generate(
    requests: pa.Table,
    cfg: EngineConfig,
    model_dir: str,
    model_id: str,
    cache_root: Location | None = None,
    use_cache: bool = True,
    storage_cfg: Any = None,
) -> tuple[pa.Table, GenerationStats]:
    """Serve a small in-memory request table (key, prompt, sampling) through the same
    streaming path; returns it in request order with the answers, plus stats."""
    import ray.data

    t0 = time.perf_counter()
    stats = GenerationStats(rows=requests.num_rows)
    req = requests.select(["key", "prompt", "sampling"]).append_column("_row", pa.array(np.arange(requests.num_rows)))
    # Blocks of ~batch_size rows: at least one block per replica.
    n_blocks = max(1, min(requests.num_rows, max(cfg.replicas, -(-requests.num_rows // cfg.batch_size))))
    ds = ray.data.from_arrow(req).repartition(n_blocks)
    out = stream_generate(ds, cfg, model_dir, model_id, cache_root, use_cache, storage_cfg, expected_rows=requests.num_rows)
    refs = out.to_arrow_refs()
    parts = ray.get(refs) if refs else []
    tbl = pa.concat_tables(parts) if parts else None
    stats.finished_at = time.time()
    if tbl is None or tbl.num_rows == 0:
        empty = {c: pa.array([], t) for c, t in _ANSWER_TYPES.items() if c != "generated"}
        table = pa.table({"key": pa.array([], requests.schema.field("key").type), "request_hash": pa.array([], pa.string()), **empty})
        stats.seconds = time.perf_counter() - t0
        return table, stats
    tbl = tbl.sort_by("_row")
    ready = [r for r in tbl.column("_actor_ready_at").to_pylist() if r is not None]
    _, answers = split_answers(tbl)
    stats.engine_ready_at = min(ready) if ready else None
    stats.cached = pc.sum(answers.column("cached")).as_py() or 0
    stats.generated = pc.sum(answers.column("generated")).as_py() or 0
    stats.engine_started = stats.generated > 0
    stats.errors = answers.num_rows - answers.column("error").null_count
    stats.output_tokens = pc.sum(answers.column("output_tokens")).as_py() or 0
    stats.engine_seconds = stats.finished_at - (stats.engine_ready_at or stats.finished_at)
    stats.seconds = time.perf_counter() - t0
    return answers.drop_columns(["generated"]), stats
