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
import pyarrow.compute as pc

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

    assigned_rows = _rated(judgements, "assigned")
    control_rows = _rated(judgements, "control")
    by_chunk = assigned_rows("chunk_id").join(control_rows("chunk_id"), "chunk_id", join_type="left outer")
    by_chunk = schemas.conform(by_chunk.rename_columns({"n_assigned": "n_concepts"}).sort_by("chunk_id"), schemas.CONCEPT_JUDGE_BY_CHUNK)
    by_concept = assigned_rows("concept_id").join(control_rows("concept_id"), "concept_id", join_type="full outer")
    by_concept = by_concept.join(pa.table({"concept_id": concept_ids, "name": names}), "concept_id")
    for n in ("n_assigned", "n_control"):  # a concept seen only as one kind has 0 of the other
        by_concept = by_concept.set_column(by_concept.schema.get_field_index(n), n, pc.fill_null(by_concept[n], 0))
    by_concept = by_concept.filter(pc.greater(pc.add(by_concept["n_assigned"], by_concept["n_control"]), 0))
    by_concept = schemas.conform(by_concept.sort_by("concept_id"), schemas.CONCEPT_JUDGE_BY_CONCEPT)
    summary = relevance.summarise(r, seed=seed, labels=("assigned", "control"))
    tables = {"concept_judgements": judgements, "concept_judge_by_concept": by_concept, "concept_judge_by_chunk": by_chunk}
    return tables, summary


def _rated(judgements: pa.Table, kind: str):
    """key -> (key, n_<kind>, mean_<kind>) over the judgements of one kind (n counts rated rows)."""
    rows = judgements.filter(pc.equal(judgements["kind"], kind))

    def by(key: str) -> pa.Table:
        g = rows.group_by(key).aggregate([("expected_score", "count"), ("expected_score", "mean")])
        return pa.table({key: g[key], f"n_{kind}": g["expected_score_count"].cast(pa.int32()), f"mean_{kind}": g["expected_score_mean"]})

    return by


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
