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

Inside an :func:`engine_session` (the runner opens one per run) the engine itself lives in
:class:`EngineServer` actors shared by every call with the same model and engine config, so
consecutive LLM stages load a model once (on CPU ~30 s for Gemma 3 270M; minutes for a
large model on GPU); the Ray Data actors then only fill from the cache, forward misses and
write the cache. A session holds one model's servers at a time (a stage on another model
frees them first), and the runner releases them before any stage that does not declare
:meth:`~atlas.stage.BaseStage.keeps_engines`, so embedding, clustering and training never run
beside an idle engine's memory and GPUs, and no idle engine holds CPUs that a stage's Ray
Data tasks wait for (Ray Data cannot see resources held outside its pipeline). Outside a
session each actor owns its engine.

:func:`generate` is the same path for a small in-memory request table (benchmarks).

Resources per engine (the actor owning it: a server in a session, else the Ray Data actor):
* CPU: ``num_cpus=cpus_per_replica`` (a scheduling share; keep it fractional on small hosts),
  a KV cache of ``kv_cache_gib`` (the engine's ``kv_cache_memory_bytes``). vLLM binds its
  own OMP threads ('auto': all cores but one, which its scheduler keeps; measured fastest on
  2 cores); ``cpu_threads`` overrides that, and sets the torch thread count of the transformers backend (default: host cores /
  replicas; Ray would otherwise leave OMP_NUM_THREADS at num_cpus).
* GPU: ``num_gpus = gpus_per_replica * tensor_parallel_size`` (tensor parallelism inside one
  actor, vLLM's multiprocessing executor over the GPUs Ray assigned it, so one replica stays
  on one node), ``accelerator_type`` as a Ray scheduling constraint, and
  ``gpu_memory_utilization``.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
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


class EngineServer:
    """Owns one engine: started on its first request, closed (and started anew on the next
    request) when a call fails, e.g. because vLLM's core died. Used in-process by an
    :class:`EngineActor`, or as a Ray actor that the stages of one run share (see
    :func:`engine_session`), so a run loads each model once instead of once per stage."""

    def __init__(self, model_dir: str, engine_cfg: dict[str, Any]):
        self.cfg = EngineConfig.model_validate(engine_cfg)
        self.model_dir = model_dir
        self.backend = None
        self.ready_at: float | None = None  # wall clock when the engine was ready (benchmarks)
        self.loads = 0  # engines started by this server (a stage's "engine_loads")
        self._claims: dict[str, int] = {}

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
            self.loads += 1
        return self.backend

    def _drop_engine(self) -> None:
        """Close the engine (its child processes die with it) so the next call starts anew."""
        b, self.backend = getattr(self, "backend", None), None
        if b is not None:
            try:
                b.close()
            except Exception:  # noqa: BLE001 - best effort; the reaper kills what is left
                pass

    def __del__(self) -> None:
        self._drop_engine()

    def generate(self, prompts: list[str], sampling_key: str) -> tuple[list[Result], float | None]:
        """Answers of ``prompts`` (one per prompt, errors included; never raises) and the time
        the serving engine was ready."""
        try:
            results = self._engine().generate(prompts, Sampling.from_key(sampling_key))
        except Exception as e:  # noqa: BLE001 - never fail the job for one batch
            results = [Result(None, error=f"engine failure: {type(e).__name__}: {e}")] * len(prompts)
            self._drop_engine()  # the next call starts a fresh engine
        return results, self.ready_at

    def claim(self, token: str) -> int:
        """How many Ray Data actors of the pipeline ``token`` claimed this server before."""
        n = self._claims.get(token, 0)
        self._claims[token] = n + 1
        return n

    def stats(self) -> dict[str, Any]:
        return {"loads": self.loads, "ready_at": self.ready_at}

    def close(self) -> None:
        self._drop_engine()


class EngineActor:
    """Ray Data callable class: a batch of requests per call, cached rows filled from the
    join, the rest generated by its engine server (in this process, or a shared
    :class:`EngineServer` actor of the run's :func:`engine_session`); new generations go to
    the cache per batch."""

    def __init__(
        self, model_dir: str, engine_cfg: dict[str, Any], model_id: str = "", cache_uri: str | None = None, storage_cfg: dict | None = None,
        servers: list | None = None, token: str = "",
    ):
        self.model_id = model_id or model_dir
        self.ready_at: float | None = None
        self.cache = None
        if cache_uri is not None:
            from atlas import storage
            from atlas.config import StorageConfig

            self.cache = GenerationCache(storage.resolve(cache_uri, StorageConfig.model_validate(storage_cfg or {})))
        self.server: Any = EngineServer(model_dir, engine_cfg) if not servers else _claim(servers, token)

    def _generate(self, prompts: list[str], sampling_key: str) -> list[Result]:
        if isinstance(self.server, EngineServer):
            results, ready = self.server.generate(prompts, sampling_key)
        else:
            import ray

            try:
                results, ready = ray.get(self.server.generate.remote(prompts, sampling_key))
            except Exception as e:  # noqa: BLE001 - the server process died: Ray restarts it, the next batch retries
                return [Result(None, error=f"engine failure: {type(e).__name__}: {str(e)[:300]}")] * len(prompts)
        self.ready_at = ready
        return results

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
                results = self._generate([prompts[i] for i in idx], skey)
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
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        res = {"num_cpus": cfg.cpus_per_replica}
    res["runtime_env"] = {"env_vars": env}
    return res


# Server processes of the open engine session, by (model dir, model id, engine config);
# None: no session, each stage's actors own their engines.
_SESSION: dict[str, list] | None = None
_RELEASED_LOADS = 0  # engine loads of servers already released in this session
# Ray Data actors in front of shared servers only move batches and write the cache; they hold
# no CPU, so the engine's share (held by its server) is all an LLM stage holds, as without a
# session, and the stage's read tasks still find a whole CPU on a 2-core node.
PROXY_CPUS = 0


@contextlib.contextmanager
def engine_session():
    """Within it, every stage (every :func:`stream_generate`) that asks for the same model and
    engine config is served by the same :class:`EngineServer` actors (``engine.replicas`` of
    them, holding the engine's Ray resources), so a run loads a model once, not once per
    stage. It holds one engine (model and config) at a time: a stage asking for another one
    frees the current one first. :func:`release_engines` frees them early, and leaving the
    session frees them. Nested sessions are the outer one."""
    global _SESSION, _RELEASED_LOADS
    if _SESSION is not None:
        yield
        return
    _SESSION, _RELEASED_LOADS = {}, 0
    try:
        yield
    finally:
        release_engines()
        _SESSION = None


def _session_servers(cfg: EngineConfig, model_dir: str, model_id: str) -> list | None:
    """The open session's servers for this engine (started now if new); None outside a session."""
    if _SESSION is None:
        return None
    import json

    import ray

    key = json.dumps([model_dir, model_id, cfg.model_dump(mode="json")], sort_keys=True)
    if key not in _SESSION:
        # One model's engines at a time: idle servers of another model would hold resources
        # that this stage's Ray Data tasks wait for, which Ray Data cannot see (a deadlock on
        # a small node). Runs switch models between stages, rarely back and forth.
        release_engines()
        # A server process that dies (OOM, segfault) is restarted by Ray; batches in flight get
        # transient errors (not cached, so a rerun retries them).
        server = ray.remote(EngineServer).options(max_restarts=3, **actor_resources(cfg))
        _SESSION[key] = [server.remote(model_dir, cfg.model_dump()) for _ in range(cfg.replicas)]
    return _SESSION[key]


def _claim(servers: list, token: str):
    """The server of a new Ray Data actor: the first one no other actor of the same pipeline
    claimed (one engine per actor, as without a session), else the least claimed."""
    import ray

    counts = []
    for s in servers:
        n = ray.get(s.claim.remote(token))
        if n == 0:
            return s
        counts.append(n)
    return servers[int(np.argmin(counts))]


def engine_loads() -> int:
    """Engines started so far in the open session (0 outside one)."""
    if not _SESSION:
        return _RELEASED_LOADS if _SESSION is not None else 0
    import ray

    live = 0
    for servers in _SESSION.values():
        try:
            live += sum(st["loads"] for st in ray.get([s.stats.remote() for s in servers], timeout=60))
        except Exception:  # noqa: BLE001 - a dead server loaded nothing we can count
            pass
    return _RELEASED_LOADS + live


def release_engines() -> None:
    """Close and stop the session's engine servers (their Ray resources are free again)."""
    global _RELEASED_LOADS
    if not _SESSION:
        return
    import ray

    _RELEASED_LOADS = engine_loads()
    servers = [s for group in _SESSION.values() for s in group]
    _SESSION.clear()
    try:
        ray.get([s.close.remote() for s in servers], timeout=120)
    except Exception:  # noqa: BLE001 - killed below either way
        pass
    for s in servers:
        ray.kill(s, no_restart=True)


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
    servers = _session_servers(cfg, model_dir, model_id)
    if servers:  # the engine's resources are held by the servers
        res = {"num_cpus": PROXY_CPUS, "runtime_env": res["runtime_env"]}
    return ds.map_batches(
        EngineActor,
        fn_constructor_kwargs={
            "model_dir": model_dir,
            "engine_cfg": cfg.model_dump(),
            "model_id": model_id,
            "cache_uri": cache_root.uri if (cache is not None and use_cache) else None,
            "storage_cfg": storage_cfg.model_dump() if storage_cfg is not None else None,
            "servers": servers,
            "token": uuid.uuid4().hex,
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
