"""Stage 1: tag chunks with the LLM engine, and validate the tags with an LLM judge.

``tag_chunks`` reads the published ``chunks`` table, asks the engine for a JSON list of
topical tags per chunk (few-shot prompt, JSON-schema constrained), normalises the tags and
publishes ``chunk_tags``. ``judge_tags`` rates every (chunk, tag) pair 1-5 (constrained to
the five answers), publishes ``tag_judgements`` plus per-chunk and per-tag averages, and
draws both distributions (paper Fig. 5) to ``<root>/plots/tag_judge.png``.

Generations go through the engine's request cache, so a rerun on the same input reuses them
and does not start the engine.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import time
import unicodedata
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from atlas import schemas, storage
from atlas.config import RunConfig
from atlas.engine import Engine, Sampling, prompts
from atlas.storage import Location

_PUNCT_EDGE = re.compile(r"^[\W_]+|[\W_]+$", re.UNICODE)
_INNER_PUNCT = re.compile(r"[\"'`“”‘’«»()\[\]{}<>*#|;:!?,]+")


def normalize_tag(tag: str, max_words: int, max_chars: int = 60) -> str | None:
    """Lowercase, strip quotes / punctuation, collapse whitespace; None if empty or over-long."""
    if not isinstance(tag, str):
        return None
    t = unicodedata.normalize("NFKC", tag).lower()
    t = _INNER_PUNCT.sub(" ", t)
    t = " ".join(t.split())
    t = _PUNCT_EDGE.sub("", t).strip()
    if not t or len(t) > max_chars or len(t.split()) > max_words:
        return None
    if not any(ch.isalpha() for ch in t):
        return None  # bare numbers / symbols are not topical tags
    return t


def normalize_tags(tags: list, max_tags: int, max_words: int) -> list[str]:
    out: list[str] = []
    seen: set[str] = set()
    for raw in tags:
        t = normalize_tag(raw, max_words)
        if t is not None and t not in seen:
            seen.add(t)
            out.append(t)
        if len(out) >= max_tags:
            break
    return out


def parse_tags(raw: str | None, schema: dict) -> tuple[list | None, str | None]:
    """Validate a raw answer against the tag schema -> (list, None) or (None, reason)."""
    if raw is None:
        return None, "no output"
    try:
        val = json.loads(raw)
    except ValueError as e:
        return None, f"output is not valid JSON ({e.msg} at char {e.pos}): {raw[:80]!r}"
    if not isinstance(val, list) or not all(isinstance(x, str) for x in val):
        return None, f"output is not a JSON list of strings: {raw[:80]!r}"
    if not (schema.get("minItems", 0) <= len(val) <= schema.get("maxItems", 10**9)):
        return None, f"output has {len(val)} items, schema allows {schema.get('minItems')}..{schema.get('maxItems')}"
    return val, None


def _engine_stats(stats) -> dict[str, Any]:
    return {
        "engine_started": stats.engine_started,
        "engine_seconds": round(stats.engine_seconds, 3),
        "generated": stats.generated,
    }


def _read_chunks(root: Location, limit: int | None) -> pa.Table:
    tbl = storage.read_table(root, "chunks", columns=["chunk_id", "doc_id", "text"]).sort_by("chunk_id")
    return tbl.slice(0, limit) if limit else tbl


def tag_chunks(root: Location, cfg: RunConfig) -> dict:
    """Tag the published ``chunks`` of ``root`` and publish ``chunk_tags``; returns stats."""
    import ray.data

    t0 = time.perf_counter()
    s1 = cfg.stage1
    engine = Engine(cfg.engine)
    chunks = _read_chunks(root, s1.max_chunks)
    schema = prompts.tag_schema(s1.max_tags * 2)  # let the model overshoot; normalisation caps
    sampling = Sampling(
        max_tokens=s1.max_new_tokens,
        temperature=s1.temperature,
        seed=cfg.engine.seed,
        frequency_penalty=s1.frequency_penalty,
        json_schema=schema,
    ).key()
    template = engine.chat_template
    texts = chunks.column("text").to_pylist()
    reqs = pa.table(
        {
            "key": chunks.column("chunk_id"),
            "prompt": pa.array([prompts.tag_prompt(t, template) for t in texts], pa.string()),
            "sampling": pa.array([sampling] * chunks.num_rows, pa.string()),
        }
    )
    out, stats = engine.generate(reqs, cache_root=root, use_cache=s1.cache)
    tags_col: list[list[str]] = []
    errors: list[str | None] = []
    for cid, raw, err, finish in zip(
        out.column("key").to_pylist(), out.column("text").to_pylist(), out.column("error").to_pylist(), out.column("finish_reason").to_pylist()
    ):
        if err is None:
            val, err = parse_tags(raw, schema)
            if err is not None and finish == "length":
                err = f"output cut at stage1.max_new_tokens={s1.max_new_tokens} before the JSON closed: {raw[:80]!r}"
            if val is not None:
                tags = normalize_tags(val, s1.max_tags, s1.max_tag_words)
                if not tags:
                    err = f"no usable tag after normalisation: {raw[:80]!r}"
                tags_col.append(tags if not err else [])
            else:
                tags_col.append([])
        else:
            tags_col.append([])
        errors.append(None if err is None else f"chunk {cid}: {err}")
    table = pa.table(
        {
            "chunk_id": chunks.column("chunk_id"),
            "doc_id": chunks.column("doc_id"),
            "tags": pa.array(tags_col, pa.list_(pa.string())),
            "raw_output": out.column("text"),
            "error": pa.array(errors, pa.string()),
            "model": pa.array([engine.model] * chunks.num_rows, pa.string()),
            "request_hash": out.column("request_hash"),
            "output_tokens": out.column("output_tokens"),
            "cached": out.column("cached"),
        }
    )
    table = schemas.conform(table, schemas.CHUNK_TAGS)
    storage.write_dataset(root, "chunk_tags", ray.data.from_arrow(table), schema=schemas.CHUNK_TAGS)
    n_err = sum(e is not None for e in errors)
    return {
        "rows": table.num_rows,
        "ok": table.num_rows - n_err,
        "errors": n_err,
        "cached": stats.cached,
        "seconds": round(time.perf_counter() - t0, 3),
        "output_tokens": stats.output_tokens,
        "tags": int(sum(len(t) for t in tags_col)),
        "model": engine.model,
        **_engine_stats(stats),
    }


def judge_tags(root: Location, cfg: RunConfig) -> dict:
    """Rate each (chunk, tag) of the published ``chunk_tags`` 1-5 with the judge model."""
    import ray.data

    t0 = time.perf_counter()
    jc = cfg.judge
    engine = Engine(cfg.engine, model=jc.model)
    tags = storage.read_table(root, "chunk_tags", columns=["chunk_id", "tags", "error"])
    tags = tags.filter(pc.is_null(tags.column("error")))
    if jc.sample_chunks is not None and tags.num_rows > jc.sample_chunks:
        # A deterministic sample spread over documents: the chunks with the smallest hash.
        order = sorted(range(tags.num_rows), key=lambda i: hashlib.sha256(tags.column("chunk_id")[i].as_py().encode()).hexdigest())
        tags = tags.take(sorted(order[: jc.sample_chunks]))
    tags = tags.sort_by("chunk_id")
    chunk_ids = set(tags.column("chunk_id").to_pylist())
    chunks = _read_chunks(root, None)
    text_of = {c: t for c, t in zip(chunks.column("chunk_id").to_pylist(), chunks.column("text").to_pylist()) if c in chunk_ids}
    template = engine.chat_template
    choices = prompts.judge_choices(template)
    sampling = Sampling(max_tokens=jc.max_new_tokens, temperature=0.0, seed=cfg.engine.seed, choice=tuple(choices)).key()
    pairs: list[tuple[str, str]] = []
    for cid, tlist in zip(tags.column("chunk_id").to_pylist(), tags.column("tags").to_pylist()):
        for tag in tlist or []:
            pairs.append((cid, tag))
    reqs = pa.table(
        {
            "key": pa.array([f"{c}\t{t}" for c, t in pairs], pa.string()),
            "prompt": pa.array([prompts.judge_prompt(text_of[c], t, template) for c, t in pairs], pa.string()),
            "sampling": pa.array([sampling] * len(pairs), pa.string()),
        }
    )
    out, stats = engine.generate(reqs, cache_root=root, use_cache=cfg.stage1.cache)
    scores: list[int | None] = []
    errors: list[str | None] = []
    for (cid, tag), raw, err in zip(pairs, out.column("text").to_pylist(), out.column("error").to_pylist()):
        score = None
        if err is None:
            s = (raw or "").strip()
            if s in prompts.JUDGE_CHOICES:
                score = int(s)
            else:
                err = f"judge answer {raw!r} is not one of 1..5"
        scores.append(score)
        errors.append(None if err is None else f"chunk {cid}, tag {tag!r}: {err}")
    judgements = schemas.conform(
        pa.table(
            {
                "chunk_id": pa.array([c for c, _ in pairs], pa.string()),
                "tag": pa.array([t for _, t in pairs], pa.string()),
                "score": pa.array(scores, pa.int8()),
                "raw_output": out.column("text"),
                "error": pa.array(errors, pa.string()),
                "model": pa.array([engine.model] * len(pairs), pa.string()),
            }
        ),
        schemas.TAG_JUDGEMENTS,
    )
    by_chunk, by_tag = aggregate_judgements(judgements)
    storage.write_dataset(root, "tag_judgements", ray.data.from_arrow(judgements), schema=schemas.TAG_JUDGEMENTS)
    storage.write_table(root, "tag_judge_by_chunk", by_chunk)
    storage.write_table(root, "tag_judge_by_tag", by_tag)
    png = plot_judge_distributions(by_chunk, by_tag, title=f"Stage 1 tag relevance (judge: {engine.model})")
    storage.write_bytes_atomic(root.join("plots", "tag_judge.png"), png)
    valid = [s for s in scores if s is not None]
    return {
        "pairs": len(pairs),
        "chunks": len(chunk_ids),
        "scored": len(valid),
        "errors": len(pairs) - len(valid),
        "cached": stats.cached,
        "mean_score": round(sum(valid) / len(valid), 4) if valid else None,
        "mean_chunk_score": _mean(by_chunk.column("mean_score").to_pylist()),
        "mean_tag_score": _mean(by_tag.column("mean_score").to_pylist()),
        "output_tokens": stats.output_tokens,
        "seconds": round(time.perf_counter() - t0, 3),
        "model": engine.model,
        "plot": root.join("plots", "tag_judge.png").uri,
        **_engine_stats(stats),
    }


def _mean(xs: list) -> float | None:
    v = [x for x in xs if x is not None]
    return round(sum(v) / len(v), 4) if v else None


def aggregate_judgements(j: pa.Table) -> tuple[pa.Table, pa.Table]:
    """Per-chunk and per-tag mean scores (unscored pairs count in n_* but not in the mean)."""
    by_c: dict[str, list] = {}
    by_t: dict[str, list] = {}
    for cid, tag, s in zip(j.column("chunk_id").to_pylist(), j.column("tag").to_pylist(), j.column("score").to_pylist()):
        by_c.setdefault(cid, []).append(s)
        by_t.setdefault(tag, []).append(s)

    def mean(v: list) -> float | None:
        v = [x for x in v if x is not None]
        return sum(v) / len(v) if v else None

    chunk_t = pa.table(
        {
            "chunk_id": pa.array(sorted(by_c), pa.string()),
            "n_tags": pa.array([len(by_c[c]) for c in sorted(by_c)], pa.int32()),
            "mean_score": pa.array([mean(by_c[c]) for c in sorted(by_c)], pa.float64()),
        }
    )
    tag_t = pa.table(
        {
            "tag": pa.array(sorted(by_t), pa.string()),
            "n_chunks": pa.array([len(by_t[t]) for t in sorted(by_t)], pa.int32()),
            "mean_score": pa.array([mean(by_t[t]) for t in sorted(by_t)], pa.float64()),
        }
    )
    return schemas.conform(chunk_t, schemas.TAG_JUDGE_BY_CHUNK), schemas.conform(tag_t, schemas.TAG_JUDGE_BY_TAG)


def plot_judge_distributions(by_chunk: pa.Table, by_tag: pa.Table, title: str = "Tag relevance") -> bytes:
    """Two histograms (per-chunk and per-tag average score, 1..5), paper Fig. 5 style -> PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), constrained_layout=True)
    bins = [1 + 0.25 * i for i in range(17)]
    for ax, tbl, what, color in (
        (axes[0], by_chunk, "chunk", "#4C72B0"),
        (axes[1], by_tag, "tag", "#DD8452"),
    ):
        vals = [v for v in tbl.column("mean_score").to_pylist() if v is not None]
        ax.hist(vals, bins=bins, color=color, edgecolor="white")
        m = sum(vals) / len(vals) if vals else float("nan")
        ax.axvline(m, color="black", linestyle="--", linewidth=1)
        ax.set_title(f"Average score per {what} (n={len(vals)}, mean={m:.2f})")
        ax.set_xlabel("mean relevance score (1-5)")
        ax.set_ylabel(f"{what}s")
        ax.set_xlim(1, 5)
    fig.suptitle(title)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()
