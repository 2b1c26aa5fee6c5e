"""One call that runs every fit on a runs table and writes tables / JSON / plots.

    report = fit_scaling(read_runs("runs.parquet"), exclude_highest_loss=5)
    report.write("out/")          # fits.json, *.parquet/*.csv, *.png
    report.to_dict()              # JSON-ready parameters and CIs

Runs are grouped by ``family`` when that column exists (each family is fitted on its
own: losses of different families are not comparable), otherwise a single group "all".
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from .bootstrap import single_thread_blas
from .extrapolate import extrapolate
from .isoflop import IsoFLOPFit, fit_isoflop
from .joint import ChinchillaFit, fit_chinchilla
from .power import PowerLawFit, fit_joint_power, fit_power_law
from .table import exclude_highest_loss as _exclude
from .table import metric_columns, normalize_runs, write_table

__all__ = ["FitOptions", "FamilyFits", "ScalingReport", "fit_scaling", "jsonable"]


@dataclass
class FitOptions:
    """Knobs of :func:`fit_scaling` (defaults follow the published procedure)."""

    n_bootstrap: int = 4000            # joint Chinchilla fit
    n_bootstrap_isoflop: int = 1000
    n_bootstrap_metrics: int = 1000
    ci_level: float = 0.90
    huber_delta: float = 1e-3
    n_refine: int | None = 64          # best grid starts refined by L-BFGS (None = all 4,500)
    seed: int | None = 0
    n_jobs: int | None = None          # bootstrap worker processes (None = auto)
    irreducible: float | str | None = "fit"   # IsoFLOP L* offset: "fit", a number, or None (=0)
    budget_rel_tol: float = 0.15       # clustering of runs into budgets when no budget column
    isoflop_require_interior: bool = True  # a budget's minimum must lie inside its sizes
    metrics: list[str] | None = None   # None = every numeric non-bookkeeping column


def jsonable(obj: Any) -> Any:
    """Recursively convert to strict-JSON types (NaN/inf -> None, numpy -> python)."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, (np.floating, float)):
        f = float(obj)
        return f if math.isfinite(f) else None
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.bool_,)):
        return bool(obj)
    return obj


@dataclass
class FamilyFits:
    family: str
    runs: pl.DataFrame
    joint: ChinchillaFit | None = None
    isoflop: IsoFLOPFit | None = None
    metrics: dict[str, dict[str, PowerLawFit | None]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    budget_rel_tol: float = 0.15

    def to_dict(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "n_runs": self.runs.height,
            "joint": self.joint.to_dict() if self.joint else None,
            "isoflop": self.isoflop.to_dict() if self.isoflop else None,
            "metrics": {m: {k: (v.to_dict() if v is not None else None) for k, v in d.items()}
                        for m, d in self.metrics.items()},
            "errors": self.errors,
        }


@dataclass
class ScalingReport:
    families: dict[str, FamilyFits]
    options: FitOptions
    n_input_runs: int
    n_excluded: int
    extrapolation: pl.DataFrame | None = None
    fit_seconds: float = 0.0

    def __getitem__(self, family: str) -> FamilyFits:
        return self.families[family]

    @property
    def main(self) -> FamilyFits:
        """The single family (or the first one)."""
        return next(iter(self.families.values()))

    def to_dict(self) -> dict[str, Any]:
        d = {
            "n_input_runs": self.n_input_runs,
            "n_excluded_highest_loss": self.n_excluded,
            "ci_level": self.options.ci_level,
            "options": {k: v for k, v in self.options.__dict__.items()},
            "families": {k: v.to_dict() for k, v in self.families.items()},
            "fit_seconds": self.fit_seconds,
        }
        if self.extrapolation is not None:
            d["extrapolation"] = self.extrapolation.to_dicts()
        return jsonable(d)

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), allow_nan=False, **kw)

    def parameters_table(self) -> pl.DataFrame:
        """Long table: family, fit, quantity, parameter, value, lo, hi."""
        rows = []

        def put(fam, fit, qty, params, ci):
            for k, v in params.items():
                lo, hi = ci.get(k, (math.nan, math.nan))
                rows.append({"family": fam, "fit": fit, "quantity": qty, "parameter": k,
                             "value": float(v), "lo": float(lo), "hi": float(hi)})

        for fam, ff in self.families.items():
            if ff.joint:
                put(fam, "joint_chinchilla", "loss", ff.joint.params, ff.joint.ci)
            if ff.isoflop:
                put(fam, "isoflop", "loss", ff.isoflop.params, ff.isoflop.ci)
            for m, d in ff.metrics.items():
                for kind, f in d.items():
                    if f is not None:
                        put(fam, f"metric_{kind}", m, f.params, f.ci)
                        rows.append({"family": fam, "fit": f"metric_{kind}", "quantity": m,
                                     "parameter": "r2", "value": f.r2, "lo": math.nan,
                                     "hi": math.nan})
        schema = {"family": pl.Utf8, "fit": pl.Utf8, "quantity": pl.Utf8, "parameter": pl.Utf8,
                  "value": pl.Float64, "lo": pl.Float64, "hi": pl.Float64}
        return pl.DataFrame(rows, schema=schema)

    def write(self, out_dir: str | Path, *, plots: bool = True) -> dict[str, Path]:
        """Write fits.json, parameters/minima/extrapolation tables (Parquet + CSV), PNGs."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        written: dict[str, Path] = {}
        p = out / "fits.json"
        p.write_text(self.to_json(indent=2))
        written["fits_json"] = p
        tables = {"parameters": self.parameters_table()}
        minima = [ff.isoflop.minima.with_columns(pl.lit(fam).alias("family"))
                  for fam, ff in self.families.items() if ff.isoflop is not None]
        if minima:
            tables["isoflop_minima"] = pl.concat(minima, how="diagonal")
        if self.extrapolation is not None:
            tables["extrapolation"] = self.extrapolation
        for name, df in tables.items():
            for ext in ("parquet", "csv"):
                written[f"{name}_{ext}"] = write_table(df, out / f"{name}.{ext}")
        if plots:
            from .plots import plot_report

            written.update(plot_report(self, out))
        return written


def _fit_family(fam: str, df: pl.DataFrame, opt: FitOptions, metrics: list[str]) -> FamilyFits:
    ff = FamilyFits(family=fam, runs=df, budget_rel_tol=opt.budget_rel_tol)
    N, D, C, L = (df[c].to_numpy().astype(np.float64) for c in ("params", "tokens", "flops", "loss"))
    try:
        ff.joint = fit_chinchilla(N, D, L, delta=opt.huber_delta, n_bootstrap=opt.n_bootstrap,
                                  ci_level=opt.ci_level, seed=opt.seed, n_refine=opt.n_refine,
                                  n_jobs=opt.n_jobs)
    except Exception as exc:
        ff.errors["joint"] = f"{type(exc).__name__}: {exc}"
    irr = opt.irreducible
    try:
        budget = df["budget"].to_numpy() if "budget" in df.columns else None
        ff.isoflop = fit_isoflop(N, D, C, L, budget=budget, n_bootstrap=opt.n_bootstrap_isoflop,
                                 ci_level=opt.ci_level, seed=opt.seed, irreducible=irr,
                                 rel_tol=opt.budget_rel_tol,
                                 require_interior=opt.isoflop_require_interior)
        if (ff.isoflop.irreducible_mode != "fit" and irr == "fit" and ff.joint is not None):
            # too few budgets to fit the offset: use the joint fit's irreducible loss
            ff.isoflop = fit_isoflop(N, D, C, L, budget=budget,
                                     n_bootstrap=opt.n_bootstrap_isoflop, ci_level=opt.ci_level,
                                     seed=opt.seed, irreducible=ff.joint.params["E"],
                                     rel_tol=opt.budget_rel_tol,
                                     require_interior=opt.isoflop_require_interior)
            ff.isoflop.irreducible_mode = f"joint E={ff.joint.params['E']:.4g}"
    except Exception as exc:
        ff.errors["isoflop"] = f"{type(exc).__name__}: {exc}"
    for m in metrics:
        sub = df.filter(pl.col(m).is_not_null() & pl.col(m).is_finite())
        if sub.height == 0:
            continue
        y = sub[m].to_numpy().astype(np.float64)
        d: dict[str, PowerLawFit | None] = {"compute": None, "joint": None}
        try:
            d["compute"] = fit_power_law(sub["flops"].to_numpy(), y,
                                         n_bootstrap=opt.n_bootstrap_metrics,
                                         ci_level=opt.ci_level, seed=opt.seed, n_jobs=opt.n_jobs,
                                         name=m)
        except Exception as exc:
            ff.errors[f"{m}:compute"] = f"{type(exc).__name__}: {exc}"
        try:
            d["joint"] = fit_joint_power(sub["params"].to_numpy(), sub["tokens"].to_numpy(), y,
                                         n_bootstrap=max(1, opt.n_bootstrap_metrics // 2),
                                         ci_level=opt.ci_level, seed=opt.seed, n_jobs=opt.n_jobs,
                                         name=m)
        except Exception as exc:
            ff.errors[f"{m}:joint"] = f"{type(exc).__name__}: {exc}"
        ff.metrics[m] = d
    return ff


def fit_scaling(runs: pl.DataFrame, *, exclude_highest_loss: int = 0,
                options: FitOptions | None = None, holdout_params_above: float | None = None,
                targets: pl.DataFrame | None = None, **overrides) -> ScalingReport:
    """Run the joint, IsoFLOP and metric fits on a runs table (per family).

    ``exclude_highest_loss`` drops the N highest-loss runs (per family) before fitting.
    ``holdout_params_above``: fit only runs with params <= that value and report
    predicted-vs-actual for the held-out larger runs.  ``targets``: extra rows
    (params, tokens/flops, optional actual loss/metrics) to extrapolate to.
    Keyword ``overrides`` set :class:`FitOptions` fields.
    """
    t0 = time.perf_counter()
    opt = options or FitOptions()
    for k, v in overrides.items():
        if not hasattr(opt, k):
            raise TypeError(f"unknown fit option: {k}")
        setattr(opt, k, v)
    runs = normalize_runs(runs)
    n_in = runs.height
    metrics = opt.metrics if opt.metrics is not None else metric_columns(runs)
    missing = [m for m in metrics if m not in runs.columns]
    if missing:
        raise ValueError(f"metric column(s) not in the runs table: {', '.join(missing)}")
    fam_col = "family" in runs.columns
    groups = (runs.partition_by("family", as_dict=False, maintain_order=True) if fam_col
              else [runs])
    families: dict[str, FamilyFits] = {}
    extra: list[pl.DataFrame] = []
    n_excl = 0
    for g in groups:
        fam = str(g["family"][0]) if fam_col else "all"
        g = _exclude(g, exclude_highest_loss)
        n_excl += exclude_highest_loss
        held = None
        if holdout_params_above is not None:
            held = g.filter(pl.col("params") > holdout_params_above)
            g = g.filter(pl.col("params") <= holdout_params_above)
        with single_thread_blas():
            ff = _fit_family(fam, g, opt, metrics)
        families[fam] = ff
        tg = []
        if held is not None and held.height:
            tg.append(held)
        if targets is not None:
            t = targets
            if fam_col and "family" in t.columns:
                t = t.filter(pl.col("family") == fam)
            tg.append(normalize_targets(t))
        for t in tg:
            extra.append(extrapolate(ff, t))
    ext = pl.concat(extra, how="diagonal") if extra else None
    return ScalingReport(families=families, options=opt, n_input_runs=n_in, n_excluded=n_excl,
                         extrapolation=ext, fit_seconds=time.perf_counter() - t0)


def normalize_targets(t: pl.DataFrame) -> pl.DataFrame:
    """Targets need params and tokens or flops; loss/metrics are optional actuals."""
    if "params" not in t.columns or ("tokens" not in t.columns and "flops" not in t.columns):
        raise ValueError("targets need columns params and tokens (or flops)")
    if "tokens" not in t.columns:
        t = t.with_columns((pl.col("flops") / (6.0 * pl.col("params"))).alias("tokens"))
    if "flops" not in t.columns:
        t = t.with_columns((6.0 * pl.col("params") * pl.col("tokens")).alias("flops"))
    return t
