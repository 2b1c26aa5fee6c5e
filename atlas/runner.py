"""Run the registered Atlas stages in data-flow order, recording a manifest.

``run(cfg)`` is what ``atlas run`` and the Ray job entrypoint (pipelines/run_atlas.py) call.
The runner knows no stage details: it takes stages from :data:`atlas.stage.REGISTRY`, checks
their inputs are published, skips a stage whose fingerprint (config sections + input table
versions) matches its last completion, owns Ray (started only when a stage has to run) and
records each stage's stats and published tables in the manifest and in
``<root>/_stages/<stage>.json``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from atlas import stage as stg
from atlas import storage
from atlas.cluster import ray_session
from atlas.config import ConfigError, RunConfig
from atlas.engine.runner import engine_loads, engine_session, release_engines
from atlas.manifest import Manifest

log = logging.getLogger("atlas.run")


def __getattr__(name: str) -> Any:
    if name == "STAGES":  # the default pipeline, resolved lazily (stage modules register on import)
        return tuple(stg.pipeline_order())
    raise AttributeError(name)


def _pointers(root: storage.Location, tables: tuple[str, ...]) -> dict[str, dict]:
    out = {}
    for t in tables:
        ptr = root.join(t, storage.POINTER)
        if storage.exists(ptr):
            out[t] = storage.read_json(ptr)
    return out


def run(cfg: RunConfig, stages: tuple[str, ...] | None = None, force: bool = False, console: Any = None) -> dict[str, Any]:
    """Run ``stages`` (default: all registered) on ``cfg``; returns the manifest (also stored
    with the outputs). ``force`` reruns stages that are up to date."""
    if not cfg.input or not cfg.output:
        raise ConfigError("a run needs both an input and an output URI (--input / --output)")
    names = stg.pipeline_order(stages)
    cfg = cfg.with_run_id()
    root = storage.resolve(cfg.output, cfg.storage)
    manifest = Manifest(root, cfg, names)
    with contextlib.ExitStack() as stack:
        ray_up = False
        for name in names:
            stage = stg.REGISTRY[name]
            extra = {"stage": name, "run_id": cfg.run_id}
            if not stage.enabled(cfg):
                manifest.skip(name, "disabled in config")
                _tell(console, name, "skipped", None, "disabled in config")
                continue
            missing = [t for t in stage.inputs if not storage.table_exists(root, t)]
            if missing:
                err = stg.StageError(
                    f"stage {name} needs table(s) {missing}, not published under {root.uri}; "
                    f"run the stage(s) producing them first"
                )
                manifest.start(name)
                manifest.fail(name, err)
                _tell(console, name, "failed", None, str(err))
                raise err
            rec = None if force else stg.up_to_date(stage, cfg, root)
            if rec is not None:
                why = f"up to date (completed in run {rec.get('run_id')})"
                manifest.skip(name, why, tables=_pointers(root, stage.outputs), stats=rec.get("stats"))
                log.info("stage skipped", extra={**extra, "reason": why})
                _tell(console, name, "skipped", None, why)
                continue
            if not ray_up:
                if console is not None:  # before ray.init: its start-up lines go to the log too
                    from atlas.console import route_ray_logs

                    route_ray_logs(getattr(console, "log_file", None))
                stack.enter_context(ray_session(cfg.ray, shared_uris=(cfg.input, cfg.output)))
                stack.enter_context(engine_session())  # left before Ray is shut down
                ray_up = True
            if not stg.keeps_engines(stage, cfg):
                release_engines()  # a stage that needs the machine gets it without idle engines
            loads = engine_loads()
            fp, inputs = stg.fingerprint(stage, cfg, root)
            log.info("stage started", extra=extra)
            if console is not None:
                console.stage_started(name)
            manifest.start(name)
            t0 = time.perf_counter()
            try:
                stats = stage.run(stg.StageContext(root, cfg, cfg.run_id or "", name))
                stats["engine_loads"] = engine_loads() - loads
            except BaseException as e:
                manifest.fail(name, e)
                log.error("stage failed", extra={**extra, "error": str(e)})
                _tell(console, name, "failed", time.perf_counter() - t0, "")
                raise
            tables = _pointers(root, stage.outputs)
            manifest.finish(name, stats, tables)
            stg.write_record(root, stage, fp, inputs, tables, stats, cfg.run_id or "")
            log.info("stage done", extra={**extra, "stats": stats})
            rows = ", ".join(f"{t}: {p.get('rows')} rows" for t, p in tables.items())
            _tell(console, name, "done", time.perf_counter() - t0, rows)
    manifest.close("done")
    return manifest.data


def _tell(console: Any, name: str, status: str, seconds: float | None, note: str) -> None:
    if console is not None:
        console.end_progress()
        console.stage_ended(name, status, seconds, note)
