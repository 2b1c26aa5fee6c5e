"""IsoFLOP sweep planner: compute budgets x families -> the (params, tokens) grid to train.

FLOPs accounting (``model.flops``, one definition for the whole project):

    C = train_flops_per_token(cfg, seq_len) * D
      = (6 N + 12 L d_attn K(T) + concept lookups) * D

where N is ``count_params(cfg)["non_embedding"]`` (backbone + dense concept heads; the
embedding table and LM head are left out, Kaplan/Chinchilla convention), the second
term is the attention score/value work with K(T) the mean number of keys a query
attends to under the family's mask (causal (T+1)/2, block-causal (T+B)/2), and the
last the sparse top-k concept lookups.  ``flops_mode="6N"`` uses the bare C = 6 N D
instead (tokens = C / 6N), matching tables that were built that way.

For each budget the planner targets ``n_sizes`` parameter counts spaced log-uniformly
over a factor ``span`` around the compute-optimal guess N_c = sqrt(C / (k r)) (r =
``tokens_per_param``, 20 for Chinchilla; k = FLOPs per parameter-token of the shape),
picks for each target the closest shape from a ladder of transformer shapes
(``shape_ladder``: n_layers x d_model with head_dim 16/32/64 and a bounded aspect
ratio), and trains it for D = C / flops_per_token tokens, rounded to whole optimiser
steps.  The realised FLOPs of every run are recorded, so ``flops / budget`` shows the
rounding error (the check is C_real ~ C within ``tolerance``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import polars as pl

__all__ = ["PlannedRun", "SweepPlan", "plan_isoflop", "shape_ladder", "TINY_SHAPES",
           "DEFAULT_LAYERS", "DEFAULT_WIDTHS"]

DEFAULT_LAYERS = (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32)
DEFAULT_WIDTHS = (16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 640, 768,
                  1024, 1280, 1536, 2048, 2560, 3072, 4096)
# the CPU ladder used by tests and the demo sweep
TINY_SHAPES = {"layers": (1, 2, 3, 4), "widths": (16, 24, 32, 48, 64, 96, 128)}


@dataclass
class PlannedRun:
    run_id: str
    family: str
    budget: float
    budget_index: int
    size_index: int
    n_layers: int
    d_model: int
    n_heads: int
    params: int                 # non-embedding N (the P of the fits)
    params_total: int
    target_params: float
    tokens: int
    steps: int
    flops: float                # realised training FLOPs (model.flops) of this run
    flops_per_token: float
    flops_6nd: float
    model_config: dict[str, Any] = field(repr=False)
    train_config: dict[str, Any] = field(repr=False)

    def configs(self):
        from model.config import ModelConfig, TrainConfig

        return ModelConfig.model_validate(self.model_config), TrainConfig.model_validate(self.train_config)


@dataclass
class SweepPlan:
    runs: list[PlannedRun]
    budgets: list[float]
    families: list[str]
    settings: dict[str, Any]

    def to_frame(self) -> pl.DataFrame:
        rows = []
        for r in self.runs:
            d = asdict(r)
            d.pop("model_config")
            d.pop("train_config")
            d["flops_ratio"] = r.flops / r.budget
            rows.append(d)
        return pl.DataFrame(rows)

    def to_dict(self) -> dict[str, Any]:
        return {"budgets": self.budgets, "families": self.families, "settings": self.settings,
                "runs": [asdict(r) for r in self.runs]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SweepPlan":
        return cls(runs=[PlannedRun(**r) for r in d["runs"]], budgets=list(d["budgets"]),
                   families=list(d["families"]), settings=dict(d["settings"]))

    def write(self, path: str | Path) -> Path:
        """``.json`` keeps the full configs (re-loadable); ``.csv``/``.parquet`` the grid."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.suffix.lower() == ".json":
            p.write_text(json.dumps(self.to_dict(), indent=2))
        else:
            from .table import write_table

            write_table(self.to_frame(), p)
        return p

    @classmethod
    def read(cls, path: str | Path) -> "SweepPlan":
        return cls.from_dict(json.loads(Path(path).read_text()))


def _heads_for(d: int) -> int | None:
    for hd in (64, 32, 16, 8):
        if d % hd == 0 and d // hd >= 1 and (d >= 4 * hd or hd == 8 or d == hd):
            return d // hd
    return None


def shape_ladder(base, layers: Sequence[int] = DEFAULT_LAYERS,
                 widths: Sequence[int] = DEFAULT_WIDTHS, max_aspect: float = 256.0,
                 min_aspect: float = 8.0) -> list:
    """Candidate ModelConfigs (copies of ``base`` with n_layers/d_model/heads changed).

    head_dim is 64/32/16 (the largest leaving >= 4 heads, else one head of d), KV heads =
    heads; d_model / n_layers within [min_aspect, max_aspect].
    """
    out = []
    for L in layers:
        for d in widths:
            if not (min_aspect <= d / L <= max_aspect):
                continue
            h = _heads_for(d)
            if h is None:
                continue
            try:
                out.append(base.model_copy(update={"n_layers": L, "d_model": d, "n_heads": h,
                                                   "n_kv_heads": h}, deep=True))
            except Exception:
                continue
    # model_copy skips validation: re-validate
    from model.config import ModelConfig

    valid = []
    for c in out:
        try:
            valid.append(ModelConfig.model_validate(c.model_dump()))
        except Exception:
            pass
    return valid


def plan_isoflop(budgets: Iterable[float], families: Iterable[str] = ("cdlm_concept",), *,
                 n_sizes: int = 3, span: float = 8.0, tokens_per_param: float = 20.0,
                 sizes: Sequence[float] | None = None, preset: str = "tiny",
                 model_overrides: dict[str, Any] | None = None,
                 train_overrides: dict[str, Any] | None = None,
                 layers: Sequence[int] | None = None, widths: Sequence[int] | None = None,
                 batch_size: int = 8, seq_len: int | None = None, flops_mode: str = "model",
                 tolerance: float = 0.25, min_steps: int = 4) -> SweepPlan:
    """Plan an IsoFLOP grid (see module doc).

    ``sizes``: explicit target parameter counts (non-embedding) instead of the
    span-around-optimum rule.  ``preset``/``model_overrides``: the base ModelConfig whose
    vocab, concept counts, block size etc. every shape inherits.  ``train_overrides``:
    extra TrainConfig fields (lr, dtype, threads, ...).  ``tolerance``: runs whose
    realised FLOPs miss the budget by more than this fraction (too few steps) are
    rejected with a ValueError naming them.
    """
    from model.config import ModelConfig, TrainConfig
    from model.flops import count_params, train_flops, train_flops_per_token

    budgets = sorted(float(b) for b in budgets)
    families = list(families)
    if not budgets or any(b <= 0 for b in budgets):
        raise ValueError("budgets must be positive FLOP counts")
    if flops_mode not in ("model", "6N"):
        raise ValueError("flops_mode must be 'model' or '6N'")
    if n_sizes < 1:
        raise ValueError("n_sizes must be >= 1")
    if layers is None and widths is None and preset == "tiny":
        layers, widths = TINY_SHAPES["layers"], TINY_SHAPES["widths"]
    runs: list[PlannedRun] = []
    problems: list[str] = []
    for fam in families:
        base = ModelConfig.preset(preset, family=fam, **(model_overrides or {}))
        T = seq_len or base.max_seq_len
        if base.is_diffusion:
            T = max(base.block_size, (T // base.block_size) * base.block_size)
        ladder = shape_ladder(base, layers or DEFAULT_LAYERS, widths or DEFAULT_WIDTHS)
        if not ladder:
            raise ValueError(f"no valid shapes for family {fam}")

        def fpt(c):
            return (6.0 * count_params(c)["non_embedding"] if flops_mode == "6N"
                    else train_flops_per_token(c, T))

        cand = sorted(((count_params(c)["non_embedding"], c) for c in ladder), key=lambda t: t[0])
        for bi, C in enumerate(budgets):
            if sizes is not None:
                targets = [float(s) for s in sizes]
            else:
                # N_c from C = k N (r N) with k the FLOPs/param-token of the nearest shape
                k = 6.0
                for _ in range(3):
                    Nc = math.sqrt(C / (k * tokens_per_param))
                    near = min(cand, key=lambda t: abs(math.log(t[0] / Nc)))
                    k = fpt(near[1]) / near[0]
                if n_sizes == 1:
                    targets = [Nc]
                else:
                    targets = [Nc * span ** (i / (n_sizes - 1) - 0.5) for i in range(n_sizes)]
            chosen: list[tuple[float, Any]] = []
            used = set()
            for t in targets:
                ranked = sorted(cand, key=lambda pc: abs(math.log(pc[0] / t)))
                pick = next((pc for pc in ranked if pc[0] not in used), ranked[0])
                used.add(pick[0])
                chosen.append((t, pick))
            for si, (t, (N, cfg)) in enumerate(sorted(chosen, key=lambda x: x[1][0])):
                per_tok = fpt(cfg)
                tps = batch_size * T
                steps = max(min_steps, int(round(C / per_tok / tps)))
                tokens = steps * tps
                tc = dict(total_tokens=tokens, batch_size=batch_size, seq_len=T)
                tc.update(train_overrides or {})
                tcfg = TrainConfig.model_validate(tc)
                real = (per_tok * tokens if flops_mode == "6N" else train_flops(cfg, tokens, T))
                rid = f"{fam}-b{bi}-s{si}-L{cfg.n_layers}d{cfg.d_model}"
                if abs(real / C - 1.0) > tolerance:
                    problems.append(f"{rid}: realised {real:.3g} FLOPs vs budget {C:.3g}")
                runs.append(PlannedRun(
                    run_id=rid, family=fam, budget=C, budget_index=bi, size_index=si,
                    n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads,
                    params=int(N), params_total=int(count_params(cfg)["total"]),
                    target_params=float(t), tokens=int(tokens), steps=int(tcfg.total_steps),
                    flops=float(real), flops_per_token=float(per_tok),
                    flops_6nd=float(6.0 * N * tokens), model_config=cfg.model_dump(),
                    train_config=tcfg.model_dump()))
    if problems:
        raise ValueError("budget not reachable within tolerance (use larger budgets, smaller "
                         "batch_size/seq_len or a larger tolerance): " + "; ".join(problems))
    settings = dict(n_sizes=n_sizes, span=span, tokens_per_param=tokens_per_param,
                    sizes=list(sizes) if sizes is not None else None, preset=preset,
                    model_overrides=model_overrides or {}, train_overrides=train_overrides or {},
                    batch_size=batch_size, seq_len=seq_len, flops_mode=flops_mode,
                    tolerance=tolerance)
    return SweepPlan(runs=runs, budgets=budgets, families=families, settings=settings)
