"""Clustering quality report (paper Fig. 6): for each embedding model and each k, the cosine
silhouette, the Davies-Bouldin index and a coherence score, as a table and a PNG.

Coherence of a cluster = mean pairwise cosine similarity of its member tags' embeddings; the
report's ``coherence`` is its mean over clusters with at least two members, measured in the
model's own space, and ``coherence_ref`` the same partition measured in the reference model's
space (MiniLM by default), so that models whose spaces differ (TF-IDF vs a sentence encoder)
are compared on one scale. Models: ``embedded:<package>`` / a local sentence-transformers
directory, or ``tfidf-svd`` (character 3-5-gram TF-IDF, truncated SVD to 128 dims, unit norm:
the baseline when no second packaged sentence encoder is available).

The optional gate (``stage2.gate_*``) fails the run when any k of the reference model is
outside the configured bounds; the report is published first, so the failure can be read.
"""

from __future__ import annotations

import io
import time

import numpy as np
import pyarrow as pa

from atlas import schemas
from atlas.stage2 import cluster
from atlas.stage2.embed import encode, to_matrix


class QualityGateError(RuntimeError):
    pass


def tfidf_svd(tags: list[str], dims: int = 128, seed: int = 0) -> np.ndarray:
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfVectorizer

    m = TfidfVectorizer(analyzer="char_wb", ngram_range=(3, 5), sublinear_tf=True).fit_transform(tags)
    d = max(1, min(dims, m.shape[1] - 1, m.shape[0] - 1))
    return cluster.normalize(TruncatedSVD(n_components=d, random_state=seed).fit_transform(m).astype(np.float32))


def embed_for(model: str, tags: list[str], emb: pa.Table | None, emb_model: str | None) -> np.ndarray:
    if model == "tfidf-svd":
        return tfidf_svd(tags)
    if emb is not None and model == emb_model:
        return to_matrix(emb.column("embedding"))
    return encode(tags, model)


def mean_coherence(x: np.ndarray, labels: np.ndarray, k: int) -> float | None:
    sums, counts = cluster.cluster_sums(x, labels, k)
    coh = cluster.coherence_from_sums(sums, counts)
    coh = coh[~np.isnan(coh)]
    return float(coh.mean()) if len(coh) else None


def evaluate(x: np.ndarray, k: int, cfg, x_ref: np.ndarray | None = None, sample: int = 2000) -> dict:
    """Fit k-means on ``x`` and score the partition."""
    from sklearn.metrics import davies_bouldin_score, silhouette_score

    t0 = time.perf_counter()
    cents = cluster.kmeans_fit(x, k, cfg.kmeans_iter, cfg.kmeans_redo, cfg.seed, cfg.kmeans_sample, cfg.kmeans_gpu)
    labels, _ = cluster.assign(x, cents)
    n_lab = len(np.unique(labels))
    sil = db = None
    if 2 <= n_lab < len(x):
        sil = float(silhouette_score(x, labels, metric="cosine", sample_size=min(sample, len(x)), random_state=cfg.seed))
        db = float(davies_bouldin_score(x, labels))
    kk = int(labels.max()) + 1
    return {
        "k": k,
        "silhouette": sil,
        "davies_bouldin": db,
        "coherence": mean_coherence(x, labels, kk),
        "coherence_ref": mean_coherence(x_ref, labels, kk) if x_ref is not None else None,
        "seconds": time.perf_counter() - t0,
    }


def sweep(emb: pa.Table, models: list[str], ks: list[int], cfg, reference_model: str) -> pa.Table:
    """The Fig. 6 table over ``models`` x ``ks`` on the tags of ``tag_embeddings``."""
    tags = emb.column("tag").to_pylist()
    x_ref = embed_for(reference_model, tags, emb, cfg.embedding_model)
    rows = []
    for model in models:
        x = x_ref if model == reference_model else embed_for(model, tags, emb, cfg.embedding_model)
        for k in ks:
            if k >= len(tags):
                continue
            r = evaluate(x, k, cfg, x_ref)
            rows.append({"embedding_model": model, "n_tags": len(tags), **r})
    return pa.Table.from_pylist(rows, schema=schemas.CONCEPT_QUALITY)


def check_gate(report: pa.Table, cfg, model: str | None = None) -> None:
    model = model or cfg.embedding_model
    bad = []
    for r in report.to_pylist():
        if r["embedding_model"] != model:
            continue
        if cfg.gate_min_silhouette is not None and (r["silhouette"] is None or r["silhouette"] < cfg.gate_min_silhouette):
            bad.append(f"k={r['k']}: silhouette {r['silhouette']} < stage2.gate_min_silhouette={cfg.gate_min_silhouette}")
        if cfg.gate_max_davies_bouldin is not None and (r["davies_bouldin"] is None or r["davies_bouldin"] > cfg.gate_max_davies_bouldin):
            bad.append(f"k={r['k']}: Davies-Bouldin {r['davies_bouldin']} > stage2.gate_max_davies_bouldin={cfg.gate_max_davies_bouldin}")
        if cfg.gate_min_coherence is not None and (r["coherence"] is None or r["coherence"] < cfg.gate_min_coherence):
            bad.append(f"k={r['k']}: coherence {r['coherence']} < stage2.gate_min_coherence={cfg.gate_min_coherence}")
    if bad:
        raise QualityGateError(f"Stage 2 quality gate failed for {model}: " + "; ".join(bad))


def plot(report: pa.Table) -> bytes:
    """Silhouette, Davies-Bouldin and coherence vs k, one line per model -> PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report.to_pylist()
    models = sorted({r["embedding_model"] for r in rows})
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6), constrained_layout=True)
    for ax, metric, title in zip(
        axes,
        ("silhouette", "davies_bouldin", "coherence", "coherence_ref"),
        ("Silhouette (higher better)", "Davies-Bouldin (lower better)", "Coherence, own space", "Coherence, reference space"),
    ):
        for m in models:
            pts = sorted((r["k"], r[metric]) for r in rows if r["embedding_model"] == m and r[metric] is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m.replace("embedded:", ""))
        ks = sorted({r["k"] for r in rows})
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("k")
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Stage 2 clustering quality (n={rows[0]['n_tags'] if rows else 0} tags)")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()
