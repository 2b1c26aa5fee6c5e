"""Stage 2 on the runner's stage interface (atlas.stage: Stage / StageContext / register).

Thin wrappers: each reads its input tables from the context, calls the step functions of
:mod:`atlas.stage2.pipeline` and publishes its outputs. Stages never start Ray or touch the
manifest. Order: stage2_embed -> stage2_cluster -> [stage2_quality] -> stage2_label ->
stage2_concepts -> [stage2_judge].
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from atlas import schemas, storage
from atlas.stage2 import embed, label, pipeline, quality, taxonomy

from atlas.stage import collect, keep_rows, register


class _Stage2:
    name = ""
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()

    def enabled(self, cfg) -> bool:
        return bool(cfg.stage2.enabled)


class EmbedTags(_Stage2):
    name = "stage2_embed"
    inputs = ("chunk_tags",)
    outputs = ("tag_embeddings",)

    def run(self, ctx) -> dict:
        s2 = ctx.cfg.stage2
        counts = embed.tag_counts_ds(ctx.read("chunk_tags"))
        if counts.num_rows == 0:
            ctx.publish("tag_embeddings", schemas.TAG_EMBEDDINGS.empty_table())
            return {"unique_tags": 0, "model": s2.embedding_model}
        # Streamed from the actors into Parquet parts: the embeddings never gather on the driver.
        emb = embed.embed_tags_ds(counts, s2.embedding_model, s2.embed_batch_size, s2.embed_replicas, s2.embed_cpus, s2.embed_device, s2.embed_dtype)
        out = ctx.publish("tag_embeddings", emb, schemas.TAG_EMBEDDINGS, total=counts.num_rows)
        return {"unique_tags": out["rows"], "model": s2.embedding_model}


class ClusterTags(_Stage2):
    name = "stage2_cluster"
    inputs = ("tag_embeddings",)
    outputs = ("tag_clusters", "clusters")

    def run(self, ctx) -> dict:
        emb = embed.read_tag_embeddings(storage.table_path(ctx.root, "tag_embeddings"))
        tc, clusters, stats = pipeline.step_cluster(emb, ctx.cfg.stage2)
        ctx.publish("tag_clusters", tc, schemas.TAG_CLUSTERS)
        ctx.publish("clusters", clusters, schemas.CLUSTERS)
        return stats


class QualityReport(_Stage2):
    """Fig. 6 sweep; fails the run (after publishing the report) when a configured gate fails."""

    name = "stage2_quality"
    inputs = ("tag_embeddings",)
    outputs = ("concept_quality",)

    def enabled(self, cfg) -> bool:
        return bool(cfg.stage2.enabled and cfg.stage2.quality_report)

    def run(self, ctx) -> dict:
        s2 = ctx.cfg.stage2
        emb = embed.read_tag_embeddings(storage.table_path(ctx.root, "tag_embeddings"))
        report = quality.sweep(emb, s2.quality_models, s2.quality_ks, s2, reference_model=s2.embedding_model)
        ctx.publish("concept_quality", report, schemas.CONCEPT_QUALITY)
        storage.write_bytes_atomic(ctx.root.join("plots", "concept_quality.png"), quality.plot(report))
        quality.check_gate(report, s2)  # raises QualityGateError naming the failed bound
        return {"rows": report.num_rows}


class LabelClusters(_Stage2):
    """LLM stage: ``requests`` -> engine (cache, Ray Data actors) -> ``parse``."""

    name = "stage2_label"
    inputs = ("clusters", "chunk_tags", "chunks")
    outputs = ("cluster_labels",)

    def keeps_engines(self, cfg) -> bool:  # uses the engine
        return True

    def run(self, ctx) -> dict:
        s2 = ctx.cfg.stage2
        engine = ctx.engine(s2.label_model)
        clusters = ctx.read_table("clusters")
        chunk_tags, chunks = example_candidates(ctx, clusters, s2.label_examples)
        labeller = label.engine_labeller(engine, ctx.root, s2.cache)
        labels, stats = pipeline.step_label(clusters, chunk_tags, chunks, labeller, s2, engine.model, engine.chat_template, ctx.cfg.engine.seed)
        ctx.publish("cluster_labels", labels, schemas.CLUSTER_LABELS)
        return stats


def example_candidates(ctx, clusters: pa.Table, n: int) -> tuple[pa.Table, pa.Table]:
    """The few chunk_tags rows and chunk texts the labeller's examples come from, filtered
    inside Ray Data (``chunk_tags`` and ``chunks`` never reach the driver whole)."""
    tags_schema = pa.schema({"chunk_id": pa.string(), "tags": pa.list_(pa.string())})
    texts_schema = pa.schema({"chunk_id": pa.string(), "text": pa.string()})
    wanted = label.example_tags(clusters)
    if n <= 0 or not wanted:
        return tags_schema.empty_table(), texts_schema.empty_table()
    chunk_tags = collect(ctx.read("chunk_tags").select_columns(["chunk_id", "tags"]).map_batches(
        label.candidate_rows, fn_kwargs={"wanted": wanted, "n": n}, batch_format="pyarrow"), tags_schema)
    texts = keep_rows(ctx.read("chunks").select_columns(["chunk_id", "text"]), "chunk_id", chunk_tags.column("chunk_id").to_pylist())
    return chunk_tags, collect(texts, texts_schema)


class BuildConcepts(_Stage2):
    name = "stage2_concepts"
    inputs = ("clusters", "cluster_labels", "tag_clusters", "chunk_tags")
    outputs = ("concepts", "tag_concepts", "chunk_concepts")

    def keeps_engines(self, cfg) -> bool:  # small tables, one light map over chunk_tags; the taxonomy picker uses the engine
        return True

    def run(self, ctx) -> dict:
        from atlas.stage2 import merge

        s2 = ctx.cfg.stage2
        clusters = ctx.read_table("clusters")
        labels = ctx.read_table("cluster_labels")
        tc = ctx.read_table("tag_clusters").sort_by("tag")
        picker = None
        if s2.taxonomy and s2.taxonomy_llm_pick:
            picker = taxonomy.llm_picker(ctx.engine(s2.label_model), ctx.root, s2.cache, ctx.cfg.engine.seed)
        # chunk_concepts is row-wise over chunk_tags: done on Ray Data below, not in memory.
        empty = pa.table({"chunk_id": pa.array([], pa.string()), "doc_id": pa.array([], pa.string()), "tags": pa.array([], pa.list_(pa.string()))})
        tables, stats, png = pipeline.step_concepts(clusters, labels, tc, empty, s2, picker)
        ctx.publish("concepts", tables["concepts"], schemas.CONCEPTS)
        ctx.publish("tag_concepts", tables["tag_concepts"], schemas.TAG_CONCEPTS)
        mapping = tables["tag_concepts"].select(["tag", "concept_id"])
        cc = ctx.read("chunk_tags").select_columns(["chunk_id", "doc_id", "tags"]).map_batches(
            merge.chunk_concepts, fn_kwargs={"tag_concepts": mapping}, batch_format="pyarrow"
        )
        info = ctx.publish("chunk_concepts", cc, schemas.CHUNK_CONCEPTS)
        stats["chunk_concepts"] = (info or {}).get("rows")
        stats.pop("chunks_labelled", None)
        if png is not None:
            loc = ctx.root.join("plots", "concepts_taxonomy.png")
            storage.write_bytes_atomic(loc, png)
            stats["plot"] = loc.uri
        return stats


class JudgeConcepts(_Stage2):
    """Fig. 9: the judge rates the concepts assigned to a sample of labelled chunks, each pair
    beside the same chunk with a random unassigned concept (atlas.stage2.judge)."""

    name = "stage2_judge"
    inputs = ("chunks", "chunk_concepts", "concepts")
    outputs = ("concept_judgements", "concept_judge_by_concept", "concept_judge_by_chunk")

    def keeps_engines(self, cfg) -> bool:  # uses the engine
        return True

    def enabled(self, cfg) -> bool:
        return bool(cfg.stage2.enabled and cfg.judge.enabled and cfg.stage2.judge_chunks > 0)

    def run(self, ctx) -> dict:
        from atlas.stage1_tags import context_judge
        from atlas.stage2 import judge

        s2 = ctx.cfg.stage2
        labels = ctx.read_table("chunk_concepts", columns=["chunk_id", "concept_id"])  # the labelled sample: small by design
        concepts = ctx.read_table("concepts", columns=["concept_id", "name"])
        wanted = judge.sample_chunks(labels.column("chunk_id").to_pylist(), s2.judge_chunks, s2.seed)
        schema = pa.schema({"chunk_id": pa.string(), "text": pa.string()})
        texts = collect(keep_rows(ctx.read("chunks").select_columns(["chunk_id", "text"]), "chunk_id", wanted), schema)
        text_of = dict(zip(texts.column("chunk_id").to_pylist(), texts.column("text").to_pylist()))
        ids = [c for c in wanted if c in text_of]  # a labelled chunk missing from chunks is skipped, not rated blind
        rate, judge_name = context_judge(ctx)
        tables, summary = judge.judge_concepts(ids, [text_of[c] for c in ids], labels, concepts, rate, s2.seed)
        for name, table in tables.items():
            ctx.publish(name, table, schemas.TABLES[name])
        loc = ctx.root.join("plots", "concept_relevance.png")
        title = f"Concept relevance (judge {judge_name})"
        storage.write_bytes_atomic(loc, judge.plot(tables["concept_judge_by_chunk"], tables["concept_judge_by_concept"], title))
        d = summary["difference"]

        def num(x: float) -> float | None:  # NaN (nothing rated) is not JSON
            return None if x != x else round(x, 3)

        return {
            "chunks": len(ids), "pairs": d["pairs"], "assigned_mean": num(summary["assigned"]["mean"]),
            "control_mean": num(summary["control"]["mean"]), "difference": num(d["mean"]),
            "difference_ci": [num(x) for x in d["ci"]], "plot": loc.uri,
        }


STAGES: tuple[Any, ...] = tuple(
    register(s) for s in (EmbedTags(), ClusterTags(), QualityReport(), LabelClusters(), BuildConcepts(), JudgeConcepts())
)
