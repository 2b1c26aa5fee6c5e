"""Arrow schemas of every table Atlas writes, in one place.

Stages only talk through these tables. ``describe()`` renders them as Markdown (the
documentation in docs/tables.md is generated from it: ``atlas schemas``).
"""

from __future__ import annotations

import pyarrow as pa

DOCUMENTS = pa.schema(
    [
        pa.field("doc_id", pa.string(), nullable=False, metadata={"doc": "stable id: sha256(source path + record key)[:20]"}),
        pa.field("source", pa.string(), nullable=False, metadata={"doc": "URI of the file the record came from"}),
        pa.field("record", pa.string(), nullable=False, metadata={"doc": "record key inside the source (line / row / 'file')"}),
        pa.field("source_id", pa.string(), metadata={"doc": "the record's own id field, if any"}),
        pa.field("title", pa.string(), metadata={"doc": "first line / title field, if any"}),
        pa.field("text", pa.string(), nullable=False),
        pa.field("n_chars", pa.int64(), nullable=False),
    ]
)

QUARANTINE = pa.schema(
    [
        pa.field("stage", pa.string(), nullable=False, metadata={"doc": "stage that rejected the record"}),
        pa.field("source", pa.string(), nullable=False),
        pa.field("record", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False, metadata={"doc": "empty | undecodable | oversized | malformed | wrong_schema | ..."}),
        pa.field("detail", pa.string(), nullable=False, metadata={"doc": "human-readable explanation"}),
        pa.field("snippet", pa.string(), metadata={"doc": "first bytes of the record, escaped"}),
    ]
)

CHUNKS = pa.schema(
    [
        pa.field("chunk_id", pa.string(), nullable=False, metadata={"doc": "<doc_id>-<chunk_index:05d>"}),
        pa.field("doc_id", pa.string(), nullable=False),
        pa.field("chunk_index", pa.int32(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("n_tokens", pa.int32(), nullable=False, metadata={"doc": "tokens under the chunking tokenizer"}),
        pa.field("char_start", pa.int64(), nullable=False),
        pa.field("char_end", pa.int64(), nullable=False),
    ]
)

CHUNK_TAGS = pa.schema(
    [
        pa.field("chunk_id", pa.string(), nullable=False),
        pa.field("doc_id", pa.string(), nullable=False),
        pa.field("tags", pa.list_(pa.string()), nullable=False, metadata={"doc": "normalised, deduplicated topical tags"}),
        pa.field("raw_output", pa.string(), metadata={"doc": "the model's raw text"}),
        pa.field("error", pa.string(), metadata={"doc": "null on success, else why this row has no tags"}),
        pa.field("model", pa.string(), nullable=False),
        pa.field("request_hash", pa.string(), nullable=False, metadata={"doc": "cache key of the generation request"}),
        pa.field("output_tokens", pa.int32()),
        pa.field("cached", pa.bool_(), nullable=False, metadata={"doc": "true if the generation came from the cache"}),
    ]
)

TAG_JUDGEMENTS = pa.schema(
    [
        pa.field("chunk_id", pa.string(), nullable=False),
        pa.field("tag", pa.string(), nullable=False),
        pa.field(
            "expected_score", pa.float64(),
            metadata={"doc": "relevance 1-5: sum of k * P(k) over the judge's probabilities of the answers 1..5; null if unusable"},
        ),
        pa.field("score", pa.int8(), metadata={"doc": "the judge's most probable answer 1-5; null if the judge output was unusable"}),
        pa.field("answer_probs", pa.list_(pa.float32()), metadata={"doc": "P(1), ..., P(5), renormalised over the five answers"}),
        pa.field("choice_mass", pa.float32(), metadata={"doc": "raw next-token probability the judge put on the five answers"}),
        pa.field("raw_output", pa.string(), metadata={"doc": "the scoring result as JSON (probabilities and mass)"}),
        pa.field("error", pa.string()),
        pa.field("model", pa.string(), nullable=False),
    ]
)

TAG_JUDGE_BY_CHUNK = pa.schema(
    [
        pa.field("chunk_id", pa.string(), nullable=False),
        pa.field("n_tags", pa.int32(), nullable=False),
        pa.field("mean_score", pa.float64(), metadata={"doc": "mean expected score of the chunk's tags"}),
    ]
)

TAG_JUDGE_BY_TAG = pa.schema(
    [
        pa.field("tag", pa.string(), nullable=False),
        pa.field("n_chunks", pa.int32(), nullable=False),
        pa.field("mean_score", pa.float64(), metadata={"doc": "mean expected score of the tag over its chunks"}),
    ]
)

# ---------------------------------------------------------------- Stage 2 (tags -> concepts)
# Concept ids: "c-" + sha256(anchor tag)[:16], where the anchor is the concept's most frequent
# member tag (ties: the lexicographically smallest). A rerun on the same input gives the same
# ids; a concept whose anchor tag stays its most frequent tag keeps its id when data is added
# (new tags joining it, or other concepts changing, do not move it).

TAG_EMBEDDINGS = pa.schema(
    [
        pa.field("tag", pa.string(), nullable=False, metadata={"doc": "normalised tag (unique)"}),
        pa.field("n_chunks", pa.int64(), nullable=False, metadata={"doc": "chunks carrying the tag"}),
        pa.field("embedding", pa.list_(pa.float32()), nullable=False, metadata={"doc": "unit-norm sentence embedding (stage2.embedding_model)"}),
    ]
)

TAG_CLUSTERS = pa.schema(
    [
        pa.field("tag", pa.string(), nullable=False),
        pa.field("n_chunks", pa.int64(), nullable=False),
        pa.field("cluster_id", pa.int32(), nullable=False, metadata={"doc": "k-means / HDBSCAN cluster (-1: HDBSCAN noise)"}),
        pa.field("similarity", pa.float32(), nullable=False, metadata={"doc": "cosine to the cluster centroid"}),
    ]
)

CLUSTERS = pa.schema(
    [
        pa.field("cluster_id", pa.int32(), nullable=False),
        pa.field("n_tags", pa.int32(), nullable=False),
        pa.field("support", pa.int64(), nullable=False, metadata={"doc": "sum of member tags' n_chunks"}),
        pa.field("anchor_tag", pa.string(), nullable=False, metadata={"doc": "most frequent member tag (ties: smallest)"}),
        pa.field("representative_tags", pa.list_(pa.string()), nullable=False, metadata={"doc": "members nearest the centroid, best first"}),
        pa.field("coherence", pa.float64(), metadata={"doc": "mean pairwise cosine of members (null for one member)"}),
        pa.field("kept", pa.bool_(), nullable=False, metadata={"doc": "survived coherence filtering"}),
        pa.field("drop_reason", pa.string(), metadata={"doc": "null if kept, else why the cluster was dropped (with its score)"}),
        pa.field("centroid", pa.list_(pa.float32()), nullable=False, metadata={"doc": "unit-norm mean of member embeddings"}),
    ]
)

CLUSTER_LABELS = pa.schema(
    [
        pa.field("cluster_id", pa.int32(), nullable=False),
        pa.field("name", pa.string(), metadata={"doc": "concept name (null if labelling failed)"}),
        pa.field("description", pa.string(), metadata={"doc": "one-sentence description"}),
        pa.field("raw_output", pa.string()),
        pa.field("error", pa.string(), metadata={"doc": "null on success, else why the cluster has no label"}),
        pa.field("model", pa.string(), nullable=False),
        pa.field("request_hash", pa.string(), metadata={"doc": "cache key of the generation request"}),
        pa.field("cached", pa.bool_(), nullable=False),
    ]
)

CONCEPTS = pa.schema(
    [
        pa.field("concept_id", pa.string(), nullable=False, metadata={"doc": "stable id: 'c-' + sha256(anchor_tag)[:16]"}),
        pa.field("name", pa.string(), nullable=False, metadata={"doc": "LLM label (the anchor tag if labelling failed)"}),
        pa.field("description", pa.string(), metadata={"doc": "one-sentence LLM description"}),
        pa.field("anchor_tag", pa.string(), nullable=False, metadata={"doc": "most frequent member tag; defines the id"}),
        pa.field("n_tags", pa.int32(), nullable=False),
        pa.field("support", pa.int64(), nullable=False, metadata={"doc": "sum of member tags' n_chunks"}),
        pa.field("representative_tags", pa.list_(pa.string()), nullable=False),
        pa.field("coherence", pa.float64(), metadata={"doc": "support-weighted coherence of the merged clusters"}),
        pa.field("merged_from", pa.list_(pa.int32()), nullable=False, metadata={"doc": "cluster ids merged into this concept"}),
        pa.field("merged_names", pa.list_(pa.string()), nullable=False, metadata={"doc": "labels of the merged clusters"}),
        pa.field("label_error", pa.string(), metadata={"doc": "why the LLM label is missing, if it is"}),
        pa.field("taxonomy_node", pa.string(), metadata={"doc": "LCC outline node id, e.g. QA150-272.5"}),
        pa.field("taxonomy_path", pa.list_(pa.string()), metadata={"doc": "class > subclass > ... > node captions"}),
        pa.field("taxonomy_class", pa.string(), metadata={"doc": "top-level LCC class letter (A..Z)"}),
        pa.field("taxonomy_score", pa.float32(), metadata={"doc": "cosine of the concept to the node label"}),
        pa.field("embedding", pa.list_(pa.float32()), nullable=False, metadata={"doc": "unit-norm embedding of 'name: description'"}),
    ]
)

TAG_CONCEPTS = pa.schema(
    [
        pa.field("tag", pa.string(), nullable=False),
        pa.field("n_chunks", pa.int64(), nullable=False),
        pa.field("cluster_id", pa.int32(), nullable=False),
        pa.field("concept_id", pa.string(), metadata={"doc": "null iff the tag was dropped"}),
        pa.field("similarity", pa.float32(), nullable=False, metadata={"doc": "cosine to its cluster centroid"}),
        pa.field("drop_reason", pa.string(), metadata={"doc": "null iff the tag maps to a concept"}),
    ]
)

CHUNK_CONCEPTS = pa.schema(
    [
        pa.field("chunk_id", pa.string(), nullable=False),
        pa.field("doc_id", pa.string(), nullable=False),
        pa.field("concept_id", pa.string(), nullable=False),
        pa.field("tags", pa.list_(pa.string()), nullable=False, metadata={"doc": "the chunk's tags that map to the concept"}),
        pa.field("n_tags", pa.int32(), nullable=False),
    ]
)

CONCEPT_QUALITY = pa.schema(
    [
        pa.field("embedding_model", pa.string(), nullable=False),
        pa.field("k", pa.int32(), nullable=False),
        pa.field("n_tags", pa.int64(), nullable=False),
        pa.field("silhouette", pa.float64(), metadata={"doc": "cosine silhouette on a sample of tags"}),
        pa.field("davies_bouldin", pa.float64(), metadata={"doc": "Davies-Bouldin index (lower is better)"}),
        pa.field("coherence", pa.float64(), metadata={"doc": "mean over clusters of the members' mean pairwise cosine (docs/stage2.md)"}),
        pa.field("coherence_ref", pa.float64(), metadata={"doc": "coherence measured in the reference MiniLM space (comparable across models)"}),
        pa.field("seconds", pa.float64(), nullable=False),
    ]
)

ANNOTATIONS = pa.schema(
    [
        pa.field("chunk_id", pa.string(), nullable=False, metadata={"doc": "<doc_id>-<chunk_index:05d>: sorting by it restores document order"}),
        pa.field("doc_id", pa.string(), nullable=False),
        pa.field("chunk_index", pa.int32(), nullable=False, metadata={"doc": "position of the chunk in its document"}),
        pa.field("source", pa.string(), nullable=False, metadata={"doc": "corpus source (e.g. wikipedia, arxiv, code): the unit of training-data mixtures"}),
        pa.field("text", pa.string(), nullable=False),
        pa.field("concept_ids", pa.list_(pa.int32()), nullable=False, metadata={"doc": "concepts present in the chunk (may be empty): int32 index into the library's concepts sorted by concept_id"}),
        pa.field("concept_scores", pa.list_(pa.float32()), nullable=False, metadata={"doc": "annotator confidence per concept id, same order and length"}),
        pa.field("annotator", pa.string(), nullable=False, metadata={"doc": "model that produced the labels"}),
        pa.field("library_version", pa.string(), nullable=False, metadata={"doc": "version of the concept library the ids refer to"}),
    ]
)

ANNOTATION_CONCEPTS = pa.schema(
    [
        pa.field("chunk_id", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("concept_id", pa.int32(), nullable=False, metadata={"doc": "as annotations.concept_ids: index into the library's concepts sorted by concept_id"}),
        pa.field("score", pa.float32(), nullable=False, metadata={"doc": "annotator confidence"}),
    ]
)

CONCEPT_JUDGEMENTS = pa.schema(
    [
        pa.field("pair", pa.int32(), nullable=False, metadata={"doc": "an assigned (chunk, concept) pair and its control share this number"}),
        pa.field("chunk_id", pa.string(), nullable=False),
        pa.field("concept_id", pa.string(), nullable=False),
        pa.field("kind", pa.string(), nullable=False, metadata={"doc": "assigned (chunk_concepts) or control (same chunk, a random concept not assigned to it)"}),
        pa.field("expected_score", pa.float64(), metadata={"doc": "judge's expected relevance 1-5; null when unscored"}),
    ]
)

CONCEPT_JUDGE_BY_CONCEPT = pa.schema(
    [
        pa.field("concept_id", pa.string(), nullable=False),
        pa.field("name", pa.string()),
        pa.field("n_assigned", pa.int32(), nullable=False, metadata={"doc": "rated chunks the concept is assigned to"}),
        pa.field("mean_assigned", pa.float64(), metadata={"doc": "mean expected score on those chunks"}),
        pa.field("n_control", pa.int32(), nullable=False, metadata={"doc": "rated chunks where the concept was the random control"}),
        pa.field("mean_control", pa.float64()),
    ]
)

CONCEPT_JUDGE_BY_CHUNK = pa.schema(
    [
        pa.field("chunk_id", pa.string(), nullable=False),
        pa.field("n_concepts", pa.int32(), nullable=False, metadata={"doc": "assigned concepts rated"}),
        pa.field("mean_assigned", pa.float64(), metadata={"doc": "mean expected score of the chunk's assigned concepts"}),
        pa.field("mean_control", pa.float64(), metadata={"doc": "mean expected score of their random controls"}),
    ]
)

TABLES: dict[str, pa.Schema] = {
    "documents": DOCUMENTS,
    "quarantine": QUARANTINE,
    "chunks": CHUNKS,
    "chunk_tags": CHUNK_TAGS,
    "tag_judgements": TAG_JUDGEMENTS,
    "tag_judge_by_chunk": TAG_JUDGE_BY_CHUNK,
    "tag_judge_by_tag": TAG_JUDGE_BY_TAG,
    "annotations": ANNOTATIONS,
    "annotation_concepts": ANNOTATION_CONCEPTS,
    "tag_embeddings": TAG_EMBEDDINGS,
    "tag_clusters": TAG_CLUSTERS,
    "clusters": CLUSTERS,
    "cluster_labels": CLUSTER_LABELS,
    "concepts": CONCEPTS,
    "tag_concepts": TAG_CONCEPTS,
    "chunk_concepts": CHUNK_CONCEPTS,
    "concept_quality": CONCEPT_QUALITY,
    "concept_judgements": CONCEPT_JUDGEMENTS,
    "concept_judge_by_concept": CONCEPT_JUDGE_BY_CONCEPT,
    "concept_judge_by_chunk": CONCEPT_JUDGE_BY_CHUNK,
}


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Select and cast ``table``'s columns to ``schema`` (raises naming a missing column)."""
    missing = [f.name for f in schema if f.name not in table.column_names]
    if missing:
        raise ValueError(f"table lacks column(s) {missing} required by the schema")
    return table.select(schema.names).cast(schema)


def describe() -> str:
    out = ["# Atlas tables", "", "Generated from `atlas/schemas.py` (`atlas schemas`).", ""]
    for name, schema in TABLES.items():
        out += [f"## {name}", "", "| column | type | nullable | meaning |", "| --- | --- | --- | --- |"]
        for f in schema:
            doc = (f.metadata or {}).get(b"doc", b"").decode()
            out.append(f"| {f.name} | {f.type} | {'yes' if f.nullable else 'no'} | {doc} |")
        out.append("")
    return "\n".join(out)
