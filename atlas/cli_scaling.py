"""`atlas scaling ...`: plan an IsoFLOP sweep, run it on Ray, fit scaling laws (thin CLI).

    atlas scaling plan  --budgets 1e10 3e10 --families cdlm_concept --sizes 3 --out plan.json
    atlas scaling sweep --budgets 1e10 3e10 --out runs/scaling [--address ray://...]
    atlas scaling fit   --runs runs.parquet [--json] [--exclude-highest-loss 5] [--out DIR]

All logic lives in ``model.scaling`` (plan, fits, plots) and ``model.sweep``
(the Ray runner); this module only parses arguments and prints.
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["add_commands"]


def _err(msg: str) -> int:
    print(f"atlas scaling: {msg}", file=sys.stderr)
    return 2


def _plan(a: argparse.Namespace) -> int:
    from model.scaling.plan import plan_isoflop

    try:
        tr = {"lr": a.lr} if a.lr else None
        plan = plan_isoflop(a.budgets, a.families, n_sizes=a.sizes, span=a.span,
                            preset=a.preset, batch_size=a.batch_size, seq_len=a.seq_len,
                            flops_mode=a.flops_mode, tolerance=a.tolerance, train_overrides=tr,
                            sizes=a.target_params)
    except (ValueError, KeyError) as e:
        return _err(str(e))
    df = plan.to_frame()
    if a.out:
        plan.write(a.out)
    if a.json:
        print(json.dumps({"budgets": plan.budgets, "families": plan.families,
                          "runs": df.to_dicts()}, default=str))
    else:
        cols = ["run_id", "budget", "params", "tokens", "steps", "flops", "flops_ratio"]
        with __import__("polars").Config(tbl_rows=200, tbl_cols=20, tbl_width_chars=160):
            print(df.select(cols))
        if a.out:
            print(f"plan written to {a.out}")
    return 0


def _fit(a: argparse.Namespace) -> int:
    from model.scaling import RunsTableError, fit_scaling, read_runs
    from model.scaling.table import read_targets

    try:
        runs = read_runs(a.runs)
        targets = read_targets(a.targets) if a.targets else None
        opts = {}
        if a.bootstrap is not None:
            opts.update(n_bootstrap=a.bootstrap, n_bootstrap_isoflop=a.bootstrap,
                        n_bootstrap_metrics=a.bootstrap)
        if a.metrics is not None:
            opts["metrics"] = a.metrics
        if a.jobs is not None:
            opts["n_jobs"] = a.jobs
        report = fit_scaling(runs, exclude_highest_loss=a.exclude_highest_loss,
                             holdout_params_above=a.holdout_params_above, targets=targets,
                             ci_level=a.ci, seed=a.seed, **opts)
    except (RunsTableError, ValueError) as e:
        return _err(str(e))
    if a.out:
        report.write(a.out, plots=not a.no_plots)
    if a.json:
        print(report.to_json())
        return 0
    print(_summary(report))
    if a.out:
        print(f"fits written to {a.out}")
    return 0


def _fmt(v, ci) -> str:
    lo, hi = ci
    return f"{v:.4g} [{lo:.4g}, {hi:.4g}]" if lo == lo and hi == hi else f"{v:.4g}"


def _summary(report) -> str:
    lvl = int(round(report.options.ci_level * 100))
    lines = [f"runs: {report.n_input_runs} read, {report.n_excluded} excluded (highest loss); "
             f"{lvl}% bootstrap CIs"]
    for fam, ff in report.families.items():
        lines.append(f"== {fam} ({ff.runs.height} runs)")
        if ff.joint:
            j = ff.joint
            lines.append("joint L(P,D) = E + A/P^alpha + B/D^beta: " + ", ".join(
                f"{k}={_fmt(j.params[k], j.ci[k])}" for k in ("E", "A", "B", "alpha", "beta"))
                + (f" (at bounds: {', '.join(j.at_bounds)})" if j.at_bounds else ""))
        if ff.isoflop:
            q = ff.isoflop
            lines.append("isoflop: " + ", ".join(
                f"{k}={_fmt(q.params[k], q.ci[k])}" for k in ("a_P", "a_D", "a_L", "E"))
                + f" (irreducible: {q.irreducible_mode})")
        for m, d in ff.metrics.items():
            for kind, f in d.items():
                if f is not None:
                    lines.append(f"{m} [{f.formula}]: " + ", ".join(
                        f"{k}={_fmt(v, f.ci[k])}" for k, v in f.params.items()) + f", R2={f.r2:.3f}"
                        + (f" (at bounds: {', '.join(f.at_bounds)})" if f.at_bounds else ""))
        for k, v in ff.errors.items():
            lines.append(f"(skipped {k}: {v})")
    if report.extrapolation is not None and report.extrapolation.height:
        lines.append("extrapolation:")
        for r in report.extrapolation.to_dicts():
            lines.append(f"  {r['family']} P={r['params']:.3g} D={r['tokens']:.3g} {r['quantity']} "
                         f"[{r['law']}]: predicted {r['predicted']:.4g} "
                         f"[{r['lo']:.4g}, {r['hi']:.4g}] actual {r['actual']:.4g}")
    return "\n".join(lines)


def _sweep(a: argparse.Namespace) -> int:
    from model.sweep import run_from_args, summarize

    try:
        res = run_from_args(a)
    except (ValueError, KeyError, FileNotFoundError) as e:
        return _err(str(e))
    print(summarize(res))
    return 0 if res.n_ok == res.table.height and not res.fit_error else 1


def add_commands(subparsers) -> None:
    """Register ``scaling plan|fit|sweep`` on the ``atlas`` argparse subparsers."""
    sc = subparsers.add_parser("scaling", help="scaling laws: plan / sweep / fit (paper Tables 6-8)")
    ssub = sc.add_subparsers(dest="scaling_command", required=True)

    p = ssub.add_parser("plan", help="IsoFLOP grid for compute budgets and families")
    p.add_argument("--budgets", type=float, nargs="+", required=True, help="FLOP budgets")
    p.add_argument("--families", nargs="+", default=["cdlm_concept"],
                   choices=["ar", "ar_concept", "cdlm", "cdlm_concept"])
    p.add_argument("--sizes", type=int, default=3, help="model sizes per budget")
    p.add_argument("--target-params", type=float, nargs="+", default=None,
                   help="explicit target (non-embedding) parameter counts instead of --sizes/--span")
    p.add_argument("--span", type=float, default=8.0, help="largest/smallest size ratio per budget")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--flops-mode", choices=["model", "6N"], default="model",
                   help="'model': 6N + attention (model.flops); '6N': C = 6ND")
    p.add_argument("--tolerance", type=float, default=0.25, help="max |C_real/C - 1| per run")
    p.add_argument("--out", default=None, help="write the plan (.json re-loadable; .csv/.parquet grid)")
    p.add_argument("--json", action="store_true", help="print the grid as JSON")
    p.set_defaults(func=_plan)

    f = ssub.add_parser("fit", help="fit scaling laws to a runs table (CSV or Parquet)")
    f.add_argument("--runs", required=True,
                   help="table with params, tokens (or flops), loss and optional metric columns")
    f.add_argument("--json", action="store_true", help="print fitted parameters and CIs as JSON")
    f.add_argument("--exclude-highest-loss", type=int, default=0, metavar="N",
                   help="drop the N highest-loss runs (Besiroglu et al.: 5)")
    f.add_argument("--bootstrap", type=int, default=None, help="bootstrap resamples (default 4000 joint)")
    f.add_argument("--ci", type=float, default=0.90, help="CI level (default 0.90)")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--jobs", type=int, default=None, help="bootstrap worker processes")
    f.add_argument("--metrics", nargs="*", default=None,
                   help="metric columns to fit (default: every numeric non-bookkeeping column)")
    f.add_argument("--holdout-params-above", type=float, default=None,
                   help="fit on runs with params <= X, report predicted vs actual for the rest")
    f.add_argument("--targets", default=None,
                   help="table of target sizes (params, tokens or flops, optional actual loss)")
    f.add_argument("--out", default=None, help="directory for fits.json, tables and PNGs")
    f.add_argument("--no-plots", action="store_true")
    f.set_defaults(func=_fit)

    s = ssub.add_parser("sweep", help="plan + train the grid on Ray (Ray Train + DeepSpeed) + fit")
    from model.sweep import build_arg_parser

    build_arg_parser(s)
    s.set_defaults(func=_sweep)
