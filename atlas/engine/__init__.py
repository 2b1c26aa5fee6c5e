"""The LLM engine layer shared by tagging, labelling and judging.

Public API:

* :func:`resolve_model` - ``embedded:<name>`` -> prepared HF directory (converted once, cached).
* :class:`Engine` - one model + backend; renders prompts (chat template for instruct models)
  and serves request tables through the request cache and Ray Data engine actors.
* :class:`Sampling`, :func:`request_hash` - sampling/constraint spec and the cache key.
  ``Sampling(max_tokens=1, score_choices=("1", ..., "5"))`` scores answers by the model's
  probabilities; :func:`parse_score_text` / :func:`expected_score` read the result back.
* :mod:`atlas.engine.prompts` - few-shot prompts and output schemas.
* :class:`EngineActor` - the Ray Data callable class serving request batches; it owns
  ``vllm.LLM`` (or transformers) itself, or, inside an :func:`engine_session`, forwards to the
  run's shared :class:`EngineServer` actors.
* :func:`make_backend` - an in-process backend (benchmarks, notebooks).
"""

from __future__ import annotations

import functools
from typing import Callable

import pyarrow as pa

from atlas.config import EngineConfig
from atlas.engine.cache import GenerationCache
from atlas.engine.core import (
    Backend,
    Result,
    Sampling,
    ScoreError,
    TransformersBackend,
    VLLMBackend,
    engine_dtype,
    expected_score,
    make_backend,
    metrics_delta,
    parse_score_text,
    request_hash,
    score_text,
)
from atlas.engine.models import EMBEDDED, ModelError, is_instruct, prepare_embedded, resolve_model
from atlas.engine.runner import (
    EngineActor,
    EngineServer,
    GenerationStats,
    actor_resources,
    engine_session,
    generate,
    release_engines,
    split_answers,
    stream_generate,
)
from atlas.storage import Location

__all__ = [
    "Backend",
    "EMBEDDED",
    "Engine",
    "engine_dtype",
    "EngineActor",
    "EngineServer",
    "engine_session",
    "release_engines",
    "GenerationCache",
    "GenerationStats",
    "ModelError",
    "Result",
    "Sampling",
    "ScoreError",
    "TransformersBackend",
    "VLLMBackend",
    "actor_resources",
    "generate",
    "is_instruct",
    "expected_score",
    "make_backend",
    "metrics_delta",
    "parse_score_text",
    "prepare_embedded",
    "request_hash",
    "resolve_model",
    "split_answers",
    "stream_generate",
    "score_text",
]


@functools.lru_cache(maxsize=4)
def _chat_template(model_dir: str) -> Callable[[list[dict]], str] | None:
    """Once per process (driver or Ray worker): the tokenizer's chat template as a function."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if not tok.chat_template:
        return None
    return lambda messages: tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class Engine:
    """A model spec + engine config. Cheap to create: the heavy engine starts only inside Ray
    actors, and only for requests that are not cached."""

    def __init__(self, cfg: EngineConfig, model: str | None = None, storage_cfg=None):
        self.cfg = cfg
        self.model = model or cfg.model
        # How the engine actors reach a cache on S3 (endpoint, region): the run's storage config.
        self.storage_cfg = storage_cfg
        # The test backend (atlas.engine.testing) loads no model: nothing to prepare.
        self.model_dir = self.model if cfg.backend == "test" else resolve_model(self.model)
        self.instruct = is_instruct(self.model) and cfg.backend != "test"
        # The cache key's model id: what was asked for and how it is served.
        self.model_id = f"{self.model}|{cfg.backend}|{engine_dtype(cfg)}"

    @property
    def chat_template(self) -> Callable[[list[dict]], str] | None:
        """messages -> prompt text for instruction-tuned models; None for base models."""
        # Module-level cache, not an attribute: an Engine is pickled into Ray tasks.
        return _chat_template(self.model_dir) if self.instruct else None

    def generate(self, requests: pa.Table, cache_root: Location | None = None, use_cache: bool = True) -> tuple[pa.Table, GenerationStats]:
        """A small in-memory request table through the engine (labels, picks, benchmarks)."""
        return generate(requests, self.cfg, self.model_dir, self.model_id, cache_root=cache_root, use_cache=use_cache,
                        storage_cfg=self.storage_cfg)

    def stream(self, requests, cache_root: Location | None = None, use_cache: bool = True, expected_rows: int | None = None):
        """A request Ray Dataset -> answered Dataset (see :func:`stream_generate`)."""
        return stream_generate(requests, self.cfg, self.model_dir, self.model_id, cache_root, use_cache, self.storage_cfg, expected_rows)
