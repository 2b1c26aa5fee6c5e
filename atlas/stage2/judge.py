"""Fig. 9: judge relevance ratings of the concepts the library assigns to chunks.

A sample of labelled chunks; every (chunk, assigned concept) pair of it is rated by the judge
beside the same chunk with a random concept not assigned to it (:mod:`atlas.relevance`), so a
library whose concepts fit their chunks shows assigned above control, per chunk and per concept.
"""

from __future__ import annotations

import io
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from atlas import relevance, schemas


def sample_chunks(chunk_ids: Sequence[str], n: int, seed: int) -> list[str]:
    """Up to ``n`` distinct chunk ids, a deterministic sample."""
    ids = sorted(set(chunk_ids))
    if len(ids) <= n:
        return ids
    rng = np.random.default_rng(seed)
    return sorted(ids[i] for i in rng.choice(len(ids), n, replace=False))


def judge_concepts(
    chunk_ids: Sequence[str], texts: Sequence[str], labels: pa.Table, concepts: pa.Table, judge: relevance.Judge, seed: int = 0
) -> tuple[dict[str, pa.Table], dict[str, Any]]:
    """Rate every (chunk, concept) pair of ``labels`` (chunk_id, concept_id) over the given
    chunks, each beside its control. Returns the three tables and the summary."""
    concept_ids = concepts.column("concept_id").to_pylist()
    names = [n or c for c, n in zip(concept_ids, concepts.column("name").to_pylist())]
    col = {c: j for j, c in enumerate(concept_ids)}
    row = {c: i for i, c in enumerate(chunk_ids)}
    assigned = np.zeros((len(chunk_ids), len(concept_ids)), dtype=bool)
    for c, k in zip(labels.column("chunk_id").to_pylist(), labels.column("concept_id").to_pylist()):
        if c in row and k in col:
            assigned[row[c], col[k]] = True
    r = relevance.rate_with_control(texts, assigned, names, judge, max_pairs=int(assigned.sum()), seed=seed)
    n = len(r.pairs)
    judgements = schemas.conform(pa.table({
        "pair": pa.array(list(range(n)) * 2, pa.int32()),
        "chunk_id": [chunk_ids[i] for i, _ in r.pairs + r.control],
        "concept_id": [concept_ids[j] for _, j in r.pairs + r.control],
        "kind": ["assigned"] * n + ["control"] * n,
        "expected_score": pa.array(r.scores + r.control_scores, pa.float64()),
    }), schemas.CONCEPT_JUDGEMENTS)

    def means(keys: list, scores: list) -> dict:
        acc: dict = {}
        for k, s in zip(keys, scores):
            if s is not None:
                acc.setdefault(k, []).append(s)
        return {k: (len(v), float(np.mean(v))) for k, v in acc.items()}

    per_concept = means([j for _, j in r.pairs], r.scores)
    per_concept_ctrl = means([j for _, j in r.control], r.control_scores)
    rated = sorted(set(per_concept) | set(per_concept_ctrl))
    by_concept = schemas.conform(pa.table({
        "concept_id": [concept_ids[j] for j in rated], "name": [names[j] for j in rated],
        "n_assigned": pa.array([per_concept.get(j, (0, None))[0] for j in rated], pa.int32()),
        "mean_assigned": pa.array([per_concept.get(j, (0, None))[1] for j in rated], pa.float64()),
        "n_control": pa.array([per_concept_ctrl.get(j, (0, None))[0] for j in rated], pa.int32()),
        "mean_control": pa.array([per_concept_ctrl.get(j, (0, None))[1] for j in rated], pa.float64()),
    }), schemas.CONCEPT_JUDGE_BY_CONCEPT)
    per_chunk = means([i for i, _ in r.pairs], r.scores)
    per_chunk_ctrl = means([i for i, _ in r.control], r.control_scores)
    chunks = sorted({i for i, _ in r.pairs})
    by_chunk = schemas.conform(pa.table({
        "chunk_id": [chunk_ids[i] for i in chunks],
        "n_concepts": pa.array([per_chunk.get(i, (0, None))[0] for i in chunks], pa.int32()),
        "mean_assigned": pa.array([per_chunk.get(i, (0, None))[1] for i in chunks], pa.float64()),
        "mean_control": pa.array([per_chunk_ctrl.get(i, (0, None))[1] for i in chunks], pa.float64()),
    }), schemas.CONCEPT_JUDGE_BY_CHUNK)
    summary = relevance.summarise(r, seed=seed, labels=("assigned", "control"))
    tables = {"concept_judgements": judgements, "concept_judge_by_concept": by_concept, "concept_judge_by_chunk": by_chunk}
    return tables, summary


def plot(by_chunk: pa.Table, by_concept: pa.Table, title: str) -> bytes:
    """Fig. 9 style: per-chunk and per-concept mean ratings, assigned concepts against their
    random-concept controls -> PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = np.linspace(1, 5, 17)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), constrained_layout=True)
    for ax, t, what in ((axes[0], by_chunk, "chunk"), (axes[1], by_concept, "concept")):
        for col, label, color in (("mean_assigned", "assigned", "#4C72B0"), ("mean_control", "random concept (control)", "#BBBBBB")):
            v = t.column(col).drop_null().to_numpy(zero_copy_only=False).astype(float)
            ax.hist(v, bins=bins, alpha=0.75, color=color, label=f"{label} (n={len(v)}, mean {v.mean() if len(v) else float('nan'):.2f})")
        ax.set_title(f"Mean relevance per {what}")
        ax.set_xlabel("judge's expected score (1-5)")
        ax.set_ylabel(f"{what}s")
        ax.set_xlim(1, 5)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()
