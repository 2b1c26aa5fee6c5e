"""Tokens/s of the Ray Train + DeepSpeed trainer vs the single-process loop, per core.

Same model, same packed annotation-shard sequences (STAND-IN labels from the demo corpus),
same global batch, same cores (the single process gets workers x threads torch threads;
``--single-threads`` overrides). Prints tokens/s, tokens/s per core, their ratio (target >= 0.8x), each
one's share of the bf16 matmul peak measured in this run, and os.getloadavg().

    PYTHONPATH=. python benchmarks/train_throughput.py                 # CPU, 2 workers x 1 thread
    PYTHONPATH=. python benchmarks/train_throughput.py --gpu --preset bench25M --steps 30

Only the optimizer steps are timed (Ray Train start-up, data preparation and the first
``--warmup`` steps are excluded on both sides). Tokens/s come from each side's median step
time (the mean-based ratio is printed beside it); the single process runs once before and once
after the trainer, so drift on a shared host reaches both. Read the figures with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def matmul_peak(dtype, device: str, n: int, threads: int, reps: int = 10) -> float:
    """Achieved FLOP/s of an n x n x n matmul (the 'peak' the trainers are compared to)."""
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t)


def single_process(mcfg, tcfg, batches, steps: int, warmup: int, device: str, threads: int) -> list[float]:
    """Seconds of each timed optimizer step of the single-process loop."""
    import torch

    from model.loop import autocast_factory, make_optimizer, train_step
    from model.modeling import Steerling

    torch.set_num_threads(threads)
    torch.manual_seed(tcfg.seed)
    model = Steerling(mcfg).to(device)
    opt = make_optimizer(model, tcfg)
    ac = autocast_factory(tcfg.dtype, device)
    gen = torch.Generator(device=device).manual_seed(1)
    times = []
    for s in range(warmup + steps):
        t = time.perf_counter()
        b = {k: v.to(device) for k, v in batches[s % len(batches)].items()}
        train_step(model, opt, b, tcfg, s, warmup + steps, gen, ac)
        if device == "cuda":
            torch.cuda.synchronize()
        if s >= warmup:
            times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--single-threads", type=int, default=None,
                    help="torch threads of the single process (default: workers x threads, the same cores as the trainer; "
                         "1 thread on an otherwise idle 2-core host leaves Ray's own processes a free core the trainer never has)")
    ap.add_argument("--zero-stage", type=int, default=1)
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                    help="compute dtype of both sides (auto: bf16 where the device computes it natively)")
    ap.add_argument("--peak-n", type=int, default=1024)
    a = ap.parse_args()

    import ray
    import torch

    from atlas.cluster import ray_session
    from atlas.config import RayConfig
    from model.config import ModelConfig, TrainConfig
    from model.data import DataConfig, iter_batches, prepare, standin_annotations, write_annotation_run
    from model.flops import train_flops_per_token
    from model.loop import resolve_dtype
    from model.sweep import default_corpus
    from model.train import DistConfig, train

    device = "cuda" if a.gpu else "cpu"
    dtype = resolve_dtype(a.dtype, device)  # both sides run the same compute dtype
    n_known = 48
    mcfg = ModelConfig.preset(a.preset, n_known=max(n_known, ModelConfig.preset(a.preset).topk_known),
                              max_seq_len=max(a.seq_len, 64))
    tcfg = TrainConfig(steps=a.steps + a.warmup, batch_size=a.batch_size, seq_len=a.seq_len, dtype=dtype,
                       warmup_steps=1, eval_batches=1)
    tmp = tempfile.mkdtemp(prefix="bench-train-")
    ann, con = standin_annotations(default_corpus(), n_known)
    root = write_annotation_run(os.path.join(tmp, "shards"), ann, con)
    data = DataConfig(annotations=root, val_fraction=0.1)

    cores = a.workers * a.threads
    single_threads = a.single_threads or cores
    with ray_session(RayConfig(num_cpus=max(2, cores + 1), object_store_memory_mb=512)):
        prep = prepare(data, a.seq_len, 0, mcfg.n_known, mcfg.vocab_size)
        batches = list(iter_batches(prep.train, a.batch_size, mcfg.n_known))
        # The single process runs before and after the trainer, so drift on a shared host hits both sides.
        sp_steps = single_process(mcfg, tcfg, batches, a.steps, a.warmup, device, single_threads)
        dist = DistConfig(num_workers=a.workers, cpus_per_worker=a.threads, threads_per_worker=a.threads,
                          zero_stage=a.zero_stage, use_gpu=a.gpu, checkpoint_every=0)
        res = train(mcfg, tcfg, data, os.path.join(tmp, "run"), dist=dist, progress=False, tokenizer=prep.tokenizer)
        sp_steps += single_process(mcfg, tcfg, batches, a.steps, a.warmup, device, single_threads)
    import polars as pl

    steps = pl.read_parquet(os.path.join(tmp, "run", "metrics", "steps.parquet")).filter(pl.col("step") >= a.warmup)
    ds_steps = steps["step_s"].to_list()
    # Median step time: one descheduled step on a 2-core host moves a mean by several %.
    sp = tcfg.tokens_per_step / statistics.median(sp_steps)
    ds = tcfg.tokens_per_step / statistics.median(ds_steps)

    peak_threads = 1  # per core (CPU) / per device (GPU)
    peak_bf16 = matmul_peak(torch.bfloat16, device, a.peak_n, peak_threads)
    peak_fp32 = matmul_peak(torch.float32, device, a.peak_n, peak_threads)
    fpt = train_flops_per_token(mcfg, a.seq_len)
    unit = 1 if a.gpu else cores  # per core on CPU, per device on GPU (workers x GPUs)
    per_core_sp = sp / (1 if a.gpu else single_threads)
    per_core_ds = ds / unit
    out = {
        "model": a.preset, "params_total": sum(p.numel() for p in __import__("model.modeling", fromlist=["Steerling"]).Steerling(mcfg).parameters()),
        "batch": a.batch_size, "seq_len": a.seq_len, "dtype": dtype, "device": device,
        "workers": a.workers, "threads_per_worker": a.threads, "single_process_threads": single_threads, "zero_stage": a.zero_stage,
        "single_process_tokens_per_s": round(sp, 1), "single_process_per_core": round(per_core_sp, 1),
        "ray_deepspeed_tokens_per_s": round(ds, 1), "ray_deepspeed_per_core": round(per_core_ds, 1),
        "ratio_per_core": round(per_core_ds / per_core_sp, 3), "target_ratio": 0.8,
        "ratio_per_core_of_mean_step": round(statistics.fmean(sp_steps) / statistics.fmean(ds_steps) * (1 if a.gpu else single_threads / unit), 3),
        "ray_deepspeed_data_wait_share": round(steps["data_s"].sum() / steps["step_s"].sum(), 4),
        "timed_steps": {"single_process": len(sp_steps), "ray_deepspeed": len(ds_steps)},
        "single_process_per_core_before_after": [round(tcfg.tokens_per_step / statistics.median(half) / (1 if a.gpu else single_threads), 1)
                                                 for half in (sp_steps[:a.steps], sp_steps[a.steps:])],
        "bf16_matmul_peak_gflops_per_core": round(peak_bf16 / 1e9, 2),
        "fp32_matmul_peak_gflops_per_core": round(peak_fp32 / 1e9, 2),
        "single_process_share_of_bf16_peak": round(per_core_sp * fpt / peak_bf16, 4),
        "ray_deepspeed_share_of_bf16_peak": round(per_core_ds * fpt / peak_bf16, 4),
        # CPUs without native bf16 (no AMX / AVX512-BF16) emulate it: the bf16 "peak" can sit
        # below the fp32 one, so the fp32 shares are printed too
        "single_process_share_of_fp32_peak": round(per_core_sp * fpt / peak_fp32, 4),
        "ray_deepspeed_share_of_fp32_peak": round(per_core_ds * fpt / peak_fp32, 4),
        "train_flops_per_token": fpt, "ray_train_wall_s": round(res.final["train_s"], 1),
        "loadavg": os.getloadavg(), "cpu_count": os.cpu_count(),
    }
    print(json.dumps(out, indent=1))
    print(f"per-core tokens/s: Ray Train + DeepSpeed {per_core_ds:.1f} vs single process {per_core_sp:.1f} "
          f"-> {per_core_ds / per_core_sp:.2f}x (target >= 0.8x); loadavg {os.getloadavg()}")
    del ray


if __name__ == "__main__":
    main()
