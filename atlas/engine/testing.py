"""``engine.backend: test`` - a deterministic stand-in for the LLM, for tests and benchmarks of
the pipeline itself (streaming, cache, resume, error bounds). Never a default, never for runs
whose outputs matter: its "tags" are just frequent words of the chunk.

It answers in the shape the constraint asks for: a JSON list of strings for a JSON-schema
array, one of the choices for a choice constraint, and for choice scoring
(``Sampling(score_choices=...)``) a probability distribution over the choices in the real
backends' form (:func:`atlas.engine.core.score_text`): relevance-like, a tag whose words all
occur in the text puts most mass on the last choice, any other tag on the first ones.
``engine.test_delay_s`` sleeps per generated row (so a run can be killed mid-stage); ``engine.test_invalid_rate`` answers that
fraction of prompts (chosen by prompt hash, so reruns agree) with text that is not JSON.
"""

from __future__ import annotations

import hashlib
import re
import time
from typing import Sequence

from atlas.config import EngineConfig
from atlas.engine.core import Backend, Result, Sampling, score_text

_WORD = re.compile(r"[A-Za-z][A-Za-z'-]{4,}")
# The tag of a judge prompt: "Tag: <tag>" or 'Is this text about "<tag>"?' (prompts.judge_prompt).
_ASK = re.compile(r'\nTag: ([^\n]*)|Is this text about "([^"\n]*)"\?')
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

    @staticmethod
    def _hit(q: str) -> bool:
        """Whether every word of the query's tag occurs in the query's text."""
        m = _ASK.search(q)
        if m is None:
            return False
        tag = (m.group(1) or m.group(2) or "").strip().lower()
        return bool(tag) and all(w in q[: m.start()].lower() for w in tag.split())

    def _score(self, p: str, q: str, choices: tuple[str, ...]) -> Result:
        # A peaked distribution (not one-hot) so expected score and argmax differ, fixed by the prompt.
        n = len(choices)
        peak = n - 1 if self._hit(q) else int(_unit(p, "choice") * 2)
        w = [1.0 + 8.0 * (i == peak) + _unit(p, f"w{i}") for i in range(n)]
        probs = [x / sum(w) for x in w]
        mass = 0.5 + 0.5 * _unit(p, "mass")
        best = max(range(n), key=probs.__getitem__)
        return Result(score_text(choices, probs, mass), output_tokens=0, finish_reason=f"score:{choices[best]}", probs=tuple(probs), choice_mass=mass)

    def generate(self, prompts: Sequence[str], sampling: Sampling) -> list[Result]:
        out: list[Result] = []
        for p in prompts:
            if self.cfg.test_delay_s:
                time.sleep(self.cfg.test_delay_s)
            if self.cfg.test_invalid_rate and _unit(p, "invalid") < self.cfg.test_invalid_rate:
                out.append(Result("this is not json", output_tokens=4, finish_reason="stop"))
                continue
            q = _query(p)
            if sampling.score_choices:
                out.append(self._score(p, q, sampling.score_choices))
                continue
            if sampling.choice:
                # Relevance-like: a tag whose words occur in the text scores high.
                text = sampling.choice[-1] if self._hit(q) else sampling.choice[int(_unit(p, "choice") * 2)]
            elif sampling.json_schema is not None:
                n = min(4, int(sampling.json_schema.get("maxItems", 4)))
                import json

                text = json.dumps(self._tags(q, n))
            else:
                text = " ".join(self._tags(q, 3))
            out.append(Result(text, output_tokens=max(1, len(text) // 4), finish_reason="stop"))
        return out
