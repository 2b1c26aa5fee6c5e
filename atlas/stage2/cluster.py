"""Clustering of tag embeddings and coherence filtering.

* :func:`kmeans_fit` - FAISS spherical k-means fit on a deterministic sample (GPU when asked),
  :func:`assign` - every tag to its nearest centroid (inner product = cosine on unit vectors).
* :func:`hdbscan_labels` - HDBSCAN alternative (noise tags get cluster -1 and are dropped).
* :func:`summarize` - per cluster: centroid, anchor tag, representative tags, coherence, and
  the keep / drop decision with its reason. Nothing is dropped silently: a dropped cluster
  keeps its row with ``kept = false`` and ``drop_reason`` naming the score and the bound.

Coherence of a cluster = mean pairwise cosine of its member embeddings, computed exactly as
``(|sum v|^2 - n) / (n (n - 1))`` for unit vectors (O(n d), no pairwise matrix).
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import scipy.sparse as sp

from atlas import schemas
from atlas.stage2.embed import from_matrix, to_matrix


def normalize(x: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(x, axis=1, keepdims=True)
    return (x / np.maximum(n, 1e-12)).astype(np.float32, copy=False)


def choose_k(n_tags: int, k: int | None, tags_per_cluster: int) -> int:
    want = k if k is not None else math.ceil(n_tags / tags_per_cluster)
    return max(1, min(want, n_tags))


def sample_indices(n: int, size: int, seed: int) -> np.ndarray:
    """A deterministic sample (sorted indices) of ``size`` rows out of ``n``."""
    if n <= size:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size, replace=False))


def kmeans_fit(x: np.ndarray, k: int, niter: int = 20, nredo: int = 1, seed: int = 0, sample: int = 200_000, gpu: bool = False) -> np.ndarray:
    """Spherical k-means centroids (k, d), fit on at most ``sample`` rows of ``x``."""
    import faiss
    from sklearn.cluster import kmeans_plusplus

    x = np.ascontiguousarray(x, np.float32)
    idx = sample_indices(len(x), sample, seed)
    train = x[idx] if len(idx) < len(x) else x
    k = min(k, len(train))
    # k-means++ seeding (scikit-learn's, on a subsample) instead of FAISS's random seeding:
    # random seeds often split one well-separated group and fuse two others. ``nredo``
    # restarts from different seedings keep the best objective (sum of member-centroid cosines).
    init_n = min(len(train), max(20 * k, 10_000))
    best, best_obj = None, -np.inf
    for r in range(nredo):
        init_x = train[sample_indices(len(train), init_n, seed + 1 + r)]
        init, _ = kmeans_plusplus(init_x, k, random_state=seed + r)
        km = faiss.Kmeans(
            x.shape[1], k, niter=niter, seed=seed + r, spherical=True, gpu=gpu, verbose=False,
            # We already sampled; let FAISS use all of it instead of subsampling again.
            max_points_per_centroid=max(256, -(-len(train) // k)),
            # Small tag sets (a few per cluster) are expected; FAISS would print a warning per fit.
            min_points_per_centroid=1,
        )
        km.train(train, init_centroids=normalize(init))
        obj = float(km.obj[-1]) if len(km.obj) else 0.0
        if obj > best_obj:
            best, best_obj = km.centroids, obj
    return normalize(best)


def assign(x: np.ndarray, centroids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nearest centroid of every row -> (labels int32, cosine float32)."""
    import faiss

    index = faiss.IndexFlatIP(centroids.shape[1])
    index.add(np.ascontiguousarray(centroids, np.float32))
    sims, labels = index.search(np.ascontiguousarray(x, np.float32), 1)
    return labels[:, 0].astype(np.int32), sims[:, 0].astype(np.float32)


def hdbscan_labels(x: np.ndarray, min_cluster_size: int = 5) -> np.ndarray:
    import hdbscan

    # Euclidean distance on unit vectors is a monotone function of cosine distance.
    return hdbscan.HDBSCAN(min_cluster_size=min_cluster_size, metric="euclidean", core_dist_n_jobs=1).fit_predict(x).astype(np.int32)


def cluster_sums(x: np.ndarray, labels: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-cluster sum of member vectors (k, d) and member counts (k,) for labels in [0, k)."""
    n = len(labels)
    m = sp.csr_matrix((np.ones(n, np.float32), (labels, np.arange(n))), shape=(k, n))
    return np.asarray(m @ x, np.float32), np.asarray(m.sum(axis=1)).ravel().astype(np.int64)


def coherence_from_sums(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Mean pairwise cosine per cluster (NaN where a cluster has < 2 members)."""
    sq = np.einsum("ij,ij->i", sums.astype(np.float64), sums.astype(np.float64))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts >= 2, (sq - counts) / (counts * (counts - 1.0)), np.nan)


def cluster_tags(emb: pa.Table, cfg) -> tuple[pa.Table, dict]:
    """``tag_embeddings`` -> ``tag_clusters`` with the configured algorithm (``cfg``: Stage2Config)."""
    x = to_matrix(emb.column("embedding"))
    n = emb.num_rows
    stats: dict = {"tags": n, "algorithm": cfg.algorithm}
    if cfg.algorithm == "hdbscan":
        labels = hdbscan_labels(x, cfg.hdbscan_min_cluster_size)
        k = int(labels.max()) + 1 if n else 0
        ok = labels >= 0
        sums, _ = cluster_sums(x[ok], labels[ok], max(k, 1))
        cents = normalize(sums)
        sims = np.zeros(n, np.float32)  # noise tags have no centroid
        sims[ok] = np.einsum("ij,ij->i", x[ok], cents[labels[ok]])
    else:
        k = choose_k(n, cfg.k, cfg.tags_per_cluster)
        cents = kmeans_fit(x, k, cfg.kmeans_iter, cfg.kmeans_redo, cfg.seed, cfg.kmeans_sample, cfg.kmeans_gpu)
        labels, sims = assign(x, cents)
    stats["k"] = int(k)
    out = pa.table(
        {
            "tag": emb.column("tag"),
            "n_chunks": emb.column("n_chunks"),
            "cluster_id": pa.array(labels, pa.int32()),
            "similarity": pa.array(sims, pa.float32()),
        }
    )
    return schemas.conform(out, schemas.TAG_CLUSTERS), stats


def summarize(tag_clusters: pa.Table, emb: pa.Table, min_tags: int, min_coherence: float, n_rep: int = 10) -> pa.Table:
    """One ``clusters`` row per non-empty cluster, with the coherence filter's decision.

    ``tag_clusters`` and ``emb`` must be row-aligned (both sorted by tag, as the steps make them).
    """
    labels = tag_clusters.column("cluster_id").to_numpy()
    x = to_matrix(emb.column("embedding"))
    tags = np.asarray(tag_clusters.column("tag").to_pylist(), dtype=object)
    counts_chunks = tag_clusters.column("n_chunks").to_numpy()
    sims = tag_clusters.column("similarity").to_numpy()
    noise = labels < 0
    ids = np.unique(labels)
    remap = {int(c): i for i, c in enumerate(ids)}
    dense = np.array([remap[int(c)] for c in labels], np.int64) if len(labels) else np.zeros(0, np.int64)
    sums, n_members = cluster_sums(x, dense, len(ids)) if len(ids) else (np.zeros((0, x.shape[1] if x.size else 1), np.float32), np.zeros(0, np.int64))
    coh = coherence_from_sums(sums, n_members)
    cents = normalize(sums) if len(ids) else sums
    # Group rows by cluster: sort by (cluster, -similarity, tag) once, then slice.
    rank = np.empty(len(tags), np.int64)
    rank[np.argsort(tags, kind="stable")] = np.arange(len(tags))
    order = np.lexsort((rank, -sims, dense)) if len(labels) else np.zeros(0, np.int64)
    bounds = np.searchsorted(dense[order], np.arange(len(ids) + 1))
    rows = {k: [] for k in ("cluster_id", "n_tags", "support", "anchor_tag", "representative_tags", "coherence", "kept", "drop_reason")}
    for i, cid in enumerate(ids):
        members = order[bounds[i] : bounds[i + 1]]
        mtags = tags[members]
        mcounts = counts_chunks[members]
        # Anchor: most frequent member (ties: smallest tag) -> defines the concept id later.
        best = min(range(len(members)), key=lambda j: (-int(mcounts[j]), int(rank[members[j]])))
        c = None if math.isnan(coh[i]) else float(coh[i])
        if cid < 0 and noise.any():
            reason = f"noise: HDBSCAN left these {len(members)} tag(s) unclustered"
        elif len(members) < min_tags:
            reason = f"too_small: {len(members)} tag(s) < stage2.min_cluster_tags={min_tags}"
        elif c is not None and c < min_coherence:
            reason = f"low_coherence: mean pairwise cosine {c:.3f} < stage2.min_coherence={min_coherence}"
        else:
            reason = None
        rows["cluster_id"].append(int(cid))
        rows["n_tags"].append(len(members))
        rows["support"].append(int(mcounts.sum()))
        rows["anchor_tag"].append(str(mtags[best]))
        rows["representative_tags"].append([str(t) for t in mtags[:n_rep]])
        rows["coherence"].append(c)
        rows["kept"].append(reason is None)
        rows["drop_reason"].append(reason)
    out = pa.table(
        {
            "cluster_id": pa.array(rows["cluster_id"], pa.int32()),
            "n_tags": pa.array(rows["n_tags"], pa.int32()),
            "support": pa.array(rows["support"], pa.int64()),
            "anchor_tag": pa.array(rows["anchor_tag"], pa.string()),
            "representative_tags": pa.array(rows["representative_tags"], pa.list_(pa.string())),
            "coherence": pa.array(rows["coherence"], pa.float64()),
            "kept": pa.array(rows["kept"], pa.bool_()),
            "drop_reason": pa.array(rows["drop_reason"], pa.string()),
            "centroid": from_matrix(cents) if len(ids) else pa.array([], pa.list_(pa.float32())),
        }
    )
    return schemas.conform(out, schemas.CLUSTERS)

