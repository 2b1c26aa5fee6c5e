"""Training-step cost of Steerling on this machine: CDLM vs CDLM+Concept.

Prints, for two backbone sizes, the median step time and tokens/s of the full training
step (forward, all losses, backward, AdamW) in the host's fast dtype (bf16 autocast where bf16
is native, else fp32: model.loop.resolve_dtype); the concept module's
step-time overhead as a ratio; how that overhead grows with the concept counts; and the
achieved FLOP/s as a share of a matmul peak in that dtype measured in the same run.

Claims checked: overhead <= 10% for a ~25M backbone with 2,000 known / 6,000 unknown
concepts; achieved FLOP/s >= 40% of the matmul peak.

Batches are random tokens with random chunk labels (2% positive): step cost does not
depend on the text. Usage: python benchmarks/model_step.py [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.config import ModelConfig, TrainConfig  # noqa: E402
from model.flops import attended_keys, count_params  # noqa: E402
from model.loop import autocast_factory, make_optimizer, resolve_dtype, train_step  # noqa: E402
from model.modeling import Steerling  # noqa: E402

DTYPE = resolve_dtype("auto", "cpu")  # the dtype training uses on this host


def matmul_peak(dtype: torch.dtype, n: int = 2048, reps: int = 20) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(3):  # best of three timed groups: the machine may be shared
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        best = min(best, (time.perf_counter() - t) / reps)
    return 2 * n**3 / best


class Peak:
    """Matmul peak in the compute dtype (``best``) and in the other one, re-measured between
    sections; the max is the denominator (the machine may be shared, so a single measurement
    can land in a busy moment)."""

    def __init__(self):
        self.bf16 = self.fp32 = 0.0

    @property
    def best(self) -> float:
        return self.bf16 if DTYPE == "bf16" else self.fp32

    def update(self) -> None:
        # Emulated bf16 (no AVX512-BF16/AMX) is ~100x slower: a small matmul suffices there.
        self.bf16 = max(self.bf16, matmul_peak(torch.bfloat16) if DTYPE == "bf16" else matmul_peak(torch.bfloat16, n=512, reps=1))
        self.fp32 = max(self.fp32, matmul_peak(torch.float32, reps=5))


def executed_flops_per_token(cfg: ModelConfig, T: int, masked: float = 0.5, scored_known: int | None = None) -> float:
    """Matmul FLOPs a CDLM training step really executes per token (x3 for fwd + bwd,
    x1 for forward-only work).

    Backbone and attention on every token; everything after h only at the masked
    positions (expected share 0.5 under t ~ U(0, 1)): the LM head; the known head over the
    ``scored_known`` concepts the concept loss scores (all n by default) with backward; the
    unknown projection d->R with backward; the unknown top-k scan R->m forward only (no
    grad), then the k selected logits and the U basis with backward.
    """
    d, V = cfg.d_model, cfg.vocab_size
    p = count_params(cfg)
    f = 6.0 * p["backbone"] + 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * attended_keys(cfg, T)
    f += 6.0 * masked * V * d
    if cfg.has_concepts:
        R, ku, kk = cfg.unknown_rank, cfg.topk_unknown, cfg.topk_known
        n_scored = cfg.n_known if scored_known is None else scored_known
        f += 6.0 * masked * d * n_scored
        if scored_known is not None:  # sparse known top-k: no-grad scan + gathered logits
            f += 2.0 * masked * d * cfg.n_known + 6.0 * masked * kk * d
        f += 6.0 * masked * (d * R + ku * R + R * d + kk * d + ku * R) + 2.0 * masked * R * cfg.n_unknown
    return f


def make_batch(cfg: ModelConfig, B: int, T: int, chunk_len: int, gen: torch.Generator) -> dict:
    batch = {"input_ids": torch.randint(5, cfg.vocab_size, (B, T), generator=gen)}
    if cfg.has_concepts:
        nc = T // chunk_len
        batch["chunk_ids"] = torch.arange(B * nc).view(B, nc).repeat_interleave(chunk_len, dim=1)
        batch["chunk_labels"] = (torch.rand(B * nc, cfg.n_known, generator=gen) < 0.02).float()
    return batch


class Runner:
    """One model + optimizer + fixed batches; ``step()`` times one full training step."""

    def __init__(self, cfg: ModelConfig, B: int, T: int, compile_blocks: bool = False, negatives: int | None = None):
        torch.manual_seed(0)
        self.cfg, self.model = cfg, Steerling(cfg)
        if compile_blocks:  # inductor fuses the elementwise ops (norms, RoPE, SwiGLU) on CPU
            for blk in self.model.blocks:
                blk.compile()
        self.tc = TrainConfig(steps=1000, batch_size=B, seq_len=T, chunk_len=64, warmup_steps=0, dtype=DTYPE,
                              concept_negatives=negatives)
        self.opt = make_optimizer(self.model, self.tc)
        self.ac = autocast_factory(DTYPE)
        gen = torch.Generator().manual_seed(0)
        self.batches = [make_batch(cfg, B, T, 64, gen) for _ in range(2)]
        self.mgen = torch.Generator()  # reseeded per step (see step())
        self.s = 0
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def step(self, record: bool = True) -> None:
        # The same two (batch, mask draw) pairs for every runner: the masked share varies from
        # draw to draw by several %, which would otherwise decide which runner looks faster.
        self.mgen.manual_seed(self.s % 2)
        w, c = time.perf_counter(), time.process_time()
        train_step(self.model, self.opt, self.batches[self.s % 2], self.tc, self.s, 1000, self.mgen, self.ac)
        self.s += 1
        if record:
            self.wall.append(time.perf_counter() - w)
            self.cpu.append((time.process_time() - c) / torch.get_num_threads())

    def time_s(self) -> float:
        """Best observed wall time: the least disturbed by other jobs on a shared machine."""
        return min(self.wall)


def measure(runners: list[Runner], warmup: int, reps: int) -> None:
    """Interleave steps of the runners (A B A B ...) so load changes hit all alike."""
    for r in runners:
        for _ in range(warmup):
            r.step(record=False)
    for _ in range(reps):
        for r in runners:
            r.step()


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
    ap.add_argument("--no-sweep", action="store_true", help="skip the concept-count sweep")
    ap.add_argument("--only-25m", action="store_true", help="skip the 10M row")
    ap.add_argument("--reps", type=int, default=None, help="timed steps per runner (overrides --quick)")
    ap.add_argument("--paper-counts-only", action="store_true", help="sweep only the paper's 33,732 / 101,196")
    ap.add_argument("--skip-peak", action="store_true", help="skip the matmul-peak measurement (FLOP shares print as n/a)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    B, T = args.batch, args.seq
    warmup, reps = (1, 3) if args.quick else (2, 6)
    if args.reps:
        reps = args.reps
    peak = Peak()
    if args.skip_peak:
        peak.update = lambda: None  # noqa: E731 - overhead ratios only
        peak.bf16 = peak.fp32 = float("nan")
    peak.update()
    print(f"threads={torch.get_num_threads()}  batch={B}x{T} tokens/step={B * T}  compile={args.compile}")

    sizes = {
        "10M (6L d320)": dict(n_layers=6, d_model=320, n_heads=10, n_kv_heads=5, ffn_hidden=1280),
        "25M (6L d512)": dict(),  # the bench25M preset itself
    }
    if args.only_25m:
        sizes.pop("10M (6L d320)")
    print(f"load average at start: {load()} (other jobs share this machine; times are the best of "
          f"{reps} interleaved steps, cpu_s = process CPU time / threads)")
    print("\nsize            family        backbone  +concept   step_s   cpu_s  tokens/s  achieved GFLOP/s  share_of_peak")
    overhead, achieved = {}, []
    for label, shape in sizes.items():
        runners = {fam: Runner(ModelConfig.preset("bench25M", family=fam, max_seq_len=T, **shape), B, T, args.compile)
                   for fam in ("cdlm", "cdlm_concept")}
        measure(list(runners.values()), warmup, reps)
        peak.update()
        for fam, r in runners.items():
            s = r.time_s()
            fl = executed_flops_per_token(r.cfg, T) * B * T / s
            p = count_params(r.cfg)
            print(f"{label:15s} {fam:13s} {p['backbone'] / 1e6:7.1f}M {p['concept'] / 1e6:8.1f}M {s:8.3f} {min(r.cpu):7.3f} "
                  f"{B * T / s:9.0f} {fl / 1e9:17.1f} {fl / peak.best:14.1%}")
            achieved.append((label, fam, fl))
        base, con = runners["cdlm"], runners["cdlm_concept"]
        overhead[label] = con.time_s() / base.time_s() - 1
        print(f"{label:15s} concept-module step-time overhead: {overhead[label]:+.1%} (wall)  "
              f"{min(con.cpu) / min(base.cpu) - 1:+.1%} (cpu)")
        del runners

    print("\nconcept-module overhead vs concept counts (25M backbone, top-k known/unknown 32/128, rank 256)")
    print("(neg=all: the concept loss scores every known concept; neg=N: positives + N sampled negatives,"
          " TrainConfig.concept_negatives)")
    counts = [] if args.no_sweep else [(500, 1500, None), (2000, 6000, None), (8000, 24000, None)]
    if not args.no_sweep:
        counts += [(33732, 101196, None), (33732, 101196, 2048)]  # the paper's library size
    if args.paper_counts_only:
        counts = [c for c in counts if c[0] == 33732]
    print(f"  load average: {load()}")
    print("  n_known  n_unknown  neg   concept_params  step_s  overhead(wall)  overhead(cpu)  flops_ratio")
    for n, m, neg in counts:
        base = Runner(ModelConfig.preset("bench25M", family="cdlm", max_seq_len=T), B, T, args.compile)
        con = Runner(ModelConfig.preset("bench25M", family="cdlm_concept", max_seq_len=T, n_known=n, n_unknown=m), B, T,
                     args.compile, negatives=neg)
        measure([base, con], 1, min(reps, 2) if (n > 10000 or args.quick) else reps)
        fr = executed_flops_per_token(con.cfg, T, scored_known=None if neg is None else neg + 40) / \
            executed_flops_per_token(base.cfg, T) - 1
        print(f"  {n:7d} {m:10d} {str(neg or 'all'):>5s} {count_params(con.cfg)['concept'] / 1e6:13.1f}M {con.time_s():7.3f} "
              f"{con.time_s() / base.time_s() - 1:+14.1%} {min(con.cpu) / min(base.cpu) - 1:+13.1%} {fr:+11.1%}", flush=True)
        del base, con
    peak.update()
    print(f"load average at end: {load()}")
    print(f"matmul peak (2048^2, best of the run): bf16 {peak.bf16 / 1e9:.1f} GFLOP/s, fp32 {peak.fp32 / 1e9:.0f} GFLOP/s;"
          f" compute dtype {DTYPE}"
          f"  (executed FLOPs: see executed_flops_per_token)")
    for label, fam, fl in achieved:
        print(f"  achieved FLOP/s share of the {DTYPE} peak: {label:15s} {fam:13s} {fl / peak.best:6.1%}"
              f"  (claim >= 40%: {'met' if fl / peak.best >= 0.4 else 'NOT met'})")

    target = overhead["25M (6L d512)"]
    print(f"\nclaim: overhead <= 10% at 25M / 2k+6k concepts -> {target:+.1%} "
          f"({'met' if target <= 0.10 else 'NOT met'})")


if __name__ == "__main__":
    main()
