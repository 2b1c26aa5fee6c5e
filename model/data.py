"""Annotation shards -> packed, concept-labelled training sequences (Ray Data).

Input: the Atlas ``annotations`` table (schema ``atlas.schemas.ANNOTATIONS``: one row per
chunk with its text and concept ids), from an Atlas run root (the committed version is read
through its ``_CURRENT`` pointer) or a plain folder / prefix of Parquet shards, local or S3.
Concept names come from the run's ``concepts`` table (columns ``id`` or ``concept_id``, and
``name``) when it is present; otherwise the ids seen in the shards are the library.

Pipeline (all lazy Ray Data operators; Ray Train hands each worker its split through
``ray.train.get_dataset_shard``):

    read_parquet -> split by doc hash (train / val) -> source mixture (deterministic
    per-chunk copy counts) -> tokenize + pack (``pack_chunks``) -> rows of
    input_ids (T,), span_ids (T,), n_spans, label_pairs [span, concept, span, concept, ...]

``collate`` turns rows into the batch dict ``model.objectives.compute_losses`` reads
(input_ids, chunk_ids, chunk_labels). Everything is a pure function of the shards and the
seed: the split hashes doc ids, the mixture hashes (seed, chunk_id), packing follows the
shards' order (``preserve_order``) and sorts chunks by (doc_id, chunk_index) inside a batch.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
from pydantic import BaseModel, ConfigDict, Field

from model.config import EOS_ID

READ_COLUMNS = ["chunk_id", "doc_id", "chunk_index", "source", "text", "concept_ids"]


class DataConfig(BaseModel):
    """Where the annotation shards are and how to turn them into training sequences."""

    model_config = ConfigDict(extra="forbid")

    annotations: str = Field(description="Atlas run root (its `annotations` table) or a folder/prefix of Parquet shards")
    concepts: str | None = Field(None, description="concepts table folder; default: the run root's `concepts` table if published")
    s3_endpoint: str | None = None
    mixture: dict[str, float] | None = Field(None, description="source -> weight (share of chunks); None: as stored")
    mixture_total: int | None = Field(None, ge=1, description="chunks after mixing; None: the most without repeating any source")
    val_fraction: float = Field(0.05, gt=0, lt=1, description="share of documents held out (by doc-id hash)")
    min_span: int = Field(4, ge=1, description="a piece of a chunk split across sequences shorter than this is left unlabelled")
    tokenizer: str | None = Field(None, description="tokenizer.json; None trains a byte-level BPE on training texts")
    tokenizer_sample: int = Field(20_000, ge=10, description="chunks used to train the tokenizer")
    pack_batch_chunks: int = Field(512, ge=1, description="chunks per packing batch (the tail of each batch is dropped)")
    shuffle_buffer: int = Field(0, ge=0, description="worker-side local shuffle of packed sequences (0: off)")


# ----------------------------------------------------------------------------- packing
def pack_chunks(token_lists: list[list[int]], doc_ids: list[str], seq_len: int, min_span: int = 4,
                eos_id: int = EOS_ID):
    """Concatenate chunks (EOS between documents) and cut into ``seq_len`` windows.

    Returns (ids (S, T) int32, span_ids (S, T) int32, spans: list per sequence of the source
    chunk index of each local span). ``span_ids[s, t]`` is the local span of position t
    (-1: EOS or an unlabelled piece). A chunk cut by a window boundary gives one span per
    piece, each carrying the whole chunk's labels; a piece shorter than ``min_span`` is
    left unlabelled (too little text to show the concept). The tail shorter than one
    window is dropped.
    """
    ids: list[np.ndarray] = []
    owner: list[np.ndarray] = []
    prev = None
    for c, (toks, doc) in enumerate(zip(token_lists, doc_ids)):
        if prev is not None and doc != prev:
            ids.append(np.array([eos_id], dtype=np.int32))
            owner.append(np.array([-1], dtype=np.int32))
        ids.append(np.asarray(toks, dtype=np.int32))
        owner.append(np.full(len(toks), c, dtype=np.int32))
        prev = doc
    flat = np.concatenate(ids) if ids else np.zeros(0, np.int32)
    own = np.concatenate(owner) if owner else np.zeros(0, np.int32)
    n_seq = len(flat) // seq_len
    full_len = np.array([len(t) for t in token_lists], dtype=np.int64)
    flat = flat[: n_seq * seq_len].reshape(n_seq, seq_len)
    own = own[: n_seq * seq_len].reshape(n_seq, seq_len)
    span_ids = np.full((n_seq, seq_len), -1, dtype=np.int32)
    spans: list[list[int]] = []
    for s in range(n_seq):
        seg = own[s]
        start = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])
        lens = np.diff(np.r_[start, seq_len])
        local: list[int] = []
        for a, n in zip(start, lens):
            c = int(seg[a])
            if c < 0 or (n < min_span and n < full_len[c]):
                continue
            span_ids[s, a:a + n] = len(local)
            local.append(c)
        spans.append(local)
    return flat, span_ids, spans


def _doc_is_val(doc_ids, val_fraction: float) -> np.ndarray:
    # blake2b of the doc id: stable across processes and Python versions (hash() is salted)
    cut = int(val_fraction * 2**32)
    return np.array([int.from_bytes(hashlib.blake2b(d.encode(), digest_size=4).digest(), "big") < cut
                     for d in doc_ids], dtype=bool)


def _unit(seed: int, keys) -> np.ndarray:
    return np.array([int.from_bytes(hashlib.blake2b(f"{seed}:{k}".encode(), digest_size=8).digest(), "big") / 2**64
                     for k in keys])


# ----------------------------------------------------------------------------- Ray Data ops
def _split(batch: pa.Table, val: bool, val_fraction: float) -> pa.Table:
    mask = _doc_is_val(batch.column("doc_id").to_pylist(), val_fraction)
    return batch.filter(pa.array(mask if val else ~mask))


def _mix(batch: pa.Table, rates: dict[str, float], seed: int) -> pa.Table:
    """Repeat each row floor(r) times plus once more with probability frac(r), where r is
    its source's rate; the coin is a hash of (seed, chunk_id), so the mixture is a pure
    function of the data and the seed."""
    src = batch.column("source").to_pylist()
    r = np.array([rates.get(s, 0.0) for s in src])
    u = _unit(seed, batch.column("chunk_id").to_pylist())
    copies = np.floor(r).astype(np.int64) + (u < r - np.floor(r))
    return batch.take(pa.array(np.repeat(np.arange(len(src)), copies)))


def _source_counts(batch: pa.Table) -> pa.Table:
    vc = pc.value_counts(batch.column("source"))
    return pa.table({"source": vc.field("values"), "n": pc.cast(vc.field("counts"), pa.int64())})


_TOKENIZERS: dict[str, Any] = {}


def _tokenizer_from_json(tok_json: str):
    key = hashlib.sha1(tok_json.encode()).hexdigest()
    if key not in _TOKENIZERS:  # one parse per worker process, not per batch
        from tokenizers import Tokenizer

        _TOKENIZERS[key] = Tokenizer.from_str(tok_json)
    return _TOKENIZERS[key]


def _tokenize_pack(batch: pa.Table, tok_json: str, id_to_index: dict[int, int], seq_len: int,
                   min_span: int) -> pa.Table:
    tok = _tokenizer_from_json(tok_json)
    order = pc.sort_indices(batch, sort_keys=[("doc_id", "ascending"), ("chunk_index", "ascending")])
    batch = batch.take(order)
    texts = batch.column("text").to_pylist()
    enc = tok.encode_batch(texts, add_special_tokens=False)
    ids, span_ids, spans = pack_chunks([e.ids for e in enc], batch.column("doc_id").to_pylist(), seq_len, min_span)
    concept_lists = batch.column("concept_ids").to_pylist()
    chunk_ids = batch.column("chunk_id").to_pylist()
    pairs, n_spans, span_chunks = [], [], []
    for local in spans:
        p: list[int] = []
        for j, c in enumerate(local):
            for cid in concept_lists[c] or ():
                idx = id_to_index.get(int(cid))
                if idx is None:
                    raise ValueError(f"chunk {chunk_ids[c]!r}: concept id {cid} is not in the concept library")
                p += [j, idx]
        pairs.append(p)
        n_spans.append(len(local))
        span_chunks.append([chunk_ids[c] for c in local])
    T = seq_len
    return pa.table({
        "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids.reshape(-1), pa.int32()), T),
        "span_ids": pa.FixedSizeListArray.from_arrays(pa.array(span_ids.reshape(-1), pa.int32()), T),
        "n_spans": pa.array(n_spans, pa.int32()),
        "label_pairs": pa.array(pairs, pa.list_(pa.int32())),
        "span_chunks": pa.array(span_chunks, pa.list_(pa.string())),
    })


# ----------------------------------------------------------------------------- collate
def collate(batch: dict, n_known: int | None) -> dict:
    """Packed rows (numpy batch) -> the dict ``compute_losses`` reads.

    chunk_ids (B, T): global span index into chunk_labels (C, n_known), -1 = none.
    """
    import torch

    ids = np.stack(list(batch["input_ids"])) if batch["input_ids"].dtype == object else batch["input_ids"]
    sp = np.stack(list(batch["span_ids"])) if batch["span_ids"].dtype == object else batch["span_ids"]
    out = {"input_ids": torch.as_tensor(ids, dtype=torch.long)}
    if not n_known:
        return out
    n_spans = np.asarray(batch["n_spans"], dtype=np.int64)
    offset = np.r_[0, np.cumsum(n_spans)[:-1]]
    cid = np.where(sp >= 0, sp + offset[:, None], -1)
    labels = torch.zeros(int(n_spans.sum()), n_known)
    for b, pairs in enumerate(batch["label_pairs"]):
        p = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        if len(p):
            labels[p[:, 0] + offset[b], p[:, 1]] = 1.0
    out["chunk_ids"] = torch.as_tensor(cid, dtype=torch.long)
    out["chunk_labels"] = labels
    return out


def iter_batches(it, micro_batch: int, n_known: int | None, seed: int = 0, shuffle_buffer: int = 0):
    """Collated torch batches from a Ray ``DataIterator`` / Dataset (drop_last)."""
    kw = dict(batch_size=micro_batch, batch_format="numpy", drop_last=True)
    if shuffle_buffer:
        kw.update(local_shuffle_buffer_size=shuffle_buffer, local_shuffle_seed=seed)
    for b in it.iter_batches(**kw):
        yield collate(b, n_known)


# ----------------------------------------------------------------------------- prepare
@dataclass
class Prepared:
    """What the trainer needs: lazy train/val datasets plus the library and provenance."""

    train: Any
    val: Any
    tokenizer: Any
    concept_ids: list[int]
    concept_names: list[str]
    provenance: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)

    @property
    def n_concepts(self) -> int:
        return len(self.concept_ids)


def _resolve_shards(cfg: DataConfig):
    """(Location of the Parquet files, Location of the run root or None, provenance)."""
    from atlas import storage
    from atlas.config import StorageConfig

    scfg = StorageConfig(s3_endpoint=cfg.s3_endpoint)
    root = storage.resolve(cfg.annotations, scfg)
    from atlas.manifest import redact_uri

    prov: dict[str, Any] = {"annotations_uri": redact_uri(root.uri)}
    if storage.table_exists(root, "annotations"):
        loc = storage.table_path(root, "annotations")
        prov["annotations_version"] = storage.current_version(root, "annotations")
        man = root.join(storage.MANIFEST)
        if storage.exists(man):
            m = storage.read_json(man)
            prov["annotation_run_id"] = m.get("run_id")
            prov["annotation_run_kind"] = m.get("kind", "atlas")
        return loc, root, prov
    if not storage.exists(root):
        raise FileNotFoundError(f"annotation shards not found: {root.uri} (no `annotations` table, no folder)")
    return root, None, prov


def _read_concepts(cfg: DataConfig, root) -> tuple[list[int], list[str], dict] | None:
    import pyarrow.parquet as pq

    from atlas import storage
    from atlas.config import StorageConfig

    if cfg.concepts:
        loc = storage.resolve(cfg.concepts, StorageConfig(s3_endpoint=cfg.s3_endpoint))
        version = None
    elif root is not None and storage.table_exists(root, "concepts"):
        loc = storage.table_path(root, "concepts")
        version = storage.current_version(root, "concepts")
    else:
        return None
    t = pq.read_table(loc.path, filesystem=loc.fs)
    id_col = "id" if "id" in t.column_names else "concept_id" if "concept_id" in t.column_names else None
    if id_col is None or "name" not in t.column_names:
        raise ValueError(f"concepts table {loc.uri} needs columns id (or concept_id) and name; has {t.column_names}")
    raw_ids = t.column(id_col).to_pylist()
    names = [str(n) for n in t.column("name").to_pylist()]
    if pa.types.is_string(t.schema.field(id_col).type):
        # An Atlas Stage 2 library: shards carry the int32 index of a concept in the library
        # sorted by its string concept_id (atlas.schemas.ANNOTATIONS.concept_ids).
        by_id = sorted(range(len(raw_ids)), key=lambda i: raw_ids[i])
        names = [names[i] for i in by_id]
        raw_ids = list(range(len(raw_ids)))
    ids = [int(i) for i in raw_ids]
    if len(set(ids)) != len(ids):
        raise ValueError(f"concepts table {loc.uri} has duplicate ids")
    order = np.argsort(ids, kind="stable")
    prov = {"concepts_uri": loc.uri, "concepts_version": version}
    if "library_version" in t.column_names and t.num_rows:
        prov["library_version"] = str(t.column("library_version")[0])
    return [ids[i] for i in order], [names[i] for i in order], prov


def prepare(cfg: DataConfig, seq_len: int, seed: int = 0, n_known: int | None = None, vocab_size: int | None = None,
            tokenizer=None) -> Prepared:
    """Resolve shards and library, fit or load the tokenizer, build the lazy datasets.

    Runs on the driver with Ray initialised. ``n_known`` (the model's known-concept slots)
    must be >= the library size; a smaller model is an error that names both numbers.
    """
    import ray.data

    from model.tokenizer import load_tokenizer, train_tokenizer

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # packing and mixing depend on row order
    ctx.enable_progress_bars = False
    loc, root, prov = _resolve_shards(cfg)
    ds = ray.data.read_parquet(loc.path, filesystem=loc.fs).select_columns(READ_COLUMNS)  # pushed into the read
    # small driver-side reads (provenance, tokenizer sample) go through pyarrow.dataset:
    # a Ray Data job per peek costs seconds of task start-up
    pds = pads.dataset(loc.path, filesystem=loc.fs, format="parquet")
    missing = [c for c in READ_COLUMNS if c not in pds.schema.names]
    if missing:
        raise ValueError(f"annotation shards at {loc.uri} lack column(s) {missing} (schema: atlas.schemas.ANNOTATIONS)")
    head = pds.head(1, columns=["library_version", "annotator"]).to_pylist()
    if head:
        prov.setdefault("library_version", head[0]["library_version"])
        prov["annotator"] = head[0]["annotator"]
    lib = _read_concepts(cfg, root)
    if lib is not None:
        concept_ids, concept_names, cprov = lib
        prov.update({k: v for k, v in cprov.items() if v is not None})
    else:  # no library table: the ids in the shards are the library
        seen = set()
        for b in ds.select_columns(["concept_ids"]).iter_batches(batch_format="pyarrow", batch_size=65536):
            seen.update(int(x) for x in pc.unique(pc.list_flatten(b.column("concept_ids"))).to_pylist())
        concept_ids = sorted(seen)
        concept_names = [str(i) for i in concept_ids]
    if n_known is not None and len(concept_ids) > n_known:
        raise ValueError(f"the concept library has {len(concept_ids)} concepts but the model has n_known={n_known}; "
                         f"raise model.n_known to at least {len(concept_ids)}")
    id_to_index = {c: i for i, c in enumerate(concept_ids)}

    train_rows = ds.map_batches(_split, batch_format="pyarrow", fn_kwargs={"val": False, "val_fraction": cfg.val_fraction})
    val_rows = ds.map_batches(_split, batch_format="pyarrow", fn_kwargs={"val": True, "val_fraction": cfg.val_fraction})

    stats: dict[str, Any] = {}
    if cfg.mixture:
        # per-batch value counts summed on the driver: one pass, no shuffle (a groupby
        # repartitions into hundreds of blocks)
        counts: dict[str, int] = {}
        for r in train_rows.map_batches(_source_counts, batch_format="pyarrow").take_all():
            counts[r["source"]] = counts.get(r["source"], 0) + int(r["n"])
        unknown = sorted(set(cfg.mixture) - set(counts))
        if unknown:
            raise ValueError(f"mixture names source(s) {unknown} absent from the shards (have {sorted(counts)})")
        wsum = sum(cfg.mixture.values())
        share = {s: w / wsum for s, w in cfg.mixture.items() if w > 0}
        total = cfg.mixture_total or int(min(counts[s] / share[s] for s in share))
        rates = {s: total * share[s] / counts[s] for s in share}
        stats.update(source_chunks=counts, mixture_rates=rates, mixture_total=total)
        train_rows = train_rows.map_batches(_mix, batch_format="pyarrow", fn_kwargs={"rates": rates, "seed": seed})

    if tokenizer is None and cfg.tokenizer:
        tokenizer = load_tokenizer(cfg.tokenizer)
    if tokenizer is None:
        sample = _split(pds.head(cfg.tokenizer_sample, columns=["doc_id", "text"]), False, cfg.val_fraction)
        if not sample.num_rows:
            raise ValueError(f"no training chunks in {loc.uri} (val_fraction={cfg.val_fraction})")
        tokenizer = train_tokenizer(sample.column("text").to_pylist(), vocab_size or 1024)
    if vocab_size is not None and tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens > model vocab_size {vocab_size}")
    kw = {"tok_json": tokenizer.to_str(), "id_to_index": id_to_index, "seq_len": seq_len, "min_span": cfg.min_span}
    pack = dict(batch_format="pyarrow", batch_size=cfg.pack_batch_chunks, fn_kwargs=kw)
    train = train_rows.map_batches(_tokenize_pack, **pack)
    val = val_rows.map_batches(_tokenize_pack, **pack)
    return Prepared(train, val, tokenizer, concept_ids, concept_names, prov, stats)


# ----------------------------------------------------------------------------- stand-in shards
STANDIN_ANNOTATOR = "STAND-IN model/labels.py (keywords + section headings), not Atlas Stage 3"


def standin_annotations(corpus, n_concepts: int, chunk_words: int = 60, sources: dict[str, str] | None = None,
                        id_offset: int = 0, library_version: str = "standin-0") -> tuple[pa.Table, pa.Table]:
    """STAND-IN for Atlas Stage 3: (annotations, concepts) tables from raw text.

    Chunks are ~``chunk_words`` words inside each section; labels come from
    ``model.labels.StandInLabeller`` fitted on the corpus. ``sources`` maps doc_id -> source
    (default "corpus"). Used by the demo and tests until Stage 3 writes real shards.
    """
    from atlas import schemas
    from model.corpus import read_documents, split_sections
    from model.labels import StandInLabeller

    docs = read_documents(corpus)
    secs = [(d, s) for d in docs for s in split_sections(d)]
    lab = StandInLabeller.fit([s for _, s in secs], n_concepts)
    rows: dict[str, list] = {k: [] for k in schemas.ANNOTATIONS.names}
    for di, doc in enumerate(docs):
        doc_id = hashlib.sha256(doc.encode("utf-8", "ignore")).hexdigest()[:20]
        k = 0
        for head, text in split_sections(doc):
            words = text.split(" ")
            for a in range(0, len(words), chunk_words):
                piece = " ".join(words[a:a + chunk_words])
                if not piece.strip():
                    continue
                ids = [id_offset + i for i in lab.label(piece, head)]
                rows["chunk_id"].append(f"{doc_id}-{k:05d}")
                rows["doc_id"].append(doc_id)
                rows["chunk_index"].append(k)
                rows["source"].append((sources or {}).get(doc_id, (sources or {}).get(str(di), "corpus")))
                rows["text"].append(piece + " ")
                rows["concept_ids"].append(ids)
                rows["concept_scores"].append([1.0] * len(ids))
                rows["annotator"].append(STANDIN_ANNOTATOR)
                rows["library_version"].append(library_version)
                k += 1
    ann = pa.Table.from_pydict(rows, schema=schemas.ANNOTATIONS)
    concepts = pa.table({"id": pa.array([id_offset + i for i in range(lab.n_concepts)], pa.int32()),
                         "name": [lab.display_name(i) for i in range(lab.n_concepts)],
                         "library_version": [library_version] * lab.n_concepts})
    return ann, concepts


def write_annotation_run(root_uri: str, annotations: pa.Table, concepts: pa.Table | None = None, n_shards: int = 4,
                         s3_endpoint: str | None = None, run_id: str | None = None) -> str:
    """Publish ``annotations`` (as ``n_shards`` Parquet parts) and ``concepts`` under an
    Atlas-style run root (versioned, ``_CURRENT`` pointer), plus a small manifest."""
    import pyarrow.parquet as pq

    from atlas import storage
    from atlas.config import StorageConfig

    root = storage.resolve(root_uri, StorageConfig(s3_endpoint=s3_endpoint))
    version = storage.new_version(root, "annotations")
    step = max(1, math.ceil(annotations.num_rows / n_shards))
    for i, a in enumerate(range(0, max(1, annotations.num_rows), step)):
        pq.write_table(annotations.slice(a, step), version.join(f"part-{i:05d}.parquet").path, filesystem=version.fs)
    storage.publish(root, "annotations", version, annotations.num_rows)
    if concepts is not None:
        storage.write_table(root, "concepts", concepts)
    man = root.join(storage.MANIFEST)
    if not storage.exists(man):
        storage.write_json_atomic(man, {"run_id": run_id or "standin", "kind": "standin-annotations",
                                        "note": json.dumps(STANDIN_ANNOTATOR)})
    return root.uri
