"""Does the tag judge discriminate? Real (chunk, tag) pairs against shuffled ones.

On chunks of the demo corpus, Stage 1's tagger (Gemma 3 270M, the Stage 1 prompt and JSON
schema) writes the tags. Every judge then rates

* real pairs: each chunk with its own tags, and
* shuffled pairs: each chunk with the tags of a chunk from *another document* (a rotation of
  the document-sorted chunk list by half its length, so no chunk keeps tags of its own article),

and the benchmark prints, per judge, the mean score of each group, the difference with a
bootstrap 95% CI (resampling chunks, since the pairs of one chunk are correlated) and the AUC
(the chance that a random real pair outscores a random shuffled one). Target for the judge
Stage 1 uses: difference >= 1.0 point with the CI above 0.

Judges (``--judges``, ``model-mode[:style]``): model ``gemma`` (Gemma 3 270M base, few-shot
completion) or ``smollm`` (SmolLM2-135M-Instruct, the same examples as chat turns); mode
``prob`` (expected score from P(answer) over 1..5, what Stage 1 uses) or ``sampled`` (one
greedy token constrained to 1..5, the old judge); style one of
``atlas.engine.prompts.JUDGE_STYLES`` (``rubric``: the first judge's five-point rubric and 8
examples; ``extremes``: 16 examples scored only 5 or 1, grouped by text; ``graded``: as
extremes plus a "3 = loosely related" example per text; ``question``: "Is this text about
<tag>? Answer 1 (no) to 5 (yes).").

Run:  python benchmarks/judge_discrimination.py [--chunks 80] [--tags-json /tmp/tags.json]
      [--judge-chunks 31] [--judges gemma-prob:extremes,smollm-prob:rubric]
(``--tags-json``: reuse the tags of an earlier run, written there on first use;
``--judge-chunks``: judge an evenly spaced subset of the tagged chunks.)

Judges also take mode ``calib``: contextual calibration (Zhao et al. 2021), P(k | text, tag)
divided by P(k | "N/A", tag) before the expected score, one extra prompt per distinct tag.

Measured 2026-12-03 on a quiet machine (vLLM CPU, fp32, load 1-2.4 on 2 cores; tags from the
Stage 1 tagger on 80 demo chunks, judged on 31 of them: 98 real / 98 shuffled pairs; total
145 s + 241 s for the two runs below, engines included):

| judge (model-mode:prompt) | real | shuffled | diff  | 95% CI (chunk bootstrap) | AUC  | pairs/s | P(1..5) mass |
| ------------------------- | ---- | -------- | ----- | ------------------------ | ---- | ------- | ------------ |
| gemma-prob:extremes       | 2.68 | 2.61     | 0.07  | [0.02, 0.13]             | 0.60 | 9.5     | 0.963        |
| gemma-prob:rubric         | 2.40 | 2.39     | 0.01  | [-0.01, 0.03]            | 0.54 | 8.6     | 0.890        |
| gemma-prob:graded         | 2.66 | 2.60     | 0.06  | [0.02, 0.10]             | 0.61 | 10.6    | 0.949        |
| gemma-prob:question       | 2.38 | 2.30     | 0.08  | [-0.01, 0.18]            | 0.59 | 7.2     | 0.993        |
| gemma-calib:extremes      | 3.25 | 3.21     | 0.05  | [0.03, 0.07]             | 0.62 | 12.9    | 0.963        |
| gemma-calib:question      | 3.15 | 3.11     | 0.03  | [0.01, 0.06]             | 0.59 | 5.6     | 0.993        |
| smollm-prob:rubric        | 2.48 | 2.46     | 0.02  | [0.01, 0.03]             | 0.55 | 7.1     | 0.879        |
| smollm-prob:extremes      | 2.40 | 2.26     | 0.14  | [0.10, 0.18]             | 0.66 | 5.4     | 0.962        |
| **smollm-prob:question**  | 2.97 | 2.76     | **0.21** | [0.14, 0.28]          | 0.68 | 4.2     | 0.925        |
| smollm-calib:extremes     | 3.18 | 3.13     | 0.06  | [0.04, 0.07]             | 0.65 | 7.3     | 0.962        |

SmolLM2-135M-Instruct asked "Is this text about <tag>? Answer 1 (no) to 5 (yes)." separates
real from shuffled pairs best (CI disjoint from the former default Gemma extremes judge's), so
it is the default (``judge.model``, ``judge.prompt``). Calibration narrows the spread instead
of widening it. No packaged tiny model comes near the 1.0-point target: the best AUC is 0.68,
i.e. the judges rank a real pair above a shuffled one only 68% of the time. A judge that meets
the target needs a larger model (``judge.model`` accepts any HF directory) or a GPU run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NULL_TEXT = "N/A"  # contextual calibration (Zhao et al. 2021, "Calibrate Before Use"): the content-free input
MODELS = {"gemma": "embedded:gemma3-270m", "smollm": "embedded:smollm2-135m-instruct"}


def pick_chunks(n: int):
    """n chunks spread over the 27 demo documents (a stride over doc-ordered paragraphs)."""
    from tests.engine_fixtures import demo_chunks

    t = demo_chunks(n_docs=27, per_doc=max(1, -(-n // 27) + 1))
    if t.num_rows < n:
        raise SystemExit(f"demo corpus gave only {t.num_rows} chunks, asked for {n}")
    step = t.num_rows / n
    t = t.take([int(i * step) for i in range(n)])
    return t.column("chunk_id").to_pylist(), t.column("doc_id").to_pylist(), t.column("text").to_pylist()


def engine_cfg(model: str, backend: str):
    from atlas.config import EngineConfig

    # 2048: the chat form of the 16-example prompts is ~1.3k tokens for SmolLM's template.
    return EngineConfig(model=model, backend=backend, max_model_len=2048, max_num_seqs=64, batch_size=32, kv_cache_gib=1.0)


def make_tags(texts: list[str], backend: str, be=None) -> tuple[list[list[str]], dict]:
    """Stage 1 tags for ``texts`` (same prompt, schema, sampling and normalisation as Stage 1)."""
    from atlas.config import Stage1Config
    from atlas.engine import Engine, Sampling, make_backend, prompts
    from atlas.stage1_tags import normalize_tags, parse_tags

    s1 = Stage1Config()
    cfg = engine_cfg(MODELS["gemma"], backend)
    eng = Engine(cfg)
    schema = prompts.tag_schema(s1.max_tags * 2)
    sampling = Sampling(
        max_tokens=s1.max_new_tokens, temperature=0.0, seed=cfg.seed, frequency_penalty=s1.frequency_penalty, json_schema=schema
    )
    own = be is None  # a Gemma engine the judges will use is passed in and stays open
    if own:
        be = make_backend(eng.model_dir, cfg)
    hit = None
    t0 = time.perf_counter()
    try:
        m0 = be.metrics() if hasattr(be, "metrics") else None
        res = be.generate([prompts.tag_prompt(t, eng.chat_template) for t in texts], sampling)
        if m0 is not None:
            from atlas.engine import metrics_delta

            hit = metrics_delta(m0, be.metrics())["prefix_cache_hit_rate"]
    finally:
        if own:
            be.close()
    tags, bad = [], 0
    for r in res:
        val, err = parse_tags(r.text, schema) if r.error is None else (None, r.error)
        t = normalize_tags(val, s1.max_tags, s1.max_tag_words) if val else []
        bad += not t
        tags.append(t)
    return tags, {"seconds": round(time.perf_counter() - t0, 1), "chunks_without_tags": bad, "prefix_cache_hit_rate": hit}


def derangement_across_docs(doc_ids: list[str]) -> list[int]:
    """perm[i] = a chunk of another document (rotate the doc-sorted order by half its length)."""
    order = sorted(range(len(doc_ids)), key=lambda i: (doc_ids[i], i))
    n = len(order)
    perm = [0] * n
    for k, i in enumerate(order):
        perm[i] = order[(k + n // 2) % n]
    clash = [i for i in range(n) if doc_ids[perm[i]] == doc_ids[i]]
    if clash:
        raise SystemExit(f"{len(clash)} shuffled chunks kept tags of their own document; use more documents")
    return perm


def run_judge(be, model: str, mode: str, pairs: list[tuple[int, str]], texts: list[str], style: str = "rubric") -> tuple[list[float | None], dict]:
    """Scores for (chunk index, tag) pairs; mode 'prob' (expected score) or 'sampled' (old
    judge); ``style``: the judge prompt (prompts.JUDGE_STYLES)."""
    from atlas.engine import Engine, Sampling, expected_score, parse_score_text, prompts

    eng = Engine(engine_cfg(model, be.name))
    template = eng.chat_template
    ps = [prompts.judge_prompt(texts[c], tag, template, style=style) for c, tag in pairs]
    if mode in ("prob", "calib"):
        sampling = Sampling(**prompts.judge_sampling_kwargs())
    else:
        sampling = Sampling(max_tokens=4, temperature=0.0, choice=tuple(prompts.judge_choices(template)))
    m0 = be.metrics() if hasattr(be, "metrics") else None
    t0 = time.perf_counter()
    res = be.generate(ps, sampling)
    null: dict[str, dict[str, float]] = {}
    if mode == "calib":  # the judge's answer prior for each tag, read on a content-free text
        distinct = sorted({tag for _, tag in pairs})
        nres = be.generate([prompts.judge_prompt(NULL_TEXT, tag, template, style=style) for tag in distinct], sampling)
        null = {tag: parse_score_text(r.text) for tag, r in zip(distinct, nres) if r.error is None}
    dt = time.perf_counter() - t0
    scores: list[float | None] = []
    errors, masses = [], []
    for (_, tag), r in zip(pairs, res):
        s = None
        if r.error is None:
            if mode in ("prob", "calib"):
                probs = parse_score_text(r.text)
                if mode == "calib" and tag in null:
                    probs = {k: v / max(null[tag][k], 1e-6) for k, v in probs.items()}
                s = expected_score(probs)
                masses.append(r.choice_mass)
            elif (r.text or "").strip() in prompts.JUDGE_CHOICES:
                s = float(r.text.strip())
        if s is None:
            errors.append(r.error or f"answer {r.text!r} not in 1..5")
        scores.append(s)
    info = {"seconds": round(dt, 1), "pairs/s": round(len(ps) / dt, 2) if dt else None, "errors": len(errors), "loadavg": round(os.getloadavg()[0], 1)}
    if m0 is not None:
        from atlas.engine import metrics_delta

        hr = metrics_delta(m0, be.metrics())["prefix_cache_hit_rate"]
        info["prefix_cache_hit_rate"] = None if hr is None else round(hr, 3)
    if errors:
        info["first_error"] = errors[0][:160]
    if masses:
        info["mean_choice_mass"] = round(sum(masses) / len(masses), 3)
    return scores, info


def cluster_bootstrap(real: dict[int, list[float]], shuf: dict[int, list[float]], reps: int, seed: int) -> tuple[float, float, float]:
    """Difference of means (real - shuffled) and its 95% CI, resampling chunks with replacement."""
    import numpy as np

    chunks = sorted(set(real) | set(shuf))
    rs = [(sum(real.get(c, [])), len(real.get(c, []))) for c in chunks]
    ss = [(sum(shuf.get(c, [])), len(shuf.get(c, []))) for c in chunks]
    rsum, rn = np.array([a for a, _ in rs]), np.array([b for _, b in rs])
    ssum, sn = np.array([a for a, _ in ss]), np.array([b for _, b in ss])
    diff = rsum.sum() / rn.sum() - ssum.sum() / sn.sum()
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(chunks), size=(reps, len(chunks)))
    boots = rsum[idx].sum(1) / np.maximum(rn[idx].sum(1), 1) - ssum[idx].sum(1) / np.maximum(sn[idx].sum(1), 1)
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return float(diff), float(lo), float(hi)


def auc(real: list[float], shuf: list[float]) -> float:
    """P(real > shuffled) + 0.5 P(tie) (Mann-Whitney U / (n_real * n_shuf))."""
    import numpy as np

    r, s = np.asarray(real), np.asarray(shuf)
    gt = (r[:, None] > s[None, :]).sum() + 0.5 * (r[:, None] == s[None, :]).sum()
    return float(gt / (len(r) * len(s)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=60)
    ap.add_argument("--judges", default="smollm-prob:question,smollm-prob:extremes,gemma-prob:extremes")
    ap.add_argument("--backend", default="vllm", choices=["vllm", "transformers"])
    ap.add_argument("--tags-json", default=None, help="reuse / store the tagger's output here")
    ap.add_argument("--judge-chunks", type=int, default=None, help="judge an evenly spaced subset of this many tagged chunks")
    ap.add_argument("--bootstrap", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from atlas.engine import make_backend, resolve_model

    t_start = time.perf_counter()
    ids, docs, texts = pick_chunks(args.chunks)
    tag_info: dict = {}
    engines: dict = {}  # model key -> open backend (the tagger's Gemma engine is reused by the Gemma judges)
    if args.tags_json and Path(args.tags_json).exists():
        saved = json.loads(Path(args.tags_json).read_text())
        if saved.get("chunk_ids") != ids:
            raise SystemExit(f"{args.tags_json} holds tags of other chunks; delete it or pick another path")
        tags = saved["tags"]
        tag_info = {"from": args.tags_json}
    else:
        if any(j.startswith("gemma-") for j in args.judges.split(",")):
            engines["gemma"] = make_backend(resolve_model(MODELS["gemma"]), engine_cfg(MODELS["gemma"], args.backend))
        tags, tag_info = make_tags(texts, args.backend, engines.get("gemma"))
        if args.tags_json:
            Path(args.tags_json).write_text(json.dumps({"chunk_ids": ids, "tags": tags}))
    if args.judge_chunks and args.judge_chunks < len(ids):
        keep = [int(i * len(ids) / args.judge_chunks) for i in range(args.judge_chunks)]
        ids, docs, texts, tags = ([x[i] for i in keep] for x in (ids, docs, texts, tags))
    perm = derangement_across_docs(docs)
    real = [(i, t) for i in range(len(ids)) for t in tags[i]]
    shuf = [(i, t) for i in range(len(ids)) for t in tags[perm[i]]]
    print(
        f"chunks={len(ids)} docs={len(set(docs))} real pairs={len(real)} shuffled pairs={len(shuf)} "
        f"mean tags/chunk={len(real) / len(ids):.2f} tagger={tag_info} backend={args.backend}",
        flush=True,
    )
    for i in range(3):
        print(f"  {ids[i]}: real {tags[i]} | shuffled (from {ids[perm[i]]}) {tags[perm[i]]}")

    judges = [j for j in args.judges.split(",") if j]
    from atlas.engine import prompts

    by_model: dict[str, list[tuple[str, str]]] = {}
    for j in judges:
        m, _, rest = j.partition("-")
        mode, _, style = rest.partition(":")
        style = style or "rubric"
        if m not in MODELS or mode not in ("prob", "calib", "sampled") or style not in prompts.JUDGE_STYLES:
            raise SystemExit(f"unknown judge {j!r} (model-mode[:style], style one of {prompts.JUDGE_STYLES})")
        by_model.setdefault(m, []).append((mode, style))
    rows = []
    for m, modes in by_model.items():
        cfg = engine_cfg(MODELS[m], args.backend)
        t0 = time.perf_counter()
        be = engines.pop(m, None) or make_backend(resolve_model(MODELS[m]), cfg)
        load = time.perf_counter() - t0
        try:
            for mode, style in modes:
                name = f"{m}-{mode}:{style}"
                # Chunk-ordered, so the real and shuffled pairs of one chunk share its text as a
                # cached prefix.
                allp = real + shuf
                order = sorted(range(len(allp)), key=lambda k: allp[k][0])
                sc_o, info = run_judge(be, MODELS[m], mode, [allp[k] for k in order], texts, style)
                sc = [None] * len(allp)
                for k, v in zip(order, sc_o):
                    sc[k] = v
                rs, ss = sc[: len(real)], sc[len(real) :]
                r_by: dict[int, list[float]] = {}
                s_by: dict[int, list[float]] = {}
                for (c, _), v in zip(real, rs):
                    if v is not None:
                        r_by.setdefault(c, []).append(v)
                for (c, _), v in zip(shuf, ss):
                    if v is not None:
                        s_by.setdefault(c, []).append(v)
                rv = [v for v in rs if v is not None]
                sv = [v for v in ss if v is not None]
                if not rv or not sv:
                    rows.append((name, float("nan"), float("nan"), float("nan"), float("nan"), float("nan"), float("nan"), info, load))
                    continue
                diff, lo, hi = cluster_bootstrap(r_by, s_by, args.bootstrap, args.seed)
                rows.append((name, sum(rv) / len(rv), sum(sv) / len(sv), diff, lo, hi, auc(rv, sv), info, load))
                print(f"  {name}: {rows[-1][:7]} {info} (engine load {load:.0f}s, loadavg {os.getloadavg()[0]:.1f})", flush=True)
        finally:
            be.close()

    print()
    hdr = f"{'judge':24s} {'real':>6s} {'shuffled':>8s} {'diff':>6s} {'95% CI (chunk bootstrap)':>25s} {'AUC':>5s} {'pairs/s':>8s} {'errors':>6s} {'P(1..5) mass':>12s} {'load':>5s}"
    print(hdr)
    print("-" * len(hdr))
    for name, r, s, d, lo, hi, a, info, _ in rows:
        mass = info.get("mean_choice_mass")
        print(
            f"{name:24s} {r:6.2f} {s:8.2f} {d:6.2f} {f'[{lo:.2f}, {hi:.2f}]':>25s} {a:5.2f} {info.get('pairs/s') or 0:8.2f} "
            f"{info['errors']:6d} {'' if mass is None else f'{mass:.3f}':>12s} {info['loadavg']:5.1f}"
        )
    print(f"\n(real pairs {len(real)}, shuffled pairs {len(shuf)}, {len(ids)} chunks, bootstrap reps {args.bootstrap}; target: diff >= 1.00 with CI above 0)")
    print("(prob judges: expected score over P(1..5) renormalised; 'P(1..5) mass' = raw probability the model put on the five answers)")
    print(f"total {time.perf_counter() - t_start:.0f}s, os.getloadavg()={tuple(round(x, 1) for x in os.getloadavg())} on {os.cpu_count()} cores")
    ok = [n for n, r, s, d, lo, hi, *_ in rows if not math.isnan(d) and d >= 1.0 and lo > 0]
    print(f"judges meeting the target: {ok or 'none'}")


if __name__ == "__main__":
    main()
