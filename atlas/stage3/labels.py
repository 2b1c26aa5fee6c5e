"""Stage 2 tables -> Stage 3 training data.

The concept index is the library's concept ids sorted; the *library version* is a digest of
that list, so an annotator and every annotation it writes name the exact library whose
int32 indices they use (index i = row i of ``concepts`` sorted by ``concept_id``).
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


class LabelError(ValueError):
    pass


def concept_index(concept_ids: Iterable[str]) -> list[str]:
    ids = sorted(set(concept_ids))
    if not ids:
        raise LabelError("the concept library is empty: nothing to train an annotator on")
    return ids


def library_version(concept_ids: list[str]) -> str:
    """``lib-`` + sha256 of the sorted concept ids (12 hex digits)."""
    return "lib-" + hashlib.sha256("\n".join(concept_ids).encode("utf-8")).hexdigest()[:12]


@dataclass
class LabelledChunks:
    chunk_ids: list[str]
    doc_ids: list[str]
    texts: list[str]
    y: np.ndarray  # (n, n_concepts) uint8 multi-hot
    concept_ids: list[str]
    library_version: str

    def __len__(self) -> int:
        return len(self.chunk_ids)

    def subset(self, mask: np.ndarray) -> "LabelledChunks":
        idx = np.flatnonzero(mask)
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        return LabelledChunks(pick(self.chunk_ids), pick(self.doc_ids), pick(self.texts), self.y[idx], self.concept_ids, self.library_version)


def labelled_chunks(
    chunks: pa.Table,
    chunk_concepts: pa.Table,
    concept_ids: list[str] | None = None,
    labelled_chunk_ids: Iterable[str] | None = None,
) -> LabelledChunks:
    """Join ``chunks`` (chunk_id, doc_id, text) with Stage 2 ``chunk_concepts`` (one row per chunk x concept).

    ``labelled_chunk_ids``: the chunks the teacher looked at (e.g. the successfully tagged
    ones); those without a concept are negatives for every concept. Default: only chunks
    with at least one concept (then there are no all-negative chunks to learn from).
    ``concept_ids``: the library (the ``concepts`` table's ids); default: the ids in use.
    """
    for col in ("chunk_id", "concept_id"):
        if col not in chunk_concepts.column_names:
            raise LabelError(f"chunk_concepts lacks column {col!r}")
    ids = concept_index(concept_ids if concept_ids is not None else chunk_concepts.column("concept_id").to_pylist())
    pos = {c: i for i, c in enumerate(ids)}
    unknown = set(chunk_concepts.column("concept_id").to_pylist()) - pos.keys()
    if unknown:
        raise LabelError(f"chunk_concepts names concept(s) missing from the library: {sorted(unknown)[:5]}")
    wanted = set(labelled_chunk_ids) if labelled_chunk_ids is not None else set(chunk_concepts.column("chunk_id").to_pylist())
    chunks = chunks.filter(pc.is_in(chunks.column("chunk_id"), pa.array(sorted(wanted), pa.string()))).sort_by("chunk_id")
    chunk_ids = chunks.column("chunk_id").to_pylist()
    missing = wanted - set(chunk_ids)
    if missing:
        raise LabelError(f"{len(missing)} labelled chunk(s) are not in the chunks table, e.g. {sorted(missing)[0]!r}")
    row = {c: i for i, c in enumerate(chunk_ids)}
    y = np.zeros((len(chunk_ids), len(ids)), np.uint8)
    for cid, con in zip(chunk_concepts.column("chunk_id").to_pylist(), chunk_concepts.column("concept_id").to_pylist()):
        if cid in row:
            y[row[cid], pos[con]] = 1
    return LabelledChunks(chunk_ids, chunks.column("doc_id").to_pylist(), chunks.column("text").to_pylist(), y, ids, library_version(ids))


def split_of(chunk_ids: list[str], val_fraction: float, test_fraction: float, seed: int = 0) -> np.ndarray:
    """'train' / 'val' / 'test' per chunk from a hash of its id: stable when chunks are added."""
    u = np.array([zlib.crc32(f"{seed}:{c}".encode()) / 2**32 for c in chunk_ids])
    out = np.full(len(chunk_ids), "train", dtype=object)
    out[u < test_fraction + val_fraction] = "val"
    out[u < test_fraction] = "test"
    return out
