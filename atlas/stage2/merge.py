"""Cosine merging of labelled clusters into canonical concepts, stable ids, and the label tables.

Each kept cluster is embedded as ``"name: description"`` (its anchor tag if labelling failed).
A FAISS range search finds every pair with cosine >= ``threshold``; connected components of
that graph (scipy, i.e. union-find) merge transitively: A~B and B~C put A, B, C in one concept
even when A and C are below the threshold. The canonical label of a merged concept is the one
of its member cluster with the largest support.

Concept id = ``"c-" + sha256(anchor_tag)[:16]``, the anchor being the concept's most frequent
member tag (ties: the lexicographically smallest). Reruns on the same input give the same ids;
a concept keeps its id when new data leaves its most frequent tag on top.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import scipy.sparse as sp
from scipy.sparse.csgraph import connected_components

from atlas import schemas
from atlas.stage2.embed import encode, from_matrix


def concept_id(anchor_tag: str) -> str:
    return "c-" + hashlib.sha256(anchor_tag.encode("utf-8")).hexdigest()[:16]


def merge_components(emb: np.ndarray, threshold: float) -> np.ndarray:
    """Component label per row: rows linked by cosine >= threshold, transitively."""
    import faiss

    n = len(emb)
    if n == 0:
        return np.zeros(0, np.int64)
    x = np.ascontiguousarray(emb, np.float32)
    index = faiss.IndexFlatIP(x.shape[1])
    index.add(x)
    # FAISS keeps inner products strictly above the radius; the small margin makes the
    # threshold inclusive against float rounding of exactly-at-threshold pairs.
    lims, dist, nbr = index.range_search(x, float(threshold) - 1e-6)
    rows = np.repeat(np.arange(n), np.diff(lims).astype(np.int64))
    graph = sp.csr_matrix((np.ones(len(nbr), np.int8), (rows, nbr)), shape=(n, n))
    _, comp = connected_components(graph, directed=False)
    return comp.astype(np.int64)


def label_texts(clusters: pa.Table, labels: pa.Table) -> tuple[list[str | None], list[str | None], list[str | None], list[str]]:
    """Names, descriptions, label errors and merge texts of ``clusters`` rows (kept only)."""
    lab = {r["cluster_id"]: r for r in labels.to_pylist()}
    names, descs, errs, texts = [], [], [], []
    for cid, anchor in zip(clusters.column("cluster_id").to_pylist(), clusters.column("anchor_tag").to_pylist()):
        r = lab.get(cid)
        name = r["name"] if r else None
        desc = r["description"] if r else None
        err = (r["error"] if r else f"cluster {cid}: no label row") if name is None else None
        names.append(name)
        descs.append(desc)
        errs.append(err)
        texts.append(f"{name}: {desc}" if name and desc else (name or anchor))
    return names, descs, errs, texts


def build_concepts(
    clusters: pa.Table,
    labels: pa.Table,
    tag_clusters: pa.Table,
    model: str,
    threshold: float,
    embeddings: np.ndarray | None = None,
) -> tuple[pa.Table, pa.Table, dict]:
    """kept clusters + their labels -> (concepts without taxonomy, tag_concepts, stats).

    ``embeddings`` (rows aligned with the kept clusters) overrides the label embedding (tests).
    """
    kept = clusters.filter(clusters.column("kept")).sort_by("cluster_id")
    names, descs, errs, texts = label_texts(kept, labels)
    e = embeddings if embeddings is not None else encode(texts, model)
    comp = merge_components(e, threshold)
    ids = kept.column("cluster_id").to_pylist()
    support = kept.column("support").to_pylist()
    anchors = kept.column("anchor_tag").to_pylist()
    reps = kept.column("representative_tags").to_pylist()
    coh = kept.column("coherence").to_pylist()
    ntags = kept.column("n_tags").to_pylist()
    # The anchor of a merged concept is its most frequent tag: the best of its clusters' anchors.
    tc = tag_clusters
    count_of = dict(zip(tc.column("tag").to_pylist(), tc.column("n_chunks").to_pylist()))
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(comp):
        groups.setdefault(int(c), []).append(i)
    rows = []
    cluster_concept: dict[int, str] = {}
    for members in groups.values():
        canon = min(members, key=lambda i: (-support[i], ids[i]))
        anchor = min((anchors[i] for i in members), key=lambda t: (-count_of[t], t))
        cid = concept_id(anchor)
        sup = sum(support[i] for i in members)
        w = [(coh[i], support[i]) for i in members if coh[i] is not None]
        rows.append(
            dict(
                concept_id=cid,
                name=names[canon] or anchors[canon],
                description=descs[canon],
                anchor_tag=anchor,
                n_tags=sum(ntags[i] for i in members),
                support=sup,
                representative_tags=reps[canon],
                coherence=(sum(c * s for c, s in w) / sum(s for _, s in w)) if w and sum(s for _, s in w) else None,
                merged_from=sorted(ids[i] for i in members),
                merged_names=[names[i] or anchors[i] for i in sorted(members, key=lambda i: ids[i])],
                label_error=errs[canon],
                taxonomy_node=None,
                taxonomy_path=None,
                taxonomy_class=None,
                taxonomy_score=None,
                _emb=e[canon],
            )
        )
        for i in members:
            cluster_concept[ids[i]] = cid
    rows.sort(key=lambda r: r["concept_id"])
    emb = np.stack([r.pop("_emb") for r in rows]) if rows else np.zeros((0, e.shape[1] if e.ndim == 2 else 1), np.float32)
    concepts = pa.Table.from_pylist(rows, schema=schemas.CONCEPTS.remove(schemas.CONCEPTS.get_field_index("embedding")))
    concepts = concepts.append_column(schemas.CONCEPTS.field("embedding"), from_matrix(emb) if rows else pa.array([], pa.list_(pa.float32())))
    tag_concepts = map_tags(tag_clusters, clusters, cluster_concept)
    stats = {
        "clusters_kept": kept.num_rows,
        "concepts": concepts.num_rows,
        "merged_clusters": kept.num_rows - concepts.num_rows,
        "label_errors": sum(e is not None for e in errs),
    }
    return schemas.conform(concepts, schemas.CONCEPTS), tag_concepts, stats


def map_tags(tag_clusters: pa.Table, clusters: pa.Table, cluster_concept: dict[int, str]) -> pa.Table:
    """Every tag -> exactly one concept, or a drop reason (its cluster's)."""
    reason = dict(zip(clusters.column("cluster_id").to_pylist(), clusters.column("drop_reason").to_pylist()))
    cids = tag_clusters.column("cluster_id").to_pylist()
    concept = [cluster_concept.get(c) for c in cids]
    drop = [None if k is not None else (reason.get(c) or f"cluster {c} has no concept") for c, k in zip(cids, concept)]
    out = tag_clusters.append_column("concept_id", pa.array(concept, pa.string())).append_column("drop_reason", pa.array(drop, pa.string()))
    return schemas.conform(out, schemas.TAG_CONCEPTS)


def chunk_concepts(chunk_tags: pa.Table, tag_concepts: pa.Table) -> pa.Table:
    """``chunk_tags`` rows x the tag -> concept map -> one row per (chunk, concept).

    Exact per batch as long as a chunk's row is not split, which holds for any row batching.
    """
    if chunk_tags.num_rows == 0:
        return schemas.CHUNK_CONCEPTS.empty_table()
    parents = pc.list_parent_indices(chunk_tags.column("tags"))
    flat = pa.table(
        {
            "chunk_id": pc.take(chunk_tags.column("chunk_id"), parents),
            "doc_id": pc.take(chunk_tags.column("doc_id"), parents),
            "tag": pc.list_flatten(chunk_tags.column("tags")),
        }
    )
    mapping = tag_concepts.select(["tag", "concept_id"]).filter(pc.is_valid(tag_concepts.column("concept_id")))
    joined = flat.join(mapping, keys="tag", join_type="inner")
    if joined.num_rows == 0:
        return schemas.CHUNK_CONCEPTS.empty_table()
    joined = joined.sort_by([("chunk_id", "ascending"), ("concept_id", "ascending"), ("tag", "ascending")])
    g = joined.group_by(["chunk_id", "doc_id", "concept_id"], use_threads=False).aggregate([("tag", "list"), ("tag", "count")])
    out = pa.table(
        {
            "chunk_id": g.column("chunk_id"),
            "doc_id": g.column("doc_id"),
            "concept_id": g.column("concept_id"),
            "tags": g.column("tag_list"),
            "n_tags": g.column("tag_count").cast(pa.int32()),
        }
    ).sort_by([("chunk_id", "ascending"), ("concept_id", "ascending")])
    return schemas.conform(out, schemas.CHUNK_CONCEPTS)
