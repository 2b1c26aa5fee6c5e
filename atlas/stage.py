"""One stage interface for every Atlas step.

A stage declares its ``name``, the tables it reads (``inputs``) and publishes (``outputs``),
whether the config enables it, and ``run(ctx)`` which does the work through a
:class:`StageContext` and returns json-able stats. The runner (atlas/runner.py) owns Ray, the
manifest, input checks and skip-if-done; a stage owns none of these.

Register a stage once, at import of its module, and list that module in ``STAGE_MODULES``::

    @register
    class MyStage(Stage): ...            # or register(MyStage())

The pipeline order is the data-flow order (a stage runs after the stages publishing its
inputs), ties broken by the order of ``STAGE_MODULES``, then by registration order.

LLM stages (tagging, judging, labelling, validation) subclass :class:`LLMStage` and write
three small functions: ``source(ctx)`` (the input Dataset), ``requests(batch)`` (rows ->
``key``, ``prompt``, ``sampling`` plus columns to carry) and ``parse(batch, answers)``
(request rows + answers -> output rows). Generation streams through the engine actors with
the cache join inside Ray Data; the output is written per batch and published at the end.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
import time
import uuid
from typing import Any, ClassVar, Iterable, Protocol, runtime_checkable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from atlas import console, storage
from atlas.config import RunConfig

# Modules whose import registers stages, in pipeline order. Other packages add theirs here.
STAGE_MODULES: list[str] = ["atlas.ingest", "atlas.chunking", "atlas.stage1_tags", "atlas.stage2.stages", "atlas.stage3.stages"]
STAGE_RECORDS = "_stages"  # <root>/_stages/<stage>.json: how each stage last completed

REGISTRY: dict[str, "Stage"] = {}


class StageError(RuntimeError):
    """A stage cannot run or failed in a way the user must act on; the message says why."""


@runtime_checkable
class Stage(Protocol):
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def enabled(self, cfg: RunConfig) -> bool: ...

    def run(self, ctx: "StageContext") -> dict: ...


class BaseStage:
    """Convenience base: enabled by default; the config sections that decide the stage's
    output are ``config_keys`` (dotted paths into :class:`RunConfig`), part of its skip-if-done
    fingerprint together with the versions of its input tables."""

    name: ClassVar[str] = ""
    inputs: ClassVar[tuple[str, ...]] = ()
    outputs: ClassVar[tuple[str, ...]] = ()
    config_keys: ClassVar[tuple[str, ...]] = ()

    def enabled(self, cfg: RunConfig) -> bool:
        return True

    def keeps_engines(self, cfg: RunConfig) -> bool:
        """Whether the run's idle LLM engines may stay loaded while this stage runs (see
        :func:`keeps_engines`)."""
        return False

    def source_fingerprint(self, cfg: RunConfig) -> str | None:
        """Extra fingerprint of what the stage reads outside the run's tables (e.g. the corpus)."""
        return None

    def run(self, ctx: "StageContext") -> dict:  # pragma: no cover - abstract
        raise NotImplementedError


def keeps_engines(stage: Stage, cfg: RunConfig) -> bool:
    """True for a stage that uses the run's LLM engines or is light enough to run beside them
    idle (small tables, no actor pools or trainers); before any other stage the runner
    releases the engines, so their CPUs, GPUs and memory are free for it. Undeclared: False."""
    fn = getattr(stage, "keeps_engines", None)
    return bool(fn(cfg)) if fn is not None else False


def register(stage: Any) -> Any:
    """Add a stage (an instance, or a class with a no-argument constructor) to REGISTRY.
    Returns its argument, so it works as a class decorator."""
    inst = stage() if isinstance(stage, type) else stage
    if not isinstance(inst, Stage) or not inst.name:
        raise TypeError(f"{stage!r} does not implement the Stage protocol (name, inputs, outputs, enabled, run)")
    REGISTRY[inst.name] = inst
    return stage


def load_stages() -> dict[str, "Stage"]:
    for mod in STAGE_MODULES:
        importlib.import_module(mod)
    return REGISTRY


def pipeline_order(names: Iterable[str] | None = None) -> list[str]:
    """Registered stage names in data-flow order (a producer before its consumers), ties in
    ``STAGE_MODULES`` order, then registration order; ``names`` restricts the result to those stages."""
    reg = load_stages()
    producer = {t: n for n, s in reg.items() for t in s.outputs}
    order: list[str] = []
    visiting: set[str] = set()

    def visit(n: str) -> None:
        if n in order:
            return
        if n in visiting:
            raise StageError(f"stage dependency cycle through {n!r}")
        visiting.add(n)
        for t in reg[n].inputs:
            if t in producer and producer[t] != n:
                visit(producer[t])
        visiting.discard(n)
        order.append(n)

    # Ties follow STAGE_MODULES, then registration within a module: the order must not depend
    # on which module some caller happened to import first.
    def module_rank(n: str) -> int:
        mod = type(reg[n]).__module__
        return STAGE_MODULES.index(mod) if mod in STAGE_MODULES else len(STAGE_MODULES)

    for n in sorted(reg, key=module_rank):
        visit(n)
    if names is None:
        return order
    wanted = list(names)
    unknown = [n for n in wanted if n not in reg]
    if unknown:
        from atlas.config import ConfigError

        raise ConfigError(f"unknown stage(s) {unknown}; known: {order}")
    return [n for n in order if n in wanted]


# ---------------------------------------------------------------- skip-if-done


def _dig(data: dict, dotted: str) -> Any:
    node: Any = data
    for p in dotted.split("."):
        node = node.get(p) if isinstance(node, dict) else None
    return node


def fingerprint(stage: Stage, cfg: RunConfig, root: storage.Location) -> tuple[str, dict[str, str | None]]:
    """Hash of the stage's config sections and its input tables' versions."""
    data = cfg.model_dump(mode="json")
    keys = getattr(stage, "config_keys", ()) or tuple(k for k in data if k not in ("run_id", "output", "ray", "storage"))
    inputs = {t: storage.current_version(root, t) for t in stage.inputs}
    extra = stage.source_fingerprint(cfg) if hasattr(stage, "source_fingerprint") else None
    blob = json.dumps({"stage": stage.name, "config": {k: _dig(data, k) for k in keys}, "inputs": inputs, "extra": extra}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest(), inputs


def record_loc(root: storage.Location, name: str) -> storage.Location:
    return root.join(STAGE_RECORDS, f"{name}.json")


def read_record(root: storage.Location, name: str) -> dict | None:
    loc = record_loc(root, name)
    return storage.read_json(loc) if storage.exists(loc) else None


def up_to_date(stage: Stage, cfg: RunConfig, root: storage.Location) -> dict | None:
    """The completion record if the stage's fingerprint matches it and its outputs are still
    the versions it published; else None (the stage must run)."""
    rec = read_record(root, stage.name)
    if not rec or rec.get("fingerprint") != fingerprint(stage, cfg, root)[0]:
        return None
    for t in stage.outputs:
        if storage.current_version(root, t) != (rec.get("outputs", {}).get(t) or {}).get("version"):
            return None
    return rec


def write_record(root: storage.Location, stage: Stage, fp: str, inputs: dict, outputs: dict, stats: dict, run_id: str) -> None:
    storage.write_json_atomic(
        record_loc(root, stage.name),
        {"stage": stage.name, "fingerprint": fp, "inputs": inputs, "outputs": outputs, "stats": stats, "run_id": run_id,
         "completed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
    )


# ---------------------------------------------------------------- context


PART_ROWS = 4096  # rows per output Parquet part (one Ray task writes one part)
ERROR_SAMPLES = 5


def _write_part(batch: pa.Table, version_path: str, fs_uri: str, storage_cfg: dict, schema: pa.Schema | None) -> pa.Table:
    """Write one batch as one Parquet part; return one row of counts (what the driver sees)."""
    from atlas.config import StorageConfig

    cached = int(pc.sum(batch.column("cached")).as_py() or 0) if "cached" in batch.column_names else 0
    generated = int(pc.sum(batch.column("_generated")).as_py() or 0) if "_generated" in batch.column_names else 0
    tokens = int(pc.sum(batch.column("output_tokens")).as_py() or 0) if "output_tokens" in batch.column_names else 0
    if schema is not None:
        from atlas.schemas import conform

        batch = conform(batch, schema)
    else:
        batch = batch.select([c for c in batch.column_names if not c.startswith("_")])
    loc = storage.resolve(fs_uri, StorageConfig.model_validate(storage_cfg))
    name = f"part-{uuid.uuid4().hex}.parquet"
    if batch.num_rows:
        pq.write_table(batch, f"{version_path}/{name}", filesystem=loc.fs)
    errors, samples = 0, []
    if "error" in batch.column_names:
        err = batch.column("error")
        errors = len(err) - err.null_count
        if errors:
            ids = batch.column(0)
            idx = pc.indices_nonzero(pc.invert(pc.is_null(err))).to_pylist()[:ERROR_SAMPLES]
            samples = [[str(ids[i].as_py()), str(err[i].as_py())] for i in idx]
    return pa.table(
        {
            "rows": [batch.num_rows],
            "errors": [errors],
            "cached": [cached],
            "generated": [generated],
            "output_tokens": [tokens],
            "samples": [json.dumps(samples)],
        }
    )


def check_error_rate(stage: str, errors: int, rows: int, bound: float | None, samples: list, where: str = "") -> None:
    """Raise :class:`StageError` when ``errors / rows`` exceeds ``bound``, naming the stage,
    the rate and a few record ids with their reasons."""
    if bound is None or rows == 0 or errors / rows <= bound:
        return
    shown = "; ".join(f"{i}: {r[:200]}" for i, r in samples[:ERROR_SAMPLES])
    raise StageError(
        f"stage {stage}: per-row error rate {errors / rows:.1%} ({errors} of {rows} rows) exceeds "
        f"the configured bound {bound:.1%}{where}. Examples: {shown}"
    )


class StageContext:
    """What a stage gets from the runner: where the run writes, its config and run id, and the
    ways to read, publish, generate and show progress. Stages never start Ray or touch the
    manifest."""

    def __init__(self, root: storage.Location, cfg: RunConfig, run_id: str, stage: str = ""):
        self.root = root
        self.cfg = cfg
        self.run_id = run_id
        self.stage = stage
        self.published: dict[str, dict] = {}

    # -- reading
    def read(self, table: str):
        """The committed version of ``table`` as a Ray Dataset (streamed, never collected)."""
        return storage.read_dataset(self.root, table)

    def read_table(self, table: str, columns: list[str] | None = None) -> pa.Table:
        """The committed version of ``table`` in driver memory: ONLY for small tables."""
        return storage.read_table(self.root, table, columns=columns)

    def rows(self, table: str) -> int | None:
        """Row count of a published table (from its pointer; no data read)."""
        ptr = self.root.join(table, storage.POINTER)
        return storage.read_json(ptr).get("rows") if storage.exists(ptr) else None

    # -- engine and progress
    def engine(self, model: str | None = None):
        """The LLM engine for ``model`` (default ``engine.model``); heavy parts start in actors."""
        from atlas.engine import Engine

        return Engine(self.cfg.engine, model=model, storage_cfg=self.cfg.storage)

    def progress(self, desc: str, total: int | None = None) -> console.NullProgress:
        """A console progress bar (rich) - ``advance(n)``, ``update(total=)``, ``close()``."""
        return console.progress(desc, total)

    # -- publishing
    def publish(
        self,
        table: str,
        data: Any,
        schema: pa.Schema | None = None,
        *,
        desc: str | None = None,
        total: int | None = None,
        max_error_rate: float | None = None,
        part_rows: int = PART_ROWS,
    ) -> dict:
        """Write ``data`` (a Ray Dataset, streamed in parts, or a small ``pa.Table``) as a new
        version of ``table`` and flip the pointer. Returns the pointer plus counts:
        ``errors`` / ``cached`` / ``generated`` / ``error_samples`` when the rows have
        ``error`` / ``cached`` columns. With ``max_error_rate`` the version is not published
        (and the write stops early once the bound is certain to be passed) when too many
        rows carry an error."""
        if isinstance(data, pa.Table):
            if schema is not None:
                from atlas.schemas import conform

                data = conform(data, schema)
            n_err = (data.num_rows - data.column("error").null_count) if "error" in data.column_names else 0
            samples = []
            if n_err:
                idx = pc.indices_nonzero(pc.invert(pc.is_null(data.column("error")))).to_pylist()[:ERROR_SAMPLES]
                samples = [[str(data.column(0)[i].as_py()), str(data.column("error")[i].as_py())] for i in idx]
            check_error_rate(self.stage or table, n_err, data.num_rows, max_error_rate, samples)
            ptr = storage.write_table(self.root, table, data)
            counts = {"errors": n_err, "error_samples": samples}
        else:
            ptr, counts = self._publish_dataset(table, data, schema, desc, total, max_error_rate, part_rows)
        self.published[table] = ptr
        return {**ptr, **counts}

    def _publish_dataset(self, table, ds, schema, desc, total, bound, part_rows) -> tuple[dict, dict]:
        version = storage.new_version(self.root, table)
        root_uri = self.root.uri
        parts = ds.map_batches(
            _write_part,
            fn_kwargs={
                "version_path": version.path,
                "fs_uri": root_uri,
                "storage_cfg": self.cfg.storage.model_dump(),
                "schema": schema,
            },
            batch_size=part_rows,
            batch_format="pyarrow",
            num_cpus=0.5,  # short I/O tasks; a smaller share would spawn many worker processes on small hosts
        )
        rows = errors = cached = generated = tokens = 0
        samples: list = []
        where = f" (unpublished output left at {version.uri})"
        with self.progress(desc or f"{self.stage or table} → {table}", total) as bar:
            for c in parts.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0):
                rows += pc.sum(c.column("rows")).as_py() or 0
                errors += pc.sum(c.column("errors")).as_py() or 0
                cached += pc.sum(c.column("cached")).as_py() or 0
                generated += pc.sum(c.column("generated")).as_py() or 0
                tokens += pc.sum(c.column("output_tokens")).as_py() or 0
                if len(samples) < ERROR_SAMPLES:
                    for s in c.column("samples").to_pylist():
                        samples.extend(json.loads(s))
                    samples = samples[:ERROR_SAMPLES]
                bar.advance(int(pc.sum(c.column("rows")).as_py() or 0))
                if bound is not None and total and errors > bound * total:
                    # Certain to fail: stop now instead of generating the rest.
                    check_error_rate(self.stage or table, errors, rows, bound, samples, where + ", stopped early")
        if rows == 0:
            if schema is None:
                raise StageError(f"cannot publish empty table {table!r} without a schema")
            pq.write_table(schema.empty_table(), version.join("part-empty.parquet").path, filesystem=version.fs)
        check_error_rate(self.stage or table, errors, rows, bound, samples, where)
        ptr = storage.publish(self.root, table, version, rows)
        return ptr, {"errors": errors, "cached": cached, "generated": generated, "output_tokens": tokens, "error_samples": samples}


# ---------------------------------------------------------------- small-Dataset helpers


def keep_rows(ds: Any, column: str, values: Iterable[str]) -> Any:
    """Rows of Dataset ``ds`` whose string ``column`` is in ``values`` (a small set, broadcast to the tasks)."""
    vs = pa.array(sorted(set(values)), pa.string())
    return ds.map_batches(lambda b: b.filter(pc.is_in(b.column(column), value_set=vs)), batch_format="pyarrow")


def collect(ds: Any, schema: pa.Schema) -> pa.Table:
    """A Dataset known to be small as one driver-side table (``schema``'s empty table when it has no rows)."""
    parts = [b for b in ds.iter_batches(batch_size=None, batch_format="pyarrow") if b.num_rows]
    return pa.concat_tables(parts) if parts else schema.empty_table()


# ---------------------------------------------------------------- LLM stages


class LLMStage(BaseStage):
    """The shared shape of LLM stages: rows -> requests -> generate (cache join + engine
    actors, streamed) -> parse -> one output table, published per batch.

    Subclasses set ``name``, ``inputs``, ``outputs`` (the first output is the generated
    table), ``output_schema``, ``config_keys`` and implement :meth:`requests` and
    :meth:`parse`; optionally :meth:`source` (default: the first input as a Dataset),
    :meth:`model` (default ``engine.model``), :meth:`max_error_rate` and :meth:`finish`
    (extra tables / plots after the main table is published). During ``run`` the hooks can
    use ``self.cfg`` and ``self.engine`` (an :class:`atlas.engine.Engine`); they run inside
    Ray tasks, so they must be plain functions of their arguments and these two fields.
    """

    output_schema: ClassVar[pa.Schema | None] = None
    cfg: RunConfig
    engine: Any

    def model(self, cfg: RunConfig) -> str | None:
        return None

    def keeps_engines(self, cfg: RunConfig) -> bool:
        return True

    def max_error_rate(self, cfg: RunConfig) -> float | None:
        return cfg.stage1.max_error_rate

    def use_cache(self, cfg: RunConfig) -> bool:
        return cfg.stage1.cache

    def source(self, ctx: StageContext):
        return ctx.read(self.inputs[0])

    def expected_rows(self, ctx: StageContext) -> int | None:
        """Request rows, if known up front (progress total, early error-rate stop)."""
        return None

    def requests(self, batch: pa.Table) -> pa.Table:  # pragma: no cover - abstract
        raise NotImplementedError

    def parse(self, batch: pa.Table, answers: pa.Table) -> pa.Table:  # pragma: no cover - abstract
        raise NotImplementedError

    def finish(self, ctx: StageContext, published: dict) -> dict:
        return {}

    # -- the shared machinery
    def bind(self, ctx: StageContext) -> "LLMStage":
        bound = copy.copy(self)
        bound.cfg = ctx.cfg
        bound.engine = ctx.engine(self.model(ctx.cfg))
        return bound

    def _requests(self, batch: pa.Table) -> pa.Table:
        req = self.requests(batch)
        missing = {"key", "prompt", "sampling"} - set(req.column_names)
        if missing:
            raise StageError(f"stage {self.name}: requests() lacks column(s) {sorted(missing)}")
        return req

    def _parse(self, batch: pa.Table) -> pa.Table:
        from atlas.engine import split_answers

        req, answers = split_answers(batch)
        out = self.parse(req, answers)
        if out.num_rows != batch.num_rows:
            raise StageError(f"stage {self.name}: parse() returned {out.num_rows} rows for {batch.num_rows} answers")
        return out.append_column("_generated", answers.column("generated"))

    def run(self, ctx: StageContext) -> dict:
        t0 = time.perf_counter()
        job = self.bind(ctx)
        expected = job.expected_rows(ctx)
        reqs = job.source(ctx).map_batches(job._requests, batch_format="pyarrow", zero_copy_batch=True)
        answered = job.engine.stream(reqs, cache_root=ctx.root, use_cache=self.use_cache(ctx.cfg), expected_rows=expected)
        rows = answered.map_batches(job._parse, batch_format="pyarrow", zero_copy_batch=True)
        out = self.outputs[0]
        pub = ctx.publish(out, rows, self.output_schema, desc=f"{self.name} → {out}", total=expected, max_error_rate=self.max_error_rate(ctx.cfg))
        stats = {
            "rows": pub["rows"],
            "ok": pub["rows"] - pub["errors"],
            "errors": pub["errors"],
            "error_rate": round(pub["errors"] / pub["rows"], 4) if pub["rows"] else 0.0,
            "error_samples": pub["error_samples"],
            "cached": pub["cached"],
            "generated": pub["generated"],
            "output_tokens": pub["output_tokens"],
            "engine_started": pub["generated"] > 0,
            "model": job.engine.model,
        }
        stats.update(job.finish(ctx, pub))
        stats["seconds"] = round(time.perf_counter() - t0, 3)
        return stats
