"""Run the Atlas stages built so far, in order, recording a manifest.

``run(cfg)`` is what ``atlas run`` and the Ray job entrypoint (pipelines/run_atlas.py) call.
It connects to ``cfg.ray.address`` or starts a local Ray cluster for the run.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from atlas import storage
from atlas.cluster import ray_session
from atlas.config import ConfigError, RunConfig
from atlas.manifest import Manifest

log = logging.getLogger("atlas.run")

STAGES = ("ingest", "chunk", "stage1_tags", "stage1_judge")


def _stage_functions(cfg: RunConfig, root: storage.Location) -> dict[str, Callable[[], dict[str, Any]]]:
    from atlas import chunking, ingest, stage1_tags
    from atlas.engine import resolve_model

    def run_ingest() -> dict[str, Any]:
        stats = ingest.ingest(cfg.input, root, cfg.ingest, cfg.storage)
        return {**stats, "_tables": ["documents", "quarantine"]}

    def run_chunk() -> dict[str, Any]:
        tokenizer = cfg.chunking.tokenizer or resolve_model(cfg.engine.model)
        return {**chunking.chunk(root, tokenizer, cfg.chunking), "tokenizer": tokenizer, "_tables": ["chunks"]}

    def run_tags() -> dict[str, Any]:
        return {**stage1_tags.tag_chunks(root, cfg), "_tables": ["chunk_tags"]}

    def run_judge() -> dict[str, Any]:
        return {**stage1_tags.judge_tags(root, cfg), "_tables": ["tag_judgements", "tag_judge_by_chunk", "tag_judge_by_tag"]}

    return {"ingest": run_ingest, "chunk": run_chunk, "stage1_tags": run_tags, "stage1_judge": run_judge}


def run(cfg: RunConfig, stages: tuple[str, ...] = STAGES) -> dict[str, Any]:
    """Run ``stages`` on ``cfg`` and return the final manifest (also stored with the outputs)."""
    if not cfg.input or not cfg.output:
        raise ConfigError("a run needs both an input and an output URI (--input / --output)")
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ConfigError(f"unknown stage(s) {unknown}; known: {list(STAGES)}")
    cfg = cfg.with_run_id()
    root = storage.resolve(cfg.output, cfg.storage)
    manifest = Manifest(root, cfg, list(stages))
    enabled = {"stage1_tags": cfg.stage1.enabled, "stage1_judge": cfg.judge.enabled and cfg.stage1.enabled}
    with ray_session(cfg.ray):
        funcs = _stage_functions(cfg, root)
        for stage in stages:
            if not enabled.get(stage, True):
                manifest.skip(stage, "disabled in config")
                continue
            log.info("stage started", extra={"stage": stage, "run_id": cfg.run_id})
            manifest.start(stage)
            try:
                stats = funcs[stage]()
            except BaseException as e:
                manifest.fail(stage, e)
                log.error("stage failed", extra={"stage": stage, "run_id": cfg.run_id, "error": str(e)})
                raise
            manifest.finish(stage, stats)
            log.info("stage done", extra={"stage": stage, "run_id": cfg.run_id, "stats": manifest.data["stages"][stage]["stats"]})
    manifest.close("done")
    return manifest.data
