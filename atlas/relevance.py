"""Judge relevance ratings of (chunk, concept) pairs beside a same-chunk control.

Shared by Stage 2 (Fig. 9: the concepts the library assigns to chunks) and Stage 3 (Fig. 10:
the concepts the annotator predicts on held-out chunks). Each sampled (chunk, concept) pair is
matched with the **same chunk and a random concept not assigned to it**, so the difference of
the two ratings isolates the concept from the chunk (a judge that rates every pair alike, or
only reacts to the chunk, reads 0).

``judge`` gets (chunk text, concept name) pairs and returns a 1-5 score or None per pair (e.g.
:func:`atlas.stage1_tags.judge_pairs`: the Stage 1 judge's expected score).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

Judge = Callable[[list[tuple[str, str]]], Sequence[float | None]]


@dataclass
class PairedRatings:
    """Row indices into the caller's texts / concepts; scores in the same order (None: unrated)."""

    pairs: list[tuple[int, int]]  # (chunk, assigned concept)
    control: list[tuple[int, int]]  # (same chunk, random concept not assigned to it)
    scores: list[float | None]
    control_scores: list[float | None]


def rate_with_control(texts: Sequence[str], assigned: np.ndarray, concept_names: Sequence[str], judge: Judge,
                      max_pairs: int = 500, seed: int = 0) -> PairedRatings:
    """Sample up to ``max_pairs`` (chunk, concept) pairs where ``assigned`` (chunks x concepts)
    is true, add each one's control, and have ``judge`` rate both in one call. Chunks assigned
    every concept have no control and are left out."""
    rng = np.random.default_rng(seed)
    pairs = [(int(i), int(j)) for i, j in zip(*np.nonzero(assigned))]
    if len(pairs) > max_pairs:
        pairs = [pairs[k] for k in sorted(rng.choice(len(pairs), max_pairs, replace=False))]
    control = []
    for i, _ in pairs:
        others = np.flatnonzero(~assigned[i].astype(bool))
        control.append((i, int(rng.choice(others))) if len(others) else None)
    keep = [k for k, c in enumerate(control) if c is not None]
    pairs, control = [pairs[k] for k in keep], [control[k] for k in keep]
    asked = pairs + control
    scores = list(judge([(texts[i], concept_names[j]) for i, j in asked])) if asked else []
    return PairedRatings(pairs, control, scores[: len(pairs)], scores[len(pairs):])


def summarise(r: PairedRatings, n_boot: int = 1000, seed: int = 0, labels: tuple[str, str] = ("predicted", "random_concept")) -> dict[str, Any]:
    """Mean rating of the pairs and of their controls, and the paired difference (over pairs
    where both were rated) with a bootstrap 95% CI."""

    def mean_of(ss: list) -> dict[str, Any]:
        ok = [s for s in ss if s is not None]
        return {"pairs": len(ss), "rated": len(ok), "mean": float(np.mean(ok)) if ok else float("nan")}

    both = np.array([(a, b) for a, b in zip(r.scores, r.control_scores) if a is not None and b is not None], dtype=float).reshape(-1, 2)
    diff = both[:, 0] - both[:, 1]
    ci = (float("nan"), float("nan"))
    if len(diff):
        rng = np.random.default_rng(seed)
        boots = diff[rng.integers(0, len(diff), size=(n_boot, len(diff)))].mean(1)
        ci = tuple(np.percentile(boots, [2.5, 97.5]).tolist())
    return {
        labels[0]: mean_of(r.scores), labels[1]: mean_of(r.control_scores),
        "difference": {"pairs": len(diff), "mean": float(diff.mean()) if len(diff) else float("nan"), "ci": ci},
    }
