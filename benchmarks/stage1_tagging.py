"""Stage 1 tagging throughput: vLLM (bare and inside Ray Data) vs a transformers baseline.

Same model (prepared embedded Gemma 3 270M unless --model), same few-shot prompts, same
JSON-schema constraint and sampling, on the same N (default 256) chunks of the demo corpus.
Engine start-up is timed apart from generation; rates are steady state (engine ready, first
batch to last):

  (a) bare vLLM ``LLM.generate`` in-process; prints vLLM's own prefix-cache hit rate
      (cached / queried prompt tokens) and the prefill / decode split of request time;
  (b) our Ray Data path: ``atlas.engine.runner.generate`` (map_batches with the engine actor),
      steady = from the actor's engine being ready to the last row, and end-to-end;
  (c) transformers ``generate`` at its best batch size from --hf-batch-sizes, swept on the
      first --hf-sweep-chunks of the same chunks (``--hf-full``: the best size then reruns
      on all N);

then the ratio (b)/(c) (target >= 5x) and os.getloadavg() after every phase. ``--quality-chunks``
chunks are also tagged with the previous prompt version (``prompts.tag_prompt_previous``,
when there is one) on the same engine: JSON
validity (schema-valid and closed before max_new_tokens) and mean tags per chunk after
Stage 1's normalisation, for the old and the current prompt side by side.

Run:  python benchmarks/stage1_tagging.py [--chunks 256] [--hf-batch-sizes 8,16,32,64]

``--quality`` instead runs the full Stage 1 (tag_chunks + judge_tags on a local Ray cluster)
for each tagging model in ``--models`` with the same judge, and prints the judge scores, the
measurement behind the default ``engine.model``.

Measured 2026-12-03 16:19-16:37 UTC on a quiet machine (load 1.9-2.3, 2 cores, fp32: this
CPU has no native bf16), 256 demo chunks, Gemma 3 270M, ``--hf-batch-sizes 8,16,32,64``:

| path | chunks/s | start-up s |
| --- | --- | --- |
| a) bare vLLM (prefix-cache hit rate 0.68, prefill 20% / decode 80% of request time) | 2.22 | 24.5 |
| b) Ray Data ``generate()`` steady (end-to-end 1.66) | 2.02 | 27.7 |
| c) transformers ``generate``, best of bs 8/16/32/64 (0.50/0.57/0.53/0.55) | 0.57 | 3.5 |

(b)/(c) = **3.52x** (target >= 5x: not met; 1.23x when vLLM ran emulated bf16). JSON valid
98.4%, 3.28 tags per chunk (transformers 100%, 3.98). ``--max-num-seqs 256`` instead of 64:
2.12 / 2.01 chunks/s, no gain. The work left per chunk is the ~140 uncached tokens of its
own text (439 prompt tokens, 297 served from the prefix cache) and ~16 output tokens; both
engines spend it in fp32 matmuls, so on this CPU the gap to transformers is about the
preamble that prefix caching skips. Closing it further needs fewer tokens per chunk (a
shorter preamble) or a GPU (``scripts/gpu_check.sh``).

Re-measured 2026-12-07 23:18-23:26 UTC on a host with native bf16 (AVX512-BF16; load 1.7-2.1;
``engine.dtype`` None resolved to bfloat16 for both engines), 256 chunks, ``--hf-batch-sizes 16,32``:
a) 3.40 chunks/s (hit rate 0.678, prefill 20% / decode 80%), b) steady 3.17 (end-to-end 2.49),
c) 0.94 (bs 32; bs 16: 0.90): (b)/(c) = **3.38x** (not met). bf16 speeds both engines ~1.6x, so the
ratio stays; decode is now the larger share of request time.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def bench_chunks(n: int) -> list[str]:
    from tests.engine_fixtures import demo_chunks

    texts = demo_chunks(n_docs=27, per_doc=max(8, -(-n // 27) + 2)).column("text").to_pylist()
    if len(texts) < n:
        raise SystemExit(f"demo corpus gave only {len(texts)} chunks, asked for {n}")
    step = len(texts) / n  # spread over documents
    return [texts[int(i * step)] for i in range(n)]


def la() -> float:
    return os.getloadavg()[0]


def tag_quality(results, schema: dict) -> dict:
    """JSON validity rate and mean tags per chunk (Stage 1's parsing and normalisation)."""
    from atlas.config import Stage1Config
    from atlas.stage1_tags import normalize_tags, parse_tags

    s1 = Stage1Config()
    valid, ntags = 0, 0
    for r in results:
        val, err = parse_tags(r.text, schema) if r.error is None else (None, r.error)
        if val is not None and r.finish_reason == "stop":
            valid += 1
            ntags += len(normalize_tags(val, s1.max_tags, s1.max_tag_words))
    n = len(results)
    return {
        "chunks": n,
        "json_valid": valid / n if n else float("nan"),
        "tags_per_chunk": ntags / n if n else float("nan"),
        "out_tokens_per_chunk": sum(r.output_tokens or 0 for r in results) / n if n else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=256)
    ap.add_argument("--model", default="embedded:gemma3-270m")
    ap.add_argument("--dtype", default=None, help="override engine.dtype (both engines)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="override engine.max_num_seqs")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="override engine.max_num_batched_tokens")
    ap.add_argument("--batch-size", type=int, default=None, help="rows per engine call (default: all chunks in one call)")
    ap.add_argument("--kv-block-size", type=int, default=None)
    ap.add_argument("--cpu-threads", type=int, default=None)
    ap.add_argument("--no-chunked-prefill", action="store_true")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--hf-batch-sizes", default="8,16,32,64", help="transformers batch sizes swept")
    ap.add_argument("--hf-sweep-chunks", type=int, default=64)
    ap.add_argument("--hf-full", action="store_true", help="rerun the best transformers batch size on all chunks")
    ap.add_argument("--quality-chunks", type=int, default=64, help="chunks tagged with the old prompt too (0: skip)")
    ap.add_argument("--skip", default="", help="comma list of a,b,c to skip")
    ap.add_argument("--quality", action="store_true", help="compare tagging models by judge score instead")
    ap.add_argument("--models", default="embedded:gemma3-270m,embedded:smollm2-135m-instruct")
    ap.add_argument("--judge", default=None, help="judge model (default: JudgeConfig().model)")
    args = ap.parse_args()
    if args.quality:
        return quality(args)

    import pyarrow as pa

    from atlas.config import EngineConfig, Stage1Config
    from atlas.engine import Engine, Sampling, make_backend, metrics_delta, prompts
    from atlas.engine.core import engine_dtype, kv_block_size

    skip = set(args.skip.split(",")) - {""}
    s1 = Stage1Config()
    upd = {
        k: v
        for k, v in dict(
            dtype=args.dtype,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_block_size=args.kv_block_size,
            cpu_threads=args.cpu_threads,
        ).items()
        if v is not None
    }
    if args.no_chunked_prefill:
        upd["chunked_prefill"] = False
    if args.no_prefix_caching:
        upd["prefix_caching"] = False
    cfg = EngineConfig(model=args.model, max_model_len=1024, kv_cache_gib=1.0).model_copy(update=upd)
    cfg = cfg.model_copy(update={"batch_size": args.batch_size or args.chunks})
    eng = Engine(cfg)
    texts = bench_chunks(args.chunks)
    ps = [prompts.tag_prompt(t, eng.chat_template) for t in texts]
    schema = prompts.tag_schema(s1.max_tags * 2)  # as Stage 1 asks
    sampling = Sampling(max_tokens=args.max_new_tokens, temperature=0.0, frequency_penalty=s1.frequency_penalty, json_schema=schema)
    rows: list[tuple] = []
    print(
        f"model={args.model} chunks={len(ps)} prompt={prompts.PROMPT_VERSION} max_new_tokens={args.max_new_tokens} "
        f"cores={os.cpu_count()} dtype={engine_dtype(cfg)} max_num_seqs={cfg.max_num_seqs} max_num_batched_tokens={cfg.max_num_batched_tokens} "
        f"batch_size={cfg.batch_size} kv_block_size={kv_block_size(cfg)} chunked_prefill={cfg.chunked_prefill} "
        f"prefix_caching={cfg.prefix_caching} cpu_threads={cfg.cpu_threads or 'auto'} loadavg={la():.1f}",
        flush=True,
    )
    stats: dict = {}
    quality_rows: list[tuple[str, dict]] = []

    # (a) bare vLLM
    if "a" not in skip:
        t0 = time.perf_counter()
        be = make_backend(eng.model_dir, cfg)
        load = time.perf_counter() - t0
        stats["prompt_tokens"] = sum(len(be.prompt_token_ids(p)) for p in ps) / len(ps)
        stats["preamble_tokens"] = len(be.prompt_token_ids(prompts.tag_prompt("x", eng.chat_template))) - 1
        # Same neutral warm-up as the Ray Data actor's (a few-shot prompt here would pre-fill the
        # prefix cache and favour the bare engine).
        be.generate(["Warm-up."], Sampling(max_tokens=1))
        m0 = be.metrics()
        t0 = time.perf_counter()
        res = be.generate(ps, sampling)
        dt = time.perf_counter() - t0
        stats["a"] = metrics_delta(m0, be.metrics())
        errs = sum(r.error is not None for r in res)
        rows.append(("a) bare vLLM LLM.generate", dt, len(ps), sum(r.output_tokens or 0 for r in res), load, errs, la()))
        quality_rows.append((f"{prompts.PROMPT_VERSION} (current)", tag_quality(res[: args.quality_chunks or len(res)], schema)))
        print(f"  a) {len(ps) / dt:.2f} chunks/s ({dt:.1f}s, start-up {load:.1f}s) engine stats {stats['a']} loadavg {la():.1f}", flush=True)
        old_prompt = getattr(prompts, "tag_prompt_previous", None)  # set when PROMPT_VERSION moves on
        if args.quality_chunks and old_prompt is not None:
            old = [old_prompt(t, eng.chat_template) for t in texts[: args.quality_chunks]]
            be.reset_prefix_cache()
            m0 = be.metrics()
            t0 = time.perf_counter()
            ores = be.generate(old, sampling)
            odt = time.perf_counter() - t0
            stats["a_old"] = metrics_delta(m0, be.metrics())
            q = tag_quality(ores, schema)
            q["chunks/s"] = len(old) / odt
            quality_rows.append((f"{getattr(prompts, 'PREVIOUS_PROMPT_VERSION', 'previous')} (old)", q))
            print(f"  a) old prompt: {len(old) / odt:.2f} chunks/s on {len(old)} chunks, engine stats {stats['a_old']}", flush=True)
        be.close()
        del be

    # (b) our Ray Data path
    if "b" not in skip:
        import ray

        from atlas.engine.runner import generate

        tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        ray.init(
            address="local", num_cpus=os.cpu_count(), object_store_memory=400 * 1024 * 1024, include_dashboard=False, _temp_dir=tmp, log_to_driver=False
        )
        try:
            reqs = pa.table({"key": [str(i) for i in range(len(ps))], "prompt": ps, "sampling": [sampling.key()] * len(ps)})
            t0 = time.perf_counter()
            wall0 = time.time()
            out, st = generate(reqs, cfg, eng.model_dir, eng.model_id, cache_root=None, use_cache=False)
            e2e = time.perf_counter() - t0
            steady = (st.finished_at - st.engine_ready_at) if st.engine_ready_at else e2e
            load = (st.engine_ready_at - wall0) if st.engine_ready_at else float("nan")
            rows.append(("b) Ray Data generate() (steady)", steady, len(ps), st.output_tokens, load, st.errors, la()))
            rows.append(("b) Ray Data generate() (end-to-end)", e2e, len(ps), st.output_tokens, 0.0, st.errors, la()))
            print(f"  b) steady {len(ps) / steady:.2f} chunks/s, e2e {e2e:.1f}s, start-up {load:.1f}s loadavg {la():.1f}", flush=True)
        finally:
            ray.shutdown()

    # (c) transformers baseline at its best batch size
    if "c" not in skip:
        t0 = time.perf_counter()
        hcfg = cfg.model_copy(update={"backend": "transformers"})
        hf = make_backend(eng.model_dir, hcfg)
        load = time.perf_counter() - t0
        sweep = {}
        sub = ps[: args.hf_sweep_chunks]
        for bs in [int(x) for x in args.hf_batch_sizes.split(",")]:
            hf.cfg = hcfg.model_copy(update={"batch_size": bs})
            hf.generate(sub[:1], Sampling(max_tokens=2))  # warm-up
            t0 = time.perf_counter()
            res = hf.generate(sub, sampling)
            sweep[bs] = (time.perf_counter() - t0, res, la())
            print(f"  c) batch_size={bs}: {len(sub) / sweep[bs][0]:.3f} chunks/s on {len(sub)} chunks (loadavg {sweep[bs][2]:.1f})", flush=True)
        best = min(sweep, key=lambda b: sweep[b][0])
        dt, res, lavg = sweep[best]
        n = len(sub)
        if args.hf_full and len(ps) > len(sub):
            hf.cfg = hcfg.model_copy(update={"batch_size": best})
            t0 = time.perf_counter()
            res = hf.generate(ps, sampling)
            dt, n, lavg = time.perf_counter() - t0, len(ps), la()
        rows.append((f"c) transformers generate (bs={best})", dt, n, sum(r.output_tokens or 0 for r in res), load, sum(r.error is not None for r in res), lavg))
        quality_rows.append((f"{prompts.PROMPT_VERSION} via transformers", tag_quality(res[: args.quality_chunks or len(res)], schema)))

    print()
    if "prompt_tokens" in stats:
        print(f"mean prompt length: {stats['prompt_tokens']:.0f} tokens, of which the shared preamble {stats['preamble_tokens']} (cached after the first prompt)")
    hdr = f"{'path':38s} {'seconds':>8s} {'chunks':>6s} {'chunks/s':>9s} {'out tok/s':>10s} {'out tok':>8s} {'start-up s':>10s} {'errors':>6s} {'loadavg':>7s}"
    print(hdr)
    print("-" * len(hdr))
    rate = {}
    for name, dt, n, tok, load, errs, lavg in rows:
        rate[name[:2]] = rate.get(name[:2]) or (n / dt, tok / dt)
        print(f"{name:38s} {dt:8.2f} {n:6d} {n / dt:9.2f} {tok / dt:10.1f} {tok:8d} {load:10.1f} {errs:6d} {lavg:7.1f}")
    print("(start-up: engine load + warm-up, not in the rates; loadavg: 1-minute load average at the end of each phase on")
    print(f" {os.cpu_count()} cores; above the core count other processes shared the CPUs and the figures are rough)")
    for key, label in (("a", "bare vLLM"), ("a_old", "bare vLLM, old prompt")):
        m = stats.get(key)
        if m:
            hr = m["prefix_cache_hit_rate"]
            ps_ = m["prefill_share"]
            print(
                f"{label}: prefix-cache hit rate {'n/a' if hr is None else f'{hr:.1%}'} ({m['prefix_cache_hits']:.0f} of "
                f"{m['prefix_cache_queries']:.0f} prompt tokens), prefill/decode split of request time "
                f"{'n/a' if ps_ is None else f'{ps_:.0%} / {1 - ps_:.0%}'} ({m['prefill_s']:.1f}s / {m['decode_s']:.1f}s summed over requests), "
                f"preemptions {m['preemptions']:.0f}"
            )
    print()
    if "a)" in rate and "c)" in rate:
        print(f"bare vLLM / transformers baseline (chunks/s): {rate['a)'][0] / rate['c)'][0]:.2f}x")
    if "b)" in rate and "c)" in rate:
        print(f"Ray Data path (steady) / transformers baseline (chunks/s): {rate['b)'][0] / rate['c)'][0]:.2f}x   (target >= 5x)")
    if "a)" in rate and "b)" in rate:
        print(f"Ray Data path (steady) / bare vLLM (chunks/s): {rate['b)'][0] / rate['a)'][0]:.2f}x")
    if quality_rows:
        print()
        print(f"{'tagging quality':34s} {'chunks':>6s} {'JSON valid':>10s} {'tags/chunk':>10s} {'out tok/chunk':>13s} {'chunks/s':>9s}")
        for name, q in quality_rows:
            cps = q.get("chunks/s")
            print(
                f"{name:34s} {q['chunks']:6d} {q['json_valid']:10.1%} {q['tags_per_chunk']:10.2f} {q['out_tokens_per_chunk']:13.1f} "
                f"{'' if cps is None else f'{cps:.2f}':>9s}"
            )
    print(f"\nos.getloadavg() at the end: {tuple(round(x, 1) for x in os.getloadavg())}")


def quality(args) -> None:
    import ray

    from atlas import storage
    from atlas.config import EngineConfig, JudgeConfig, RunConfig, Stage1Config
    from atlas.stage1_tags import judge_tags, tag_chunks
    from tests.engine_fixtures import demo_chunks

    tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    ray.init(address="local", num_cpus=os.cpu_count(), object_store_memory=400 * 1024 * 1024, include_dashboard=False, _temp_dir=tmp, log_to_driver=False)
    chunks = demo_chunks(n_docs=27, per_doc=8)
    step = chunks.num_rows / args.chunks
    chunks = chunks.take([int(i * step) for i in range(args.chunks)])
    judge = JudgeConfig(model=args.judge) if args.judge else JudgeConfig()
    results = []
    for model in args.models.split(","):
        root = storage.resolve(tempfile.mkdtemp(prefix="atlas-quality-"))
        storage.write_table(root, "chunks", chunks)
        cfg = RunConfig(
            engine=EngineConfig(model=model, max_model_len=1024, max_num_seqs=64, batch_size=64, kv_cache_gib=2.0),
            stage1=Stage1Config(),
            judge=judge.model_copy(update={"sample_chunks": None}),
        )
        ts = tag_chunks(root, cfg)
        js = judge_tags(root, cfg)
        tags = storage.read_table(root, "chunk_tags").to_pylist()
        distinct = len({t for r in tags for t in r["tags"]})
        results.append((model, ts, js, distinct))
        print(f"{model}: tag {ts}\n  judge {js}", flush=True)
        for r in tags[:6]:
            print(f"    {r['chunk_id']}: {r['tags']} {r['error'] or ''}")
    ray.shutdown()
    print()
    hdr = f"{'tagging model':34s} {'ok/rows':>8s} {'tags':>5s} {'distinct':>8s} {'pairs':>6s} {'mean':>6s} {'chunk avg':>9s} {'tag avg':>8s}"
    print(f"judge: {results[0][2]['model']}")
    print(hdr)
    print("-" * len(hdr))
    for model, ts, js, distinct in results:
        print(
            f"{model:34s} {ts['ok']:>3d}/{ts['rows']:<4d} {ts['tags']:5d} {distinct:8d} {js['pairs']:6d} "
            f"{js['mean_score'] or float('nan'):6.2f} {js['mean_chunk_score'] or float('nan'):9.2f} {js['mean_tag_score'] or float('nan'):8.2f}"
        )


if __name__ == "__main__":
    main()
