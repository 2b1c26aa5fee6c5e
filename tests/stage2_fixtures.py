"""Synthetic tagged chunks for the Stage 2 tests: distinct topics, a few tags each, and a
deterministic labeller (the real-engine labelling test is in tests/test_stage2.py, slow)."""

from __future__ import annotations

import json

import pyarrow as pa

from atlas import schemas
from atlas.stage2 import prompts

TOPICS: dict[str, list[str]] = {
    "volcanoes": ["volcano", "volcanic eruption", "lava flow", "volcanic crater", "magma chamber", "volcanic ash"],
    "football": ["association football", "football club", "soccer match", "football league", "goalkeeper", "football transfer"],
    "warships": ["battleship", "naval warship", "warship armour", "naval gunnery", "armoured cruiser", "navy fleet"],
    "highways": ["state highway", "interstate highway", "highway interchange", "road construction", "freeway", "toll road"],
    "music": ["rock album", "music single", "billboard chart", "rock band", "guitar solo", "record label"],
    "plants": ["photosynthesis", "chlorophyll", "chloroplast", "plant biology", "plant leaves", "carbon fixation"],
    "lobsters": ["lobster", "crustacean", "european lobster", "lobster fishing", "marine crustaceans", "shellfish"],
    "chess": ["chess", "chess opening", "chess grandmaster", "checkmate", "chess tournament", "chess endgame"],
    "religion": ["scientology", "church of scientology", "new religious movement", "religious sect", "cult controversy", "l ron hubbard"],
}
NEW_TOPIC = ("astronomy", ["galaxy", "telescope", "star cluster", "astronomer", "nebula", "planetary orbit"])
BASKETBALL = ("basketball", ["basketball", "basketball team", "basketball court", "slam dunk", "nba season", "point guard"])


def chunk_tags_for(topics: dict[str, list[str]], chunks_per_topic: int = 6, prefix: str = "") -> pa.Table:
    """Chunks carrying 2-3 tags of one topic each; tag i of a topic appears in more chunks than
    tag i+1, so each topic's first tag is its most frequent (its anchor)."""
    rows = []
    for t, (topic, tags) in enumerate(sorted(topics.items())):
        doc = f"{prefix}doc-{topic}"
        for c in range(chunks_per_topic):
            picked = [tags[0], tags[1 + c % (len(tags) - 1)]]
            if c % 2 == 0:
                picked.append(tags[1 + (c + 2) % (len(tags) - 1)])
            rows.append(
                dict(chunk_id=f"{doc}-{c:05d}", doc_id=doc, tags=sorted(set(picked)), raw_output=None, error=None,
                     model="synthetic", request_hash=f"{doc}-{c}", output_tokens=None, cached=False)
            )
    return schemas.conform(pa.Table.from_pylist(rows), schemas.CHUNK_TAGS)


def chunks_for(chunk_tags: pa.Table) -> pa.Table:
    ids = chunk_tags.column("chunk_id").to_pylist()
    tags = chunk_tags.column("tags").to_pylist()
    return pa.table({"chunk_id": ids, "text": [f"A passage about {', '.join(t)}." for t in tags]})


def topic_of(tag: str, topics: dict[str, list[str]]) -> str:
    return next(k for k, v in topics.items() if tag in v)


def make_labeller(names: dict[str, tuple[str, str]] | None = None):
    """Deterministic labeller with the engine's answer contract: the name is the cluster's first
    representative tag unless ``names`` maps one of its tags to (name, description)."""
    names = names or {}
    calls = []

    def labeller(reqs: pa.Table) -> pa.Table:
        texts = []
        for prompt in reqs.column("prompt").to_pylist():
            tags = prompts.query_tags(prompt)
            hit = next((names[t] for t in tags if t in names), None)
            name, desc = hit or (tags[0].title(), f"Passages about {tags[0]}.")
            texts.append(json.dumps({"name": name, "description": desc}))
        calls.append(reqs.num_rows)
        n = reqs.num_rows
        return pa.table(
            {"key": reqs.column("key"), "text": texts, "error": pa.array([None] * n, pa.string()),
             "finish_reason": ["stop"] * n, "request_hash": [None] * n, "cached": [False] * n}
        )

    labeller.calls = calls  # type: ignore[attr-defined]
    return labeller
