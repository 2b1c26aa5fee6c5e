"""Stage 1: tag chunks with the LLM engine, and validate the tags with an LLM judge.

Two :class:`atlas.stage.LLMStage` s. ``stage1_tags`` streams the published ``chunks`` through
the engine: a few-shot prompt per chunk asks for a JSON list of topical tags (JSON-schema
constrained); answers are normalised into ``chunk_tags``. ``stage1_judge`` rates every
(chunk, tag) pair 1-5 into ``tag_judgements``: from the judge model's next-token
probabilities over the answers "1".."5" (one engine step, no sampling) it keeps the expected
score, the five probabilities and the most probable answer. It then publishes per-chunk and
per-tag averages of the expected score and draws both distributions (paper Fig. 5) to
``<root>/plots/tag_judge.png``.

Generations go through the engine's request cache (a join inside Ray Data), so a rerun on
the same input reuses them, and an interrupted run resumes where its cache ends.
"""

from __future__ import annotations

import functools

import hashlib
import heapq
import io
import json
import re
import unicodedata
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from atlas import schemas
from atlas.config import RunConfig
from atlas.engine import Sampling, expected_score, parse_score_text, prompts
from atlas.stage import LLMStage, StageContext, collect, keep_rows, register
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
    val, err = prompts.load_json_answer(raw)
    if err:
        return None, err
    if not isinstance(val, list) or not all(isinstance(x, str) for x in val):
        return None, f"output is not a JSON list of strings: {raw[:80]!r}"
    if not (schema.get("minItems", 0) <= len(val) <= schema.get("maxItems", 10**9)):
        return None, f"output has {len(val)} items, schema allows {schema.get('minItems')}..{schema.get('maxItems')}"
    return val, None


def smallest(ds, k: int, column: str = "chunk_id", key: Callable[[str], str] | None = None) -> list[str]:
    """The ``k`` values of ``column`` with the smallest ``key`` (default: the value itself),
    streamed: each batch keeps its own k best, the driver a heap of k."""

    def best(batch: pa.Table) -> pa.Table:
        vals = batch.column(column).to_pylist()
        ranked = heapq.nsmallest(k, ((key(v) if key else v, v) for v in vals))
        return pa.table({"rank": pa.array([r for r, _ in ranked], pa.string()), "value": pa.array([v for _, v in ranked], pa.string())})

    cand: list[tuple[str, str]] = []
    for b in ds.select_columns([column]).map_batches(best, batch_format="pyarrow").iter_batches(batch_size=None, batch_format="pyarrow"):
        cand.extend(zip(b.column("rank").to_pylist(), b.column("value").to_pylist()))
        if len(cand) > 4 * k + 1024:
            cand = heapq.nsmallest(k, cand)
    return sorted(v for _, v in heapq.nsmallest(k, cand))


SMALL_SAMPLE = 50_000  # judge samples up to this many chunks attach texts by value, not by a join
SMALL_AGGREGATE = 200_000  # judgements up to this many rows are aggregated in one pyarrow group-by


def _attach(batch: pa.Table, texts: pa.Table) -> pa.Table:
    """Inner join of a batch with a small table carried by value (an index lookup: pyarrow's
    join does not carry list columns such as ``tags``)."""
    idx = pc.index_in(batch.column("chunk_id"), value_set=texts.column("chunk_id"))
    keep = pc.is_valid(idx)
    batch, idx = batch.filter(keep), idx.filter(keep)
    return batch.append_column("text", texts.column("text").take(idx))


def _sample_key(chunk_id: str) -> str:
    return hashlib.sha256(chunk_id.encode()).hexdigest()


@register
class TagStage(LLMStage):
    name = "stage1_tags"
    inputs = ("chunks",)
    outputs = ("chunk_tags",)
    output_schema = schemas.CHUNK_TAGS
    config_keys = ("stage1", "engine")

    def enabled(self, cfg: RunConfig) -> bool:
        return cfg.stage1.enabled

    def source(self, ctx: StageContext):
        ds = ctx.read("chunks").select_columns(["chunk_id", "doc_id", "text"])
        if self.cfg.stage1.max_chunks:
            ds = keep_rows(ds, "chunk_id", smallest(ds, self.cfg.stage1.max_chunks))
        return ds

    def expected_rows(self, ctx: StageContext) -> int | None:
        n = ctx.rows("chunks")
        m = ctx.cfg.stage1.max_chunks
        return min(n, m) if (n is not None and m) else n

    def _schema(self) -> dict:
        return prompts.tag_schema(self.cfg.stage1.max_tags * 2)  # let the model overshoot; normalisation caps

    def requests(self, batch: pa.Table) -> pa.Table:
        s1 = self.cfg.stage1
        sampling = Sampling(
            max_tokens=s1.max_new_tokens, temperature=s1.temperature, seed=self.cfg.engine.seed,
            frequency_penalty=s1.frequency_penalty, json_schema=self._schema(),
        ).key()
        template = self.engine.chat_template
        return pa.table(
            {
                "key": batch.column("chunk_id"),
                "doc_id": batch.column("doc_id"),
                "prompt": pa.array([prompts.tag_prompt(t, template) for t in batch.column("text").to_pylist()], pa.string()),
                "sampling": pa.array([sampling] * batch.num_rows, pa.string()),
            }
        )

    def parse(self, batch: pa.Table, answers: pa.Table) -> pa.Table:
        s1, schema = self.cfg.stage1, self._schema()
        tags_col: list[list[str]] = []
        errors: list[str | None] = []
        for cid, raw, err, finish in zip(
            answers.column("key").to_pylist(), answers.column("text").to_pylist(),
            answers.column("error").to_pylist(), answers.column("finish_reason").to_pylist(),
        ):
            tags: list[str] = []
            if err is None:
                val, err = parse_tags(raw, schema)
                if err is not None and finish == "length":
                    err = f"output cut at stage1.max_new_tokens={s1.max_new_tokens} before the JSON closed: {raw[:80]!r}"
                if val is not None:
                    tags = normalize_tags(val, s1.max_tags, s1.max_tag_words)
                    if not tags:
                        err = f"no usable tag after normalisation: {raw[:80]!r}"
                        tags = []
            tags_col.append(tags if err is None else [])
            errors.append(None if err is None else f"chunk {cid}: {err}")
        return pa.table(
            {
                "chunk_id": answers.column("key"),
                "doc_id": batch.column("doc_id"),
                "tags": pa.array(tags_col, pa.list_(pa.string())),
                "raw_output": answers.column("text"),
                "error": pa.array(errors, pa.string()),
                "model": pa.array([self.engine.model] * batch.num_rows, pa.string()),
                "request_hash": answers.column("request_hash"),
                "output_tokens": answers.column("output_tokens"),
                "cached": answers.column("cached"),
            }
        )


@register
class JudgeStage(LLMStage):
    name = "stage1_judge"
    inputs = ("chunk_tags", "chunks")
    outputs = ("tag_judgements", "tag_judge_by_chunk", "tag_judge_by_tag")
    output_schema = schemas.TAG_JUDGEMENTS
    config_keys = ("judge", "engine", "stage1.max_error_rate", "stage1.cache")

    def enabled(self, cfg: RunConfig) -> bool:
        return cfg.judge.enabled and cfg.stage1.enabled

    def model(self, cfg: RunConfig) -> str | None:
        return cfg.judge.model

    def source(self, ctx: StageContext):
        from atlas.engine.runner import join_partitions

        tags = ctx.read("chunk_tags").select_columns(["chunk_id", "tags", "error"])
        tags = tags.map_batches(lambda b: b.filter(pc.is_null(b.column("error"))).drop_columns(["error"]), batch_format="pyarrow")
        chunks = ctx.read("chunks").select_columns(["chunk_id", "text"])
        k = self.cfg.judge.sample_chunks
        if k is None or k > SMALL_SAMPLE:
            n = ctx.rows("chunk_tags") if k is None else k
            if k is not None:
                ids = smallest(tags, k, key=_sample_key)
                tags, chunks = keep_rows(tags, "chunk_id", ids), keep_rows(chunks, "chunk_id", ids)
            return tags.join(chunks, join_type="inner", num_partitions=join_partitions(n), on=("chunk_id",))
        # A deterministic sample spread over documents: the chunks with the smallest hash. A
        # sample this small is cheaper to attach by value than by a shuffle join: its texts
        # (k rows) ride along with the tasks.
        ids = smallest(tags, k, key=_sample_key)
        texts = collect(keep_rows(chunks, "chunk_id", ids), pa.schema({"chunk_id": pa.string(), "text": pa.string()}))
        return keep_rows(tags, "chunk_id", ids).map_batches(_attach, fn_kwargs={"texts": texts}, batch_format="pyarrow")

    def requests(self, batch: pa.Table) -> pa.Table:
        cids, pairs = [], []
        for cid, tlist, text in zip(batch.column("chunk_id").to_pylist(), batch.column("tags").to_pylist(), batch.column("text").to_pylist()):
            for tag in tlist or []:
                cids.append(cid)
                pairs.append((text, tag))
        req = judge_requests([f"{c}\t{t}" for c, (_, t) in zip(cids, pairs)], pairs, self.engine.chat_template, self.cfg.judge.prompt)
        return req.append_column("chunk_id", pa.array(cids, pa.string())).append_column(
            "tag", pa.array([t for _, t in pairs], pa.string()))

    def parse(self, batch: pa.Table, answers: pa.Table) -> pa.Table:
        cols = parse_judgements(answers.column("text").to_pylist(), answers.column("error").to_pylist())
        errors = [
            None if err is None else f"chunk {cid}, tag {tag!r}: {err}"
            for cid, tag, err in zip(batch.column("chunk_id").to_pylist(), batch.column("tag").to_pylist(), cols.pop("error"))
        ]
        return pa.table(
            {
                "chunk_id": batch.column("chunk_id"),
                "tag": batch.column("tag"),
                "expected_score": pa.array(cols["expected_score"], pa.float64()),
                "score": pa.array(cols["score"], pa.int8()),
                "answer_probs": pa.array(cols["answer_probs"], pa.list_(pa.float32())),
                "choice_mass": pa.array(cols["choice_mass"], pa.float32()),
                "raw_output": answers.column("text"),
                "error": pa.array(errors, pa.string()),
                "model": pa.array([self.engine.model] * batch.num_rows, pa.string()),
                "cached": answers.column("cached"),
            }
        )

    def finish(self, ctx: StageContext, published: dict) -> dict:
        from atlas import storage
        from atlas.engine.runner import join_partitions

        n_rows = published["rows"]
        if n_rows <= SMALL_AGGREGATE:
            # Small enough for one process: read three columns, one pyarrow group-by each.
            by_chunk, by_tag = aggregate_judgements(ctx.read_table("tag_judgements", ["chunk_id", "tag", "expected_score"]))
        else:
            j = ctx.read("tag_judgements").select_columns(["chunk_id", "tag", "expected_score"])
            n = join_partitions(n_rows)
            # Hash-partition by the group key, then one pyarrow group-by per block.
            by_chunk = j.repartition(n, keys=["chunk_id"]).map_batches(
                lambda b: aggregate_judgements(b)[0], batch_size=None, batch_format="pyarrow"
            )
            by_tag = j.repartition(n, keys=["tag"]).map_batches(
                lambda b: aggregate_judgements(b)[1], batch_size=None, batch_format="pyarrow"
            )
        pc_ = ctx.publish("tag_judge_by_chunk", by_chunk, schemas.TAG_JUDGE_BY_CHUNK, desc="stage1_judge → tag_judge_by_chunk")
        pt_ = ctx.publish("tag_judge_by_tag", by_tag, schemas.TAG_JUDGE_BY_TAG, desc="stage1_judge → tag_judge_by_tag")
        hc, mc = histogram(storage.table_path(ctx.root, "tag_judge_by_chunk"), "mean_score")
        ht, mt = histogram(storage.table_path(ctx.root, "tag_judge_by_tag"), "mean_score")
        _, ms = histogram(storage.table_path(ctx.root, "tag_judgements"), "expected_score")
        png = plot_judge_histograms(hc, ht, title=f"Stage 1 tag relevance (judge: {self.engine.model})")
        plot = ctx.root.join("plots", "tag_judge.png")
        storage.write_bytes_atomic(plot, png)
        return {
            "pairs": published["rows"],
            "chunks": pc_["rows"],
            "tags": pt_["rows"],
            "scored": published["rows"] - published["errors"],
            "mean_score": ms,  # of the expected score
            "judge_prompt": self.cfg.judge.prompt,
            "mean_chunk_score": mc,
            "mean_tag_score": mt,
            "plot": plot.uri,
        }


BINS = np.array([1 + 0.25 * i for i in range(17)])


def histogram(loc: Location, column: str) -> tuple[np.ndarray, float | None]:
    """Counts of ``column`` over :data:`BINS` and its mean (nulls ignored), scanning one
    column of a published table batch by batch (no Ray job, flat driver memory)."""
    import pyarrow.dataset as pads

    total, s, n = np.zeros(len(BINS) - 1, dtype=np.int64), 0.0, 0
    for b in pads.dataset(loc.path, filesystem=loc.fs, format="parquet").to_batches(columns=[column], batch_size=65536):
        v = b.column(0).drop_null().to_numpy(zero_copy_only=False).astype(float)
        total += np.histogram(v, bins=BINS)[0]
        s += float(v.sum())
        n += len(v)
    return total, (round(s / n, 4) if n else None)


def tag_chunks(root: Location, cfg: RunConfig) -> dict:
    """Run the tag stage on ``root`` (Ray must be initialised); returns its stats."""
    return _run_stage("stage1_tags", root, cfg)


def judge_tags(root: Location, cfg: RunConfig) -> dict:
    """Run the judge stage on ``root`` (Ray must be initialised); returns its stats."""
    return _run_stage("stage1_judge", root, cfg)


def _run_stage(name: str, root: Location, cfg: RunConfig) -> dict:
    from atlas.stage import REGISTRY

    cfg = cfg.with_run_id()
    return REGISTRY[name].run(StageContext(root, cfg, cfg.run_id or "", name))


def parse_judgements(texts: list[str | None], errors: list[str | None]) -> dict[str, list]:
    """Choice-scoring answers of the judge -> columns ``expected_score`` (sum of k * P(k) over
    k = 1..5, renormalised), ``score`` (the most probable answer), ``answer_probs`` (P(1..5)),
    ``choice_mass`` (raw probability the model put on the five answers) and ``error``."""
    out: dict[str, list] = {k: [] for k in ("expected_score", "score", "answer_probs", "choice_mass", "error")}
    for raw, err in zip(texts, errors):
        exp = score = probs = mass = None
        if err is None:
            try:
                d = parse_score_text(raw)
                if sorted(d) != sorted(prompts.JUDGE_CHOICES):
                    raise ValueError(f"scored answers {sorted(d)} are not 1..5")
                probs = [d[c] for c in prompts.JUDGE_CHOICES]
                exp = expected_score(probs)
                score = 1 + max(range(len(probs)), key=probs.__getitem__)
                mass = json.loads(raw).get("mass")
            except ValueError as e:
                err, exp, score, probs = f"judge output unusable: {e}", None, None, None
        for k, v in (("expected_score", exp), ("score", score), ("answer_probs", probs), ("choice_mass", mass), ("error", err)):
            out[k].append(v)
    return out


def judge_requests(keys: list[str], pairs: list[tuple[str, str]], chat_template, style: str) -> pa.Table:
    """Engine requests (key, prompt, sampling) rating (text, tag) ``pairs``: scored, not sampled
    (one engine step reads P(answer) over "1".."5" for each pair)."""
    sampling = Sampling(**prompts.judge_sampling_kwargs()).key()
    return pa.table({
        "key": pa.array(keys, pa.string()),
        "prompt": pa.array([prompts.judge_prompt(text, tag, chat_template, style=style) for text, tag in pairs], pa.string()),
        "sampling": pa.array([sampling] * len(pairs), pa.string()),
    })


def judge_pairs(engine: Any, pairs: list[tuple[str, str]], style: str, cache_root: Location | None = None) -> list[float | None]:
    """The judge as a function: expected relevance score (1-5) of each (text, tag or concept
    name) pair, None where the judge could not score it. Small in-memory lists (evaluation
    samples); the stage streams instead."""
    req = judge_requests([str(k) for k in range(len(pairs))], pairs, engine.chat_template, style)
    answers, _ = engine.generate(req, cache_root=cache_root)
    return parse_judgements(answers.column("text").to_pylist(), answers.column("error").to_pylist())["expected_score"]


def context_judge(ctx: Any) -> tuple[Any, str]:
    """The run's judge (section ``judge``) as a :func:`judge_pairs` callable over a stage
    context's engine and cache, and its name for reports ("<model>, prompt '<style>'")."""
    engine = ctx.engine(ctx.cfg.judge.model)
    style = ctx.cfg.judge.prompt
    return functools.partial(judge_pairs, engine, style=style, cache_root=ctx.root), f"{engine.model}, prompt {style!r}"


def aggregate_judgements(j: pa.Table) -> tuple[pa.Table, pa.Table]:
    """Per-chunk and per-tag means of the expected score (unscored pairs count in n_* but not
    in the mean). The stage applies it to hash partitions of ``tag_judgements`` (one group-by
    per block)."""

    def agg(key: str, count_name: str, schema: pa.Schema) -> pa.Table:
        v = "expected_score"
        g = j.select([key, v]).group_by(key).aggregate([(v, "count", pc.CountOptions(mode="all")), (v, "mean")])
        t = pa.table({key: g.column(key), count_name: g.column(f"{v}_count"), "mean_score": g.column(f"{v}_mean")})
        return schemas.conform(t.sort_by(key), schema)

    return agg("chunk_id", "n_tags", schemas.TAG_JUDGE_BY_CHUNK), agg("tag", "n_chunks", schemas.TAG_JUDGE_BY_TAG)


def plot_judge_histograms(chunk_hist: np.ndarray, tag_hist: np.ndarray, title: str = "Tag relevance") -> bytes:
    """Two histograms (per-chunk and per-tag average score over :data:`BINS`), paper Fig. 5
    style -> PNG bytes. Takes bin counts, so the values never sit on the driver."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), constrained_layout=True)
    centers = (BINS[:-1] + BINS[1:]) / 2
    for ax, hist, what, color in ((axes[0], chunk_hist, "chunk", "#4C72B0"), (axes[1], tag_hist, "tag", "#DD8452")):
        n = int(hist.sum())
        m = float((hist * centers).sum() / n) if n else float("nan")  # bin-centre estimate, for the marker
        ax.bar(BINS[:-1], hist, width=np.diff(BINS), align="edge", color=color, edgecolor="white")
        ax.axvline(m, color="black", linestyle="--", linewidth=1)
        ax.set_title(f"Average score per {what} (n={n}, mean≈{m:.2f})")
        ax.set_xlabel("mean relevance score (1-5)")
        ax.set_ylabel(f"{what}s")
        ax.set_xlim(1, 5)
    fig.suptitle(title)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def plot_judge_distributions(by_chunk: pa.Table, by_tag: pa.Table, title: str = "Tag relevance") -> bytes:
    """:func:`plot_judge_histograms` from small in-memory per-chunk / per-tag tables."""

    def hist(t: pa.Table) -> np.ndarray:
        v = t.column("mean_score").drop_null().to_numpy(zero_copy_only=False).astype(float)
        return np.histogram(v, bins=BINS)[0]

    return plot_judge_histograms(hist(by_chunk), hist(by_tag), title)
