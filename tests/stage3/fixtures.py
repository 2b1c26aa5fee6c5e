"""A small planted-concept corpus for Stage 3 tests, in the Stage 2 table shapes.

Each chunk is filler words plus cue words of 1-2 planted concepts; the teacher labels
(``chunk_concepts``) are exactly the planted concepts, so a working annotator must recover them.
"""

from __future__ import annotations

import random

import pyarrow as pa

CONCEPTS = {
    "c-astronomy": "planet orbit telescope galaxy comet nebula star",
    "c-cooking": "recipe oven flour simmer garlic butter bake",
    "c-football": "goal striker penalty league midfield keeper match",
    "c-finance": "bond equity dividend interest inflation market credit",
    "c-rare": "zeppelin",
}
FILLER = "the a of and to in is was for on with as by at from that this it an be are or its".split()


def planted(n_chunks: int = 300, seed: int = 0, n_docs: int = 30) -> tuple[pa.Table, pa.Table, pa.Table]:
    """(chunks, chunk_concepts, concepts) tables; column names follow atlas.schemas."""
    rng = random.Random(seed)
    names = [c for c in CONCEPTS if c != "c-rare"]
    chunks, cc = [], []
    for i in range(n_chunks):
        doc = f"d{i % n_docs:03d}"
        k = rng.choice([1, 1, 2])
        chosen = rng.sample(names, k)
        if i == 7:
            chosen = ["c-rare"]  # one chunk only: too rare to train on
        words = [rng.choice(FILLER) for _ in range(40)]
        for c in chosen:
            words += rng.sample(CONCEPTS[c].split(), min(3, len(CONCEPTS[c].split())))
        rng.shuffle(words)
        cid = f"{doc}-{i:05d}"
        chunks.append({"chunk_id": cid, "doc_id": doc, "chunk_index": i, "text": " ".join(words), "n_tokens": len(words), "char_start": 0, "char_end": 1})
        for c in chosen:
            cc.append({"chunk_id": cid, "doc_id": doc, "concept_id": c, "tags": [c[2:]], "n_tags": 1})
    concepts = pa.table({"concept_id": list(CONCEPTS), "name": [c[2:] for c in CONCEPTS], "description": [f"about {c[2:]}" for c in CONCEPTS]})
    return pa.Table.from_pylist(chunks), pa.Table.from_pylist(cc), concepts
