"""Tag embedding: unique normalised tags with their chunk counts, embedded in Ray Data actors.

``tag_counts`` turns ``chunk_tags`` into one row per unique tag (``tag``, ``n_chunks``),
sorted by tag so that every later step sees the same order on a rerun. ``embed_tags_ds`` runs
:class:`TagEmbedder` (one sentence-transformers model per actor, loaded once) over it with
``map_batches``, and the stage publishes that Dataset as it streams; ``read_tag_embeddings``
reads a published version back sorted by tag into one float32 matrix. Embeddings are
unit-norm float32, so inner product is cosine.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from atlas import schemas

if TYPE_CHECKING:
    from atlas import storage


class EmbeddingModelError(ValueError):
    pass


def resolve_embedding_model(name: str) -> str:
    """``embedded:<package>`` -> the packaged model directory; anything else must be a local dir."""
    if name.startswith("embedded:"):
        pkg = name.split(":", 1)[1].replace("-", "_")
        try:
            mod = importlib.import_module(pkg)
        except ImportError:
            raise EmbeddingModelError(f"embedding model {name!r}: package {pkg!r} is not installed") from None
        return str(mod.get_model_path())
    if not Path(name).is_dir():
        raise EmbeddingModelError(f"embedding model {name!r} is neither embedded:<package> nor a local directory (no hub access at run time)")
    return name


@functools.lru_cache(maxsize=4)
def load_model(model: str, device: str = "cpu"):
    """An in-process SentenceTransformer (small jobs: concept names, taxonomy node labels)."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(resolve_embedding_model(model), device="cuda" if device == "gpu" else "cpu")


def encode(texts: list[str], model: str, batch_size: int = 256, device: str = "cpu") -> np.ndarray:
    """Unit-norm float32 embeddings of ``texts`` in this process."""
    m = load_model(model, device)
    if not texts:
        return np.zeros((0, m.get_sentence_embedding_dimension()), np.float32)
    return np.asarray(m.encode(texts, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True), np.float32)


def to_matrix(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A list<float32> column of equal-length vectors -> (n, d) float32 matrix (no Python loop)."""
    if isinstance(col, pa.ChunkedArray):
        # combine_chunks copies even a single chunk: 1.5 GB at 1M tags
        arr = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    else:
        arr = col
    n = len(arr)
    if n == 0:
        return np.zeros((0, 0), np.float32)
    flat = arr.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    return flat.reshape(n, -1)


def from_matrix(x: np.ndarray) -> pa.Array:
    """(n, d) float32 matrix -> list<float32> column."""
    x = np.ascontiguousarray(x, np.float32)
    return pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1]).cast(pa.list_(pa.float32()))


def _count_batch(batch: pa.Table) -> pa.Table:
    tags = pc.list_flatten(batch.column("tags"))
    vc = pc.value_counts(tags)
    return pa.table({"tag": vc.field("values"), "n": vc.field("counts").cast(pa.int64())})


def tag_counts(chunk_tags: pa.Table) -> pa.Table:
    """Unique tags of ``chunk_tags`` with the number of chunks carrying each, sorted by tag.

    Tags are already normalised and deduplicated per chunk by Stage 1, so a tag's count is its
    number of chunks.
    """
    if chunk_tags.num_rows == 0:
        return pa.table({"tag": pa.array([], pa.string()), "n_chunks": pa.array([], pa.int64())})
    c = _count_batch(chunk_tags)
    return pa.table({"tag": c.column("tag"), "n_chunks": c.column("n")}).sort_by("tag")


def tag_counts_ds(ds) -> pa.Table:
    """:func:`tag_counts` over a Ray Dataset of ``chunk_tags``: per-block counts, then a sum."""
    import ray

    refs = ds.select_columns(["tags"]).map_batches(_count_batch, batch_format="pyarrow").to_arrow_refs()
    tables = [t for t in ray.get(refs) if t.num_rows]
    if not tables:
        return tag_counts(pa.table({"tags": pa.array([], pa.list_(pa.string()))}))
    merged = pa.concat_tables(tables).group_by("tag").aggregate([("n", "sum")])
    return pa.table({"tag": merged.column("tag"), "n_chunks": merged.column("n_sum").cast(pa.int64())}).sort_by("tag")


def embed_dtype(dtype: str | None, device: str) -> str:
    """The dtype tag embedding computes in: ``dtype``, or (None) bf16 where it is native on ``device``.

    Resolved where the model runs (an actor on a remote node may differ from the driver).
    """
    if dtype is not None:
        return dtype
    from atlas.hardware import native_bf16

    return "bfloat16" if native_bf16(device) else "float32"


class TagEmbedder:
    """Ray Data callable class: one sentence-transformers model per actor, batches of tags.

    bf16 runs as autocast over the fp32 weights (norms and softmax stay fp32); the output is
    normalised in fp32.
    """

    def __init__(self, model_path: str, device: str = "cpu", threads: int | None = None, batch_size: int = 256, dtype: str | None = None):
        import torch
        from sentence_transformers import SentenceTransformer

        if device == "cpu" and threads:
            torch.set_num_threads(threads)
        self.device_type = "cuda" if device == "gpu" else "cpu"
        self.model = SentenceTransformer(model_path, device=self.device_type)
        self.dtype = embed_dtype(dtype, device)
        self.batch_size = batch_size

    def __call__(self, batch: pa.Table) -> pa.Table:
        import torch

        texts = batch.column("tag").to_pylist()
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.dtype == "bfloat16"):
            emb = self.model.encode(texts, batch_size=self.batch_size, convert_to_tensor=True)
        emb = torch.nn.functional.normalize(emb.float(), dim=-1).cpu().numpy()
        return batch.append_column("embedding", from_matrix(emb))


def embed_tags_ds(
    counts: pa.Table,
    model: str,
    batch_size: int = 256,
    replicas: int = 1,
    cpus: float = 1.0,
    device: str = "cpu",
    dtype: str | None = None,
):
    """The unique tags of ``counts`` (``tag``, ``n_chunks``) embedded by :class:`TagEmbedder`
    actors: a lazy Ray Dataset of ``tag_embeddings`` rows, in no particular order. Publish it
    as it streams; never collect it on the driver at corpus scale (1M tags are 1.5 GB)."""
    import ray.data

    path = resolve_embedding_model(model)
    res: dict[str, Any] = {"num_gpus": 1} if device == "gpu" else {"num_cpus": cpus}
    threads = max(1, int(cpus)) if device == "cpu" else None
    n_blocks = max(replicas, -(-counts.num_rows // (batch_size * 8)))
    ds = ray.data.from_arrow(counts).repartition(n_blocks)
    return ds.map_batches(
        TagEmbedder,
        fn_constructor_kwargs={"model_path": path, "device": device, "threads": threads, "batch_size": batch_size, "dtype": dtype},
        batch_size=batch_size * 4,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=replicas),
        **res,
    )


def embed_tags(counts: pa.Table, model: str, batch_size: int = 256, replicas: int = 1, cpus: float = 1.0, device: str = "cpu", dtype: str | None = None) -> pa.Table:
    """:func:`embed_tags_ds` collected and sorted by tag (small tag sets: tests, notebooks)."""
    import ray

    if counts.num_rows == 0:
        return schemas.TAG_EMBEDDINGS.empty_table()
    out = embed_tags_ds(counts, model, batch_size, replicas, cpus, device, dtype)
    table = pa.concat_tables([t for t in ray.get(out.to_arrow_refs())])
    # Ray Data may reorder blocks; the rest of Stage 2 relies on tag order.
    return schemas.conform(table, schemas.TAG_EMBEDDINGS).sort_by("tag")


def read_tag_embeddings(version: "storage.Location", batch_rows: int = 65_536) -> pa.Table:
    """A published ``tag_embeddings`` version sorted by tag, with the embeddings in one
    contiguous float32 buffer.

    Reading the Parquet whole and sorting it holds the float data about four times over (1M
    384-d tags: 6 GiB); here the tag column is read and ranked first, then the embeddings are
    streamed in batches into their sorted rows of one preallocated matrix (one copy).
    """
    import pyarrow.dataset as pads

    # Both passes walk the same fragments in the same order, so row i of one is row i of the other.
    fragments = list(pads.dataset(version.path, filesystem=version.fs, format="parquet", partitioning=None).get_fragments())
    keys = pa.concat_tables([f.to_table(columns=["tag", "n_chunks"]) for f in fragments], promote_options="default") if fragments else schemas.TAG_EMBEDDINGS.empty_table()
    order = pc.sort_indices(keys, sort_keys=[("tag", "ascending")]).to_numpy()
    n = keys.num_rows
    if n == 0:
        return schemas.TAG_EMBEDDINGS.empty_table()
    rank = np.empty(n, np.int64)
    rank[order] = np.arange(n)
    x: np.ndarray | None = None
    offset = 0
    batches = (b for f in fragments for b in f.to_batches(columns=["embedding"], batch_size=batch_rows))
    for batch in batches:
        if batch.num_rows == 0:
            continue
        m = to_matrix(batch.column("embedding"))
        if x is None:
            x = np.empty((n, m.shape[1]), np.float32)
        x[rank[offset : offset + len(m)]] = m
        offset += len(m)
    if offset != n:
        raise ValueError(f"tag_embeddings at {version.uri}: {n} tags but {offset} embeddings (the version changed while it was read?)")
    sorted_keys = keys.take(order)
    return pa.table({"tag": sorted_keys.column("tag"), "n_chunks": sorted_keys.column("n_chunks"), "embedding": from_matrix(x)}, schema=schemas.TAG_EMBEDDINGS)
