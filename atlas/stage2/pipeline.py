"""Stage 2's steps composed over in-memory tables (the Stage classes call the same steps).

Each ``step_*`` takes and returns Arrow tables (plus stats), so it is testable alone; row-wise
work inside (tag embedding) runs on Ray Data, global steps (k-means, merge) in the caller.
:func:`run_stage2` runs them all in order (tests, benchmarks, notebooks).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from atlas import schemas
from atlas.config import Stage2Config
from atlas.stage2 import cluster, embed, label, merge, taxonomy


def step_embed(chunk_tags: pa.Table, cfg: Stage2Config) -> tuple[pa.Table, dict]:
    """``chunk_tags`` -> ``tag_embeddings`` (unique tags with counts, embedded on Ray Data)."""
    t0 = time.perf_counter()
    ok = chunk_tags.filter(pc.is_null(chunk_tags.column("error"))) if "error" in chunk_tags.column_names else chunk_tags
    counts = embed.tag_counts(ok)
    emb = embed.embed_tags(counts, cfg.embedding_model, cfg.embed_batch_size, cfg.embed_replicas, cfg.embed_cpus, cfg.embed_device, cfg.embed_dtype)
    return emb, {"unique_tags": emb.num_rows, "model": cfg.embedding_model, "seconds": round(time.perf_counter() - t0, 3)}


def step_cluster(tag_embeddings: pa.Table, cfg: Stage2Config) -> tuple[pa.Table, pa.Table, dict]:
    """``tag_embeddings`` -> (``tag_clusters``, ``clusters`` with the coherence filter's decisions)."""
    t0 = time.perf_counter()
    tc, stats = cluster.cluster_tags(tag_embeddings, cfg)
    t1 = time.perf_counter()
    clusters = cluster.summarize(tc, tag_embeddings, cfg.min_cluster_tags, cfg.min_coherence, max(cfg.label_tags, 10))
    kept = pc.sum(clusters.column("kept").cast(pa.int64())).as_py() or 0
    stats.update(
        clusters=clusters.num_rows,
        kept=kept,
        dropped=clusters.num_rows - kept,
        cluster_seconds=round(t1 - t0, 3),
        filter_seconds=round(time.perf_counter() - t1, 3),
    )
    return tc, clusters, stats


def step_label(
    clusters: pa.Table,
    chunk_tags: pa.Table | None,
    chunks: pa.Table | None,
    labeller: label.Labeller,
    cfg: Stage2Config,
    model: str,
    chat_template=None,
    seed: int = 0,
) -> tuple[pa.Table, dict]:
    t0 = time.perf_counter()
    examples = {}
    if chunk_tags is not None and chunks is not None:
        examples = label.example_chunks(clusters, chunk_tags, chunks, cfg.label_examples, cfg.label_example_chars)
    labels = label.label_clusters(clusters, examples, labeller, cfg, model, chat_template, seed)
    errors = pc.sum(pc.is_valid(labels.column("error")).cast(pa.int64())).as_py() or 0
    cached = pc.sum(labels.column("cached").cast(pa.int64())).as_py() or 0
    return labels, {"labelled": labels.num_rows, "errors": errors, "cached": cached, "model": model, "seconds": round(time.perf_counter() - t0, 3)}


def step_concepts(
    clusters: pa.Table,
    labels: pa.Table,
    tag_clusters: pa.Table,
    chunk_tags: pa.Table,
    cfg: Stage2Config,
    picker=None,
) -> tuple[dict[str, pa.Table], dict, bytes | None]:
    """Merge, map to the taxonomy, and derive the label tables -> ({concepts, tag_concepts,
    chunk_concepts}, stats, Fig. 12 PNG or None)."""
    t0 = time.perf_counter()
    concepts, tag_concepts, stats = merge.build_concepts(clusters, labels, tag_clusters, cfg.embedding_model, cfg.merge_threshold)
    t1 = time.perf_counter()
    png = None
    if cfg.taxonomy and concepts.num_rows:
        concepts, tstats = taxonomy.map_concepts(concepts, cfg.embedding_model, cfg.taxonomy_top_k, picker)
        stats["taxonomy"] = tstats
        stats["taxonomy_classes"] = taxonomy.class_distribution(concepts)
        png = taxonomy.plot_distribution(concepts)
    t2 = time.perf_counter()
    cc = merge.chunk_concepts(chunk_tags, tag_concepts)
    dropped = pc.sum(pc.is_valid(tag_concepts.column("drop_reason")).cast(pa.int64())).as_py() or 0
    stats.update(
        tags=tag_concepts.num_rows,
        tags_dropped=dropped,
        chunk_concepts=cc.num_rows,
        chunks_labelled=len(pc.unique(cc.column("chunk_id"))) if cc.num_rows else 0,
        merge_seconds=round(t1 - t0, 3),
        taxonomy_seconds=round(t2 - t1, 3),
        chunk_concepts_seconds=round(time.perf_counter() - t2, 3),
    )
    return {"concepts": concepts, "tag_concepts": tag_concepts, "chunk_concepts": cc}, stats, png


@dataclass
class Stage2Result:
    tables: dict[str, pa.Table] = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    taxonomy_png: bytes | None = None


def run_stage2(
    chunk_tags: pa.Table,
    cfg: Stage2Config,
    labeller: label.Labeller | None,
    chunks: pa.Table | None = None,
    model: str = "labeller",
    chat_template=None,
    picker=None,
) -> Stage2Result:
    """All of Stage 2 on in-memory tables (needs an initialised Ray for the embedding step).

    ``labeller`` None skips LLM labelling: concepts are then named by their anchor tags.
    """
    res = Stage2Result()
    emb, res.stats["embed"] = step_embed(chunk_tags, cfg)
    tc, clusters, res.stats["cluster"] = step_cluster(emb, cfg)
    if labeller is not None:
        labels, res.stats["label"] = step_label(clusters, chunk_tags, chunks, labeller, cfg, model, chat_template)
    else:
        labels = schemas.CLUSTER_LABELS.empty_table()
    tables, res.stats["concepts"], res.taxonomy_png = step_concepts(clusters, labels, tc, chunk_tags, cfg, picker)
    res.tables = {"tag_embeddings": emb, "tag_clusters": tc, "clusters": clusters, "cluster_labels": labels, **tables}
    return res
