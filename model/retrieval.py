"""Training-data attribution: which training chunks does an output most resemble?

A FAISS inner-product index over mean-pooled final hidden states h of the training chunks,
centred and L2-normalised (cosine similarity in the model's own representation space), built after
training and stored beside the model (local path or s3:// via pyarrow.fs):

    <model>/retrieval/index.faiss     faiss.serialize_index bytes
    <model>/retrieval/chunks.parquet  chunk_id, doc_id, source, text (row i = vector i)
    <model>/retrieval/meta.json       pooling, chunk_len, dimension, count

This is similarity search, an approximation (the paper's wording), not a causal influence
estimate: a hit means "the model represents this training chunk like the output".
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import pyarrow.parquet as pq
import torch

INDEX_DIR = "retrieval"
INDEX_FILE, CHUNKS_FILE, META_FILE = "index.faiss", "chunks.parquet", "meta.json"
CHUNK_SCHEMA = pa.schema([("chunk_id", pa.string()), ("doc_id", pa.string()), ("source", pa.string()),
                          ("text", pa.string())])


# ----------------------------------------------------------------------------- chunks
def corpus_chunks(corpus, tokenizer, chunk_len: int = 64, val_fraction: float | None = None) -> pa.Table:
    """Chunk a training corpus (.txt file, directory of .txt, or list of documents) into
    ``chunk_len``-token pieces with ids. With ``val_fraction`` the last documents are held
    out exactly as ``model.loop.prepare_data`` does, so only training text is indexed."""
    from model.corpus import split_articles

    if isinstance(corpus, (list, tuple)):
        docs = [("docs", i, d) for i, d in enumerate(corpus) if d.strip()]
    else:
        path = Path(corpus)
        files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
        if not files:
            raise FileNotFoundError(f"no .txt files in {path}")
        docs = [(str(f), i, d) for f in files for i, d in enumerate(split_articles(f.read_text(encoding="utf-8")))]
    if val_fraction:
        docs = docs[: len(docs) - max(1, round(len(docs) * val_fraction))]
    rows = {k: [] for k in CHUNK_SCHEMA.names}
    encs = tokenizer.encode_batch([d for _, _, d in docs], add_special_tokens=False)
    for (source, i, _), enc in zip(docs, encs):
        ids = enc.ids
        doc_id = f"{Path(source).stem}#{i}"
        pieces = [ids[s:s + chunk_len] for s in range(0, len(ids), chunk_len)]
        for j, text in enumerate(tokenizer.decode_batch(pieces)):
            rows["chunk_id"].append(f"{doc_id}/{j}")
            rows["doc_id"].append(doc_id)
            rows["source"].append(source)
            rows["text"].append(text)
    return pa.table(rows, schema=CHUNK_SCHEMA)


def atlas_chunks(chunks: pa.Table, documents: pa.Table | None = None) -> pa.Table:
    """Index input from Atlas tables: ``chunks`` (chunk_id, doc_id, text, ...) joined with
    ``documents`` (doc_id, source) for the source URI; without documents, source = doc_id."""
    base = chunks.select(["chunk_id", "doc_id", "text"])
    if documents is None:
        src = base.column("doc_id")
    else:
        joined = base.join(documents.select(["doc_id", "source"]), "doc_id", join_type="left outer")
        joined = joined.take(pa.compute.sort_indices(joined, [("chunk_id", "ascending")]))
        base, src = joined.select(["chunk_id", "doc_id", "text"]), joined.column("source")
    return pa.table({"chunk_id": base.column("chunk_id"), "doc_id": base.column("doc_id"), "source": src,
                     "text": base.column("text")}, schema=CHUNK_SCHEMA)


# ----------------------------------------------------------------------------- vectors
def _normalise(v: np.ndarray) -> np.ndarray:
    v = np.ascontiguousarray(v, dtype=np.float32)
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)


def embed_texts(model, tokenizer, texts: list[str], batch_size: int = 32) -> np.ndarray:
    """Normalised mean-pooled final hidden states (N, d) of each text on its own."""
    return embed_ids(model, [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)], batch_size)


@torch.no_grad()
def embed_ids(model, seqs: list[list[int]], batch_size: int = 32) -> np.ndarray:
    """Normalised mean-pooled final hidden states (N, d) of each token sequence on its own."""
    was = model.training
    model.eval()
    device = model.tok_emb.weight.device
    max_len = model.cfg.max_seq_len
    out = np.zeros((len(seqs), model.cfg.d_model), dtype=np.float32)
    try:
        encs = [list(s)[:max_len] or [model.cfg.pad_token_id] for s in seqs]
        order = sorted(range(len(encs)), key=lambda i: len(encs[i]))  # similar lengths share a batch
        for lo in range(0, len(order), batch_size):
            idx = order[lo:lo + batch_size]
            L = max(len(encs[i]) for i in idx)
            if model.cfg.is_diffusion:  # the block-causal mask wants whole blocks; padding is never pooled
                L = min(max_len, -(-L // model.cfg.block_size) * model.cfg.block_size)
            # diffusion pads with [MASK] (in distribution: "not yet known"); AR never sees the tail
            fill = model.cfg.mask_token_id if model.cfg.is_diffusion else model.cfg.pad_token_id
            ids = torch.full((len(idx), L), fill, dtype=torch.long)
            keep = torch.zeros(len(idx), L)
            for r, i in enumerate(idx):
                ids[r, : len(encs[i])] = torch.tensor(encs[i])
                keep[r, : len(encs[i])] = 1
            h = model.hidden(ids.to(device)).float().cpu()
            pooled = (h * keep[..., None]).sum(1) / keep.sum(1, keepdim=True)
            out[idx] = pooled.numpy()
    finally:
        model.train(was)
    return _normalise(out)


@torch.no_grad()
def embed_span(model, ids: torch.Tensor, start: int, end: int, in_context: bool = False) -> np.ndarray:
    """Normalised mean of h over positions [start, end) of a finished sequence (1, T) or (T,).

    By default the span is run on its own, exactly as the training chunks were embedded, so
    a verbatim (memorised) span lands on its source chunk; ``in_context=True`` pools the
    span's states inside the whole sequence instead (what the model computed while writing).
    """
    if not 0 <= start < end:
        raise ValueError(f"empty span [{start}, {end})")
    if not in_context:
        return embed_ids(model, [ids.view(-1)[start:end].tolist()])
    was = model.training
    model.eval()
    try:
        seq = ids.view(1, -1).to(model.tok_emb.weight.device)
        h = model.hidden(seq).float()[0, start:end].mean(0, keepdim=True).cpu().numpy()
    finally:
        model.train(was)
    return _normalise(h)


# ----------------------------------------------------------------------------- index
@dataclass
class Hit:
    rank: int
    score: float  # cosine similarity of the centred vectors
    chunk_id: str
    doc_id: str
    source: str
    text: str


class TrainingDataIndex:
    """FAISS inner-product index + the chunk table it points into."""

    def __init__(self, index, chunks: pa.Table, meta: dict):
        if index.ntotal != chunks.num_rows:
            raise ValueError(f"index holds {index.ntotal} vectors but the chunk table has {chunks.num_rows} rows")
        self.index, self.chunks, self.meta = index, chunks, meta

    @classmethod
    def build(cls, model, tokenizer, chunks: pa.Table, factory: str = "Flat", batch_size: int = 32) -> "TrainingDataIndex":
        """Embed every chunk's text and index it. ``factory`` is a faiss.index_factory string
        ("Flat" = exact; e.g. "IVF1024,Flat" for millions of chunks, trained on the vectors)."""
        import faiss

        missing = set(CHUNK_SCHEMA.names) - set(chunks.column_names)
        if missing:
            raise ValueError(f"chunk table lacks columns {sorted(missing)} (needs {CHUNK_SCHEMA.names})")
        if chunks.num_rows == 0:
            raise ValueError("no training chunks to index")
        chunks = chunks.select(CHUNK_SCHEMA.names).cast(CHUNK_SCHEMA)
        vecs = embed_texts(model, tokenizer, chunks.column("text").to_pylist(), batch_size)
        d = vecs.shape[1]
        # Pooled hidden states share a large common component (all cosines ~0.99 on a small
        # model), so the index centres them on the training-chunk mean and re-normalises
        # before the inner product: FAISS transforms, stored inside the index itself.
        index = faiss.IndexPreTransform(faiss.index_factory(d, factory, faiss.METRIC_INNER_PRODUCT))
        index.prepend_transform(faiss.NormalizationTransform(d, 2.0))
        index.prepend_transform(faiss.CenteringTransform(d))
        index.train(vecs)
        index.add(vecs)
        meta = {"pooling": "mean final hidden state; centred on the chunk mean, L2-normalised",
                "metric": "inner product (cosine)", "factory": factory, "dim": int(d), "count": int(index.ntotal)}
        return cls(index, chunks, meta)

    def search_vectors(self, vecs: np.ndarray, k: int = 5) -> list[list[Hit]]:
        k = min(k, self.index.ntotal)
        scores, ids = self.index.search(_normalise(vecs), k)
        cols = {c: self.chunks.column(c) for c in ("chunk_id", "doc_id", "source", "text")}
        out = []
        for srow, irow in zip(scores, ids):
            out.append([Hit(r + 1, float(s), *(cols[c][int(i)].as_py() for c in ("chunk_id", "doc_id", "source", "text")))
                        for r, (s, i) in enumerate(zip(srow, irow)) if i >= 0])
        return out

    def search_span(self, model, ids: torch.Tensor, start: int, end: int, k: int = 5,
                    in_context: bool = False) -> list[Hit]:
        """Top-k training chunks for positions [start, end) of a generated sequence."""
        return self.search_vectors(embed_span(model, ids, start, end, in_context), k)[0]

    def search_text(self, model, tokenizer, text: str, k: int = 5) -> list[Hit]:
        return self.search_vectors(embed_texts(model, tokenizer, [text]), k)[0]

    # -- storage (local path, file:// or s3://)
    def save(self, uri: str, storage_cfg=None) -> str:
        import faiss

        from atlas import storage

        root = storage.resolve(uri, storage_cfg)
        buf = io.BytesIO()
        pq.write_table(self.chunks, buf)
        storage.write_bytes_atomic(root.join(CHUNKS_FILE), buf.getvalue())
        storage.write_bytes_atomic(root.join(INDEX_FILE), faiss.serialize_index(self.index).tobytes())
        storage.write_json_atomic(root.join(META_FILE), self.meta)  # written last: marks a complete index
        return root.uri

    @classmethod
    def load(cls, uri: str, storage_cfg=None) -> "TrainingDataIndex":
        import faiss

        from atlas import storage

        root = storage.resolve(uri, storage_cfg)
        if not storage.exists(root.join(META_FILE)):
            raise FileNotFoundError(f"no training-data index at {root.uri} ({META_FILE} missing)")
        meta = storage.read_json(root.join(META_FILE))
        index = faiss.deserialize_index(np.frombuffer(storage.read_bytes(root.join(INDEX_FILE)), dtype=np.uint8))
        chunks = pq.read_table(io.BytesIO(storage.read_bytes(root.join(CHUNKS_FILE))))
        return cls(index, chunks, meta)


def index_uri(model_uri: str) -> str:
    """Where the index of the model at ``model_uri`` lives: beside it."""
    return model_uri.rstrip("/") + "/" + INDEX_DIR


def build_and_save(model, tokenizer, model_uri: str, corpus, chunk_len: int = 64, val_fraction: float | None = None,
                   factory: str = "Flat", storage_cfg=None) -> TrainingDataIndex:
    """After training: chunk ``corpus``, index it, store beside the model; returns the index."""
    idx = TrainingDataIndex.build(model, tokenizer, corpus_chunks(corpus, tokenizer, chunk_len, val_fraction),
                                  factory)
    idx.meta["chunk_len"] = chunk_len
    idx.save(index_uri(model_uri), storage_cfg)
    return idx


def load_for_model(model_uri: str, storage_cfg=None) -> TrainingDataIndex | None:
    """The index stored beside a model, or None if none was built."""
    try:
        return TrainingDataIndex.load(index_uri(model_uri), storage_cfg)
    except FileNotFoundError:
        return None
