"""Held-out validation of an annotator against the teacher labels (paper Fig. 10).

Multi-label Cohen's kappa is computed over all (chunk, concept) decisions pooled: observed
agreement p_o over the n x C binary decisions, chance agreement p_e from the two raters'
overall positive rates (p_e = p_a p_t + (1 - p_a)(1 - p_t)). Per-concept kappa is reported
too (macro kappa = its mean over concepts the teacher uses). Because labels are sparse,
pooled kappa is dominated by the positives and is close to micro-F1; a random-label control
(each concept predicted at the annotator's own rate, independently of the text) shows what
the metrics read when the annotator knows nothing.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from atlas import relevance
from atlas.relevance import Judge


def _counts(pred: np.ndarray, true: np.ndarray) -> np.ndarray:
    """Per chunk: [tp, fp, fn, tn] over concepts (int64, shape (n, 4))."""
    p, t = pred.astype(bool), true.astype(bool)
    return np.stack([(p & t).sum(1), (p & ~t).sum(1), (~p & t).sum(1), (~p & ~t).sum(1)], 1).astype(np.int64)


def _f1(tp: float, fp: float, fn: float) -> float:
    d = 2 * tp + fp + fn
    return float(2 * tp / d) if d else float("nan")


def _kappa(tp: float, fp: float, fn: float, tn: float) -> float:
    n = tp + fp + fn + tn
    if n == 0:
        return float("nan")
    po = (tp + tn) / n
    pa, pt = (tp + fp) / n, (tp + fn) / n
    pe = pa * pt + (1 - pa) * (1 - pt)
    return float((po - pe) / (1 - pe)) if pe < 1 else float("nan")


def metrics(pred: np.ndarray, true: np.ndarray) -> dict[str, Any]:
    """micro/macro F1, pooled and macro kappa, per-concept precision/recall/F1/kappa."""
    pred, true = pred.astype(bool), true.astype(bool)
    c = _counts(pred, true).sum(0)
    per = []
    for j in range(true.shape[1]):
        p, t = pred[:, j], true[:, j]
        tp, fp, fn = int((p & t).sum()), int((p & ~t).sum()), int((~p & t).sum())
        tn = len(t) - tp - fp - fn
        per.append({
            "concept": j, "support": int(t.sum()), "predicted": int(p.sum()),
            "precision": tp / (tp + fp) if tp + fp else float("nan"),
            "recall": tp / (tp + fn) if tp + fn else float("nan"),
            "f1": _f1(tp, fp, fn), "kappa": _kappa(tp, fp, fn, tn),
        })
    used = [r for r in per if r["support"] > 0]
    return {
        "n_chunks": int(len(true)), "n_concepts": int(true.shape[1]), "n_decisions": int(true.size),
        "n_positive": int(true.sum()),
        "micro_f1": _f1(*c[:3]), "kappa": _kappa(*c),
        "macro_f1": float(np.mean([0.0 if np.isnan(r["f1"]) else r["f1"] for r in used])) if used else float("nan"),
        "macro_kappa": float(np.nanmean([r["kappa"] for r in used])) if used else float("nan"),
        "per_concept": per,
    }


def bootstrap_ci(pred: np.ndarray, true: np.ndarray, n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> dict[str, tuple[float, float]]:
    """Percentile CIs of micro-F1 and pooled kappa, resampling chunks with replacement."""
    counts = _counts(pred, true)
    if not len(counts):  # nothing held out
        return {"micro_f1": (float("nan"), float("nan")), "kappa": (float("nan"), float("nan"))}
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(counts), size=(n_boot, len(counts)))
    sums = counts[idx].sum(1)  # (n_boot, 4)
    f1 = np.array([_f1(*s[:3]) for s in sums])
    kp = np.array([_kappa(*s) for s in sums])
    lo, hi = (1 - level) / 2 * 100, (1 + level) / 2 * 100
    return {"micro_f1": tuple(np.nanpercentile(f1, [lo, hi]).tolist()), "kappa": tuple(np.nanpercentile(kp, [lo, hi]).tolist())}


def random_control(pred: np.ndarray, seed: int = 0) -> np.ndarray:
    """Random labels with the same per-concept positive rate as ``pred``, independent of the text."""
    rng = np.random.default_rng(seed)
    rate = pred.astype(bool).mean(0) if len(pred) else np.zeros(pred.shape[1])
    return rng.random(pred.shape) < rate[None, :]


def judge_ratings(
    texts: Sequence[str], pred: np.ndarray, concept_names: Sequence[str], judge: Judge, max_pairs: int = 500, seed: int = 0, n_boot: int = 1000
) -> dict[str, Any]:
    """Relevance ratings (1-5) of predicted concepts on held-out chunks, each pair beside the
    same chunk with a random concept the annotator did not predict for it
    (:mod:`atlas.relevance`): ``predicted``, ``random_concept`` and their paired ``difference``."""
    r = relevance.rate_with_control(texts, pred, concept_names, judge, max_pairs, seed)
    return relevance.summarise(r, n_boot, seed)


def judge_table(ratings: dict[str, Any], judge_name: str) -> str:
    """Markdown: the judge's mean rating of predicted concepts beside the random-concept control."""
    d = ratings["difference"]
    lines = [f"Judge relevance ratings (1-5) of predicted concepts on held-out chunks ({judge_name})", "",
             "| concepts | rated / pairs | mean |", "| --- | --- | --- |"]
    for label in ("predicted", "random_concept"):
        r = ratings[label]
        lines.append(f"| {label} | {r['rated']}/{r['pairs']} | {r['mean']:.3f} |")
    lo, hi = d["ci"]
    lines += ["", f"Same chunk, predicted minus random concept: {d['mean']:+.3f} [95% CI {lo:+.3f}, {hi:+.3f}] over {d['pairs']} pairs"]
    return "\n".join(lines)


def evaluate(pred: np.ndarray, true: np.ndarray, n_boot: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Metrics of ``pred`` and of the random-label control, with bootstrap CIs."""
    ctrl = random_control(pred, seed)
    return {
        "annotator": {**metrics(pred, true), "ci": bootstrap_ci(pred, true, n_boot, seed)},
        "random_control": {**metrics(ctrl, true), "ci": bootstrap_ci(ctrl, true, n_boot, seed)},
    }


def summary_table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown table: one row per annotator (and its random control)."""
    lines = ["| annotator | n chunks | micro-F1 [95% CI] | macro-F1 | kappa [95% CI] | macro kappa |", "| --- | --- | --- | --- | --- | --- |"]
    for name, res in results.items():
        for label, r in ((name, res["annotator"]), (f"{name}: random control", res["random_control"])):
            f_ci, k_ci = r["ci"]["micro_f1"], r["ci"]["kappa"]
            lines.append(
                f"| {label} | {r['n_chunks']} | {r['micro_f1']:.3f} [{f_ci[0]:.3f}, {f_ci[1]:.3f}] | {r['macro_f1']:.3f} | "
                f"{r['kappa']:.3f} [{k_ci[0]:.3f}, {k_ci[1]:.3f}] | {r['macro_kappa']:.3f} |"
            )
    return "\n".join(lines)


def per_concept_table(res: dict[str, Any], concept_names: Sequence[str]) -> str:
    lines = ["| concept | support | predicted | precision | recall | F1 | kappa |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["annotator"]["per_concept"]:
        lines.append(
            f"| {concept_names[r['concept']]} | {r['support']} | {r['predicted']} | {r['precision']:.3f} | {r['recall']:.3f} | {r['f1']:.3f} | {r['kappa']:.3f} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: str) -> str:
    """PNG: headline metrics per annotator beside its random control, per-concept P/R, and the
    judge's ratings of predicted vs random concepts where ``results[name]["judge"]`` exists."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    judged = {n: r["judge"] for n, r in results.items() if r.get("judge")}
    fig, axes = plt.subplots(1, 3 if judged else 2, figsize=(15 if judged else 11, 4.2))
    ax, ax2 = axes[0], axes[1]
    keys = ["micro_f1", "macro_f1", "kappa", "macro_kappa"]
    series = [(n, r["annotator"]) for n, r in results.items()] + [(f"{n} random", r["random_control"]) for n, r in results.items()]
    w = 0.8 / len(series)
    for k, (label, r) in enumerate(series):
        vals = [r[m] for m in keys]
        bars = ax.bar(np.arange(len(keys)) + k * w, vals, w, label=label)
        if "ci" in r:
            for b, m in zip(bars, keys):
                if m in r["ci"]:
                    lo, hi = r["ci"][m]
                    ax.plot([b.get_x() + w / 2] * 2, [lo, hi], color="black", lw=1)
    ax.set_xticks(np.arange(len(keys)) + w * (len(series) - 1) / 2, keys)
    ax.set_ylim(min(0, ax.get_ylim()[0]), 1)
    ax.set_title("held-out agreement with the teacher")
    ax.legend(fontsize=7)
    for name, r in results.items():
        pc = [c for c in r["annotator"]["per_concept"] if c["support"] > 0]
        ax2.scatter([c["recall"] for c in pc], [c["precision"] for c in pc], s=[8 + 2 * np.sqrt(c["support"]) for c in pc], alpha=0.6, label=name)
    ax2.set_xlabel("recall")
    ax2.set_ylabel("precision")
    ax2.set_xlim(-0.02, 1.02)
    ax2.set_ylim(-0.02, 1.02)
    ax2.set_title("per concept (size ~ support)")
    ax2.legend(fontsize=7)
    if judged:
        ax3 = axes[2]
        for k, (name, j) in enumerate(judged.items()):
            means = [j["predicted"]["mean"], j["random_concept"]["mean"]]
            ax3.bar(np.arange(2) + k * 0.4, means, 0.4, label=f"{name} (n={j['difference']['pairs']})")
        ax3.set_xticks(np.arange(2) + 0.2 * (len(judged) - 1), ["predicted concept", "random concept"])
        ax3.set_ylim(1, 5)
        ax3.set_ylabel("judge rating (expected, 1-5)")
        ax3.set_title("judge relevance on held-out chunks")
        ax3.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
