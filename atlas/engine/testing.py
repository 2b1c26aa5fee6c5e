"""``engine.backend: test`` - a deterministic stand-in for the LLM, for tests and benchmarks of
the pipeline itself (streaming, cache, resume, error bounds). Never a default, never for runs
whose outputs matter: its "tags" are just frequent words of the chunk.

It answers in the shape the constraint asks for: a JSON list of strings for a JSON-schema
array, one of the choices for a choice constraint. ``engine.test_delay_s`` sleeps per
generated row (so a run can be killed mid-stage); ``engine.test_invalid_rate`` answers that
fraction of prompts (chosen by prompt hash, so reruns agree) with text that is not JSON.
"""

from __future__ import annotations

import hashlib
import re
import time
from typing import Sequence

from atlas.config import EngineConfig
from atlas.engine.core import Backend, Result, Sampling

_WORD = re.compile(r"[A-Za-z][A-Za-z'-]{4,}")
_STOP = {"which", "their", "there", "these", "those", "after", "where", "while", "about", "would", "could", "other"}


def _unit(prompt: str, salt: str) -> float:
    """A number in [0, 1) fixed by the prompt (deterministic across processes and runs)."""
    h = hashlib.sha256(f"{salt}\0{prompt}".encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(h[:8], "big") / 2**64


def _query(prompt: str) -> str:
    # Few-shot prompts end with the query; the examples before it must not leak into answers.
    i = prompt.rfind("Text:")
    return prompt[i + 5 :] if i >= 0 else prompt


class TestBackend(Backend):
    """Deterministic fake engine (see the module docstring)."""

    __test__ = False  # not a pytest class
    name = "test"

    def __init__(self, model_dir: str, cfg: EngineConfig):
        super().__init__(model_dir, cfg)
        self.load_seconds = 0.0

    def _tags(self, text: str, n: int) -> list[str]:
        seen: list[str] = []
        for w in _WORD.findall(text.split("\nTag")[0]):
            w = w.lower()
            if w not in _STOP and w not in seen:
                seen.append(w)
        seen.sort(key=lambda w: (-text.lower().count(w), w))
        return seen[: max(1, n)] or ["untitled"]

    def generate(self, prompts: Sequence[str], sampling: Sampling) -> list[Result]:
        out: list[Result] = []
        for p in prompts:
            if self.cfg.test_delay_s:
                time.sleep(self.cfg.test_delay_s)
            if self.cfg.test_invalid_rate and _unit(p, "invalid") < self.cfg.test_invalid_rate:
                out.append(Result("this is not json", output_tokens=4, finish_reason="stop"))
                continue
            q = _query(p)
            if sampling.choice:
                # Relevance-like: a tag whose words occur in the text scores high.
                tag = q.rsplit("Tag:", 1)[-1].strip().split("\n")[0].lower()
                hit = bool(tag) and all(w in q.lower().split("tag:")[0] for w in tag.split())
                text = sampling.choice[-1] if hit else sampling.choice[int(_unit(p, "choice") * 2)]
            elif sampling.json_schema is not None:
                n = min(4, int(sampling.json_schema.get("maxItems", 4)))
                import json

                text = json.dumps(self._tags(q, n))
            else:
                text = " ".join(self._tags(q, 3))
            out.append(Result(text, output_tokens=max(1, len(text) // 4), finish_reason="stop"))
        return out
