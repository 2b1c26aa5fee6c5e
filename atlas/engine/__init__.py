"""The LLM engine layer shared by tagging, labelling and judging.

Public API:

* :func:`resolve_model` - ``embedded:<name>`` -> prepared HF directory (converted once, cached).
* :class:`Engine` - one model + backend; renders prompts (chat template for instruct models)
  and serves request tables through the request cache and Ray Data engine actors.
* :class:`Sampling`, :func:`request_hash` - sampling/constraint spec and the cache key.
  ``Sampling(max_tokens=1, score_choices=("1", ..., "5"))`` scores answers by the model's
  probabilities; :func:`parse_score_text` / :func:`expected_score` read the result back.
* :mod:`atlas.engine.prompts` - few-shot prompts and output schemas.
* :class:`EngineActor` - the Ray Data callable class owning ``vllm.LLM`` (or transformers).
* :func:`make_backend` - an in-process backend (benchmarks, notebooks).
"""

from __future__ import annotations

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
    expected_score,
    make_backend,
    metrics_delta,
    parse_score_text,
    request_hash,
    score_text,
)
from atlas.engine.models import EMBEDDED, ModelError, is_instruct, prepare_embedded, resolve_model
from atlas.engine.runner import EngineActor, GenerationStats, actor_resources, generate
from atlas.storage import Location

__all__ = [
    "Backend",
    "EMBEDDED",
    "Engine",
    "EngineActor",
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
    "score_text",
]


class Engine:
    """A model spec + engine config. Cheap to create: the heavy engine starts only inside Ray
    actors, and only for requests that are not cached."""

    def __init__(self, cfg: EngineConfig, model: str | None = None):
        self.cfg = cfg
        self.model = model or cfg.model
        self.model_dir = resolve_model(self.model)
        self.instruct = is_instruct(self.model)
        # The cache key's model id: what was asked for and how it is served.
        self.model_id = f"{self.model}|{cfg.backend}|{cfg.dtype}"
        self._template: Callable | None = None

    @property
    def chat_template(self) -> Callable[[list[dict]], str] | None:
        """messages -> prompt text for instruction-tuned models; None for base models."""
        if not self.instruct:
            return None
        if self._template is None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.model_dir)
            if not tok.chat_template:
                self.instruct = False
                return None
            self._template = lambda messages: tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self._template

    def generate(self, requests: pa.Table, cache_root: Location | None = None, use_cache: bool = True) -> tuple[pa.Table, GenerationStats]:
        return generate(requests, self.cfg, self.model_dir, self.model_id, cache_root=cache_root, use_cache=use_cache)
