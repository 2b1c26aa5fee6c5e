"""LLM labelling of the kept clusters: a concept name and a one-sentence description.

Same shape as every LLM stage: :func:`requests` (one row per kept cluster: ``key``,
``prompt``, ``sampling``) -> a labeller (the engine layer: request cache + Ray Data engine
actors; or, in unit tests, any callable with the same contract) -> :func:`parse`. A cluster
whose answer is unusable keeps a row with ``error`` naming the cluster and the reason; the
concept is still published, named by its anchor tag, with ``label_error`` set.
"""

from __future__ import annotations

from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc

from atlas import schemas
from atlas.engine import Sampling
from atlas.engine.prompts import load_json_answer
from atlas.stage2 import prompts

# requests (key, prompt, sampling) -> answers (key, text, error, finish_reason, request_hash, cached)
Labeller = Callable[[pa.Table], pa.Table]


def engine_labeller(engine, cache_root=None, use_cache: bool = True) -> Labeller:
    """The real labeller: the shared engine layer (cache, Ray Data actors, per-row errors)."""

    def call(reqs: pa.Table) -> pa.Table:
        out, _stats = engine.generate(reqs, cache_root=cache_root, use_cache=use_cache)
        return out

    return call


def example_tags(clusters: pa.Table) -> list[str]:
    """The tags whose chunks may serve as examples: the first three representative tags of
    every kept cluster."""
    kept = clusters.filter(clusters.column("kept"))
    return sorted({t for r in kept.column("representative_tags").to_pylist() for t in r[:3]})


def candidate_rows(batch: pa.Table, wanted: list[str], n: int) -> pa.Table:
    """One ``chunk_tags`` batch reduced to what :func:`example_chunks` can pick from it: per
    wanted tag, its ``n`` smallest chunk ids (as rows with that one tag). Applied per batch in
    Ray Data, so the driver receives at most n rows per tag and batch, never the table."""
    flat = pa.table(
        {
            "chunk_id": pc.take(batch.column("chunk_id"), pc.list_parent_indices(batch.column("tags"))),
            "tag": pc.list_flatten(batch.column("tags")),
        }
    )
    flat = flat.filter(pc.is_in(flat.column("tag"), pa.array(wanted, pa.string()))).sort_by([("tag", "ascending"), ("chunk_id", "ascending")])
    ids, tags, seen = [], [], {}
    for cid, tag in zip(flat.column("chunk_id").to_pylist(), flat.column("tag").to_pylist()):
        if seen.get(tag, 0) < n:
            seen[tag] = seen.get(tag, 0) + 1
            ids.append(cid)
            tags.append([tag])
    return pa.table({"chunk_id": pa.array(ids, pa.string()), "tags": pa.array(tags, pa.list_(pa.string()))})


def example_chunks(clusters: pa.Table, chunk_tags: pa.Table, chunks: pa.Table, n: int, max_chars: int) -> dict[int, list[str]]:
    """Up to ``n`` example passages per kept cluster: chunks (smallest ids first) carrying its
    representative tags, best-ranked tag first."""
    if n <= 0 or chunk_tags.num_rows == 0:
        return {}
    kept = clusters.filter(clusters.column("kept"))
    reps = {int(c): r for c, r in zip(kept.column("cluster_id").to_pylist(), kept.column("representative_tags").to_pylist())}
    flat = candidate_rows(chunk_tags, example_tags(clusters), n)
    by_tag: dict[str, list[str]] = {}
    for cid, tags in zip(flat.column("chunk_id").to_pylist(), flat.column("tags").to_pylist()):
        by_tag.setdefault(tags[0], []).append(cid)
    need = {c for lst in by_tag.values() for c in lst}
    sub = chunks.filter(pc.is_in(chunks.column("chunk_id"), pa.array(sorted(need), pa.string())))
    text_of = dict(zip(sub.column("chunk_id").to_pylist(), sub.column("text").to_pylist()))
    out: dict[int, list[str]] = {}
    for cid, r in reps.items():
        picked: list[str] = []
        for t in r[:3]:
            for ch in by_tag.get(t, []):
                if ch not in picked and ch in text_of:
                    picked.append(ch)
        out[cid] = [text_of[c][:max_chars] for c in picked[:n]]
    return out


def sampling_key(cfg, seed: int = 0) -> str:
    return Sampling(max_tokens=cfg.label_max_new_tokens, temperature=0.0, seed=seed, json_schema=prompts.label_schema()).key()


def requests(clusters: pa.Table, examples: dict[int, list[str]], cfg, chat_template=None, seed: int = 0) -> pa.Table:
    """One labelling request per kept cluster (``cfg``: Stage2Config)."""
    kept = clusters.filter(clusters.column("kept"))
    skey = sampling_key(cfg, seed)
    ids = kept.column("cluster_id").to_pylist()
    reps = kept.column("representative_tags").to_pylist()
    return pa.table(
        {
            "key": pa.array([str(c) for c in ids], pa.string()),
            "prompt": pa.array(
                [prompts.label_prompt(r[: cfg.label_tags], examples.get(c, []), chat_template) for c, r in zip(ids, reps)], pa.string()
            ),
            "sampling": pa.array([skey] * len(ids), pa.string()),
        }
    )


def parse_label(raw: str | None) -> tuple[dict | None, str | None]:
    val, err = load_json_answer(raw)
    if err:
        return None, err
    if not isinstance(val, dict) or not isinstance(val.get("name"), str) or not isinstance(val.get("description"), str):
        return None, f"output is not an object with string name and description: {raw[:80]!r}"
    name, desc = " ".join(val["name"].split()), " ".join(val["description"].split())
    if not name:
        return None, f"empty name: {raw[:80]!r}"
    return {"name": name, "description": desc or None}, None


def parse(reqs: pa.Table, answers: pa.Table, model: str) -> pa.Table:
    """Answers (joined on ``key``) -> ``cluster_labels``; bad rows get an error naming the cluster."""
    by_key = {k: i for i, k in enumerate(answers.column("key").to_pylist())}
    cols = {c: answers.column(c).to_pylist() for c in ("text", "error") if c in answers.column_names}
    finish = answers.column("finish_reason").to_pylist() if "finish_reason" in answers.column_names else [None] * answers.num_rows
    hashes = answers.column("request_hash").to_pylist() if "request_hash" in answers.column_names else [None] * answers.num_rows
    cached = answers.column("cached").to_pylist() if "cached" in answers.column_names else [False] * answers.num_rows
    rows = []
    for key in reqs.column("key").to_pylist():
        i = by_key.get(key)
        if i is None:
            rows.append(dict(cluster_id=int(key), name=None, description=None, raw_output=None, error=f"cluster {key}: labeller returned no answer", model=model, request_hash=None, cached=False))
            continue
        raw, err = cols["text"][i], cols.get("error", [None] * answers.num_rows)[i]
        val = None
        if err is None:
            val, err = parse_label(raw)
            if err is not None and finish[i] == "length":
                err = f"output cut at stage2.label_max_new_tokens before the JSON closed: {(raw or '')[:80]!r}"
        rows.append(
            dict(
                cluster_id=int(key),
                name=val["name"] if val else None,
                description=val["description"] if val else None,
                raw_output=raw,
                error=None if err is None else f"cluster {key}: {err}",
                model=model,
                request_hash=hashes[i],
                cached=bool(cached[i]),
            )
        )
    return pa.Table.from_pylist(rows, schema=schemas.CLUSTER_LABELS)


def label_clusters(clusters: pa.Table, examples: dict[int, list[str]], labeller: Labeller, cfg, model: str, chat_template=None, seed: int = 0) -> pa.Table:
    reqs = requests(clusters, examples, cfg, chat_template, seed)
    if reqs.num_rows == 0:
        return schemas.CLUSTER_LABELS.empty_table()
    return parse(reqs, labeller(reqs), model)
