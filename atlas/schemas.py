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
        pa.field("reason", pa.string(), nullable=False, metadata={"doc": "empty | undecodable | oversized | malformed | wrong_schema | unreadable | reader_error | ..."}),
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
        pa.field("score", pa.int8(), metadata={"doc": "relevance 1-5; null if the judge output was unusable"}),
        pa.field("raw_output", pa.string()),
        pa.field("error", pa.string()),
        pa.field("model", pa.string(), nullable=False),
    ]
)

TAG_JUDGE_BY_CHUNK = pa.schema(
    [
        pa.field("chunk_id", pa.string(), nullable=False),
        pa.field("n_tags", pa.int32(), nullable=False),
        pa.field("mean_score", pa.float64()),
    ]
)

TAG_JUDGE_BY_TAG = pa.schema(
    [
        pa.field("tag", pa.string(), nullable=False),
        pa.field("n_chunks", pa.int32(), nullable=False),
        pa.field("mean_score", pa.float64()),
    ]
)

ANNOTATIONS = pa.schema(
    [
        pa.field("chunk_id", pa.string(), nullable=False, metadata={"doc": "<doc_id>-<chunk_index:05d>: sorting by it restores document order"}),
        pa.field("doc_id", pa.string(), nullable=False),
        pa.field("chunk_index", pa.int32(), nullable=False, metadata={"doc": "position of the chunk in its document"}),
        pa.field("source", pa.string(), nullable=False, metadata={"doc": "corpus source (e.g. wikipedia, arxiv, code): the unit of training-data mixtures"}),
        pa.field("text", pa.string(), nullable=False),
        pa.field("concept_ids", pa.list_(pa.int32()), nullable=False, metadata={"doc": "concept library ids present in the chunk (may be empty)"}),
        pa.field("concept_scores", pa.list_(pa.float32()), nullable=False, metadata={"doc": "annotator confidence per concept id, same order and length"}),
        pa.field("annotator", pa.string(), nullable=False, metadata={"doc": "model that produced the labels"}),
        pa.field("library_version", pa.string(), nullable=False, metadata={"doc": "version of the concept library the ids refer to"}),
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
