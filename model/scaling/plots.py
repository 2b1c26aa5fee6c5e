"""PNG figures of the scaling fits (object-oriented matplotlib, Agg canvas, no pyplot state).

* ``isoflop_<family>.png``   loss vs params per budget with fitted parabolas and minima
* ``frontier_<family>.png``  P*(C), D*(C), L*(C) with the fitted power laws and CI bands
* ``surface_<family>.png``   joint L(P, D) contours with the runs and the compute-optimal path
* ``metrics_<family>.png``   each metric vs compute with m(C) fit
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

if TYPE_CHECKING:  # pragma: no cover
    from .report import FamilyFits, ScalingReport

__all__ = ["plot_isoflop", "plot_frontier", "plot_surface", "plot_metrics", "plot_report"]


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s)


def plot_isoflop(ff: "FamilyFits", path: Path) -> Path | None:
    iso = ff.isoflop
    if iso is None:
        return None
    from .isoflop import assign_budgets

    df = ff.runs
    N, C, L = (df[c].to_numpy() for c in ("params", "flops", "loss"))
    budget = df["budget"].to_numpy() if "budget" in df.columns else None
    labels, values = assign_budgets(C, budget, ff.budget_rel_tol)
    fig = Figure(figsize=(6.4, 4.4))
    ax = fig.add_subplot()
    import matplotlib

    cmap = matplotlib.colormaps["viridis"]
    for g, C0 in enumerate(values):
        m = labels == g
        col = cmap(g / max(1, len(values) - 1))
        ax.scatter(N[m], L[m], color=col, s=18, label=f"C={C0:.2g}")
        par = next((p for p in iso.parabolas if math.isclose(p["budget"], C0, rel_tol=1e-9)), None)
        if par is not None and m.sum() >= 3:
            x = np.linspace(np.log(N[m].min()) - 0.3, np.log(N[m].max()) + 0.3, 100)
            a, b, c = par["coef"]
            ax.plot(np.exp(x), a * x * x + b * x + c, color=col, lw=1)
    mins = iso.minima
    ax.scatter(mins["params_opt"], mins["loss_opt"], marker="*", s=90, color="crimson",
               zorder=5, label="minima")
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("final validation loss")
    ax.set_title(f"IsoFLOP curves ({ff.family})")
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_frontier(ff: "FamilyFits", path: Path) -> Path | None:
    iso = ff.isoflop
    if iso is None:
        return None
    mins = iso.minima.filter(iso.minima["params_opt"].is_finite())
    C = mins["budget"].to_numpy()
    Cg = np.logspace(np.log10(C.min()) - 0.3, np.log10(C.max()) + 0.5, 100)
    pred = iso.predict(Cg)
    fig = Figure(figsize=(12, 3.8))
    titles = (("params_opt", "P*", "a_P"), ("tokens_opt", "D*", "a_D"), ("loss_opt", "L*", "a_L"))
    for i, (col, lab, ex) in enumerate(titles):
        ax = fig.add_subplot(1, 3, i + 1)
        y = mins[col].to_numpy()
        if f"{col}_lo" in mins.columns:
            lo, hi = mins[f"{col}_lo"].to_numpy(), mins[f"{col}_hi"].to_numpy()
            ax.errorbar(C, y, yerr=[np.maximum(y - lo, 0), np.maximum(hi - y, 0)], fmt="o", ms=4)
        else:
            ax.plot(C, y, "o")
        if iso.samples is not None and col != "loss_opt":
            s = iso.samples[np.all(np.isfinite(iso.samples[:, :4]), axis=1)]
            j = 0 if col == "params_opt" else 2
            band = np.exp(s[:, j + 1][:, None]) * Cg[None, :] ** s[:, j][:, None]
            q = (1 - iso.ci_level) / 2
            ax.fill_between(Cg, *np.quantile(band, [q, 1 - q], axis=0), alpha=0.2)
        ax.plot(Cg, pred[col], "-", lw=1)
        p, ci = iso.params[ex], iso.ci[ex]
        ax.set_title(f"{lab} ~ C^{p:.3f}  [{ci[0]:.3f}, {ci[1]:.3f}]", fontsize=9)
        ax.set_xscale("log")
        if col != "loss_opt":
            ax.set_yscale("log")
        ax.set_xlabel("compute C (FLOPs)")
        ax.set_ylabel(lab)
    fig.suptitle(f"compute-optimal frontier ({ff.family})", fontsize=10)
    return _save(fig, path)


def plot_surface(ff: "FamilyFits", path: Path) -> Path | None:
    j = ff.joint
    if j is None:
        return None
    df = ff.runs
    N, D, L = (df[c].to_numpy() for c in ("params", "tokens", "loss"))
    ln = np.linspace(np.log10(N.min()) - 0.3, np.log10(N.max()) + 0.3, 120)
    ld = np.linspace(np.log10(D.min()) - 0.3, np.log10(D.max()) + 0.3, 120)
    GN, GD = np.meshgrid(10 ** ln, 10 ** ld)
    Z = j.predict(GN, GD)
    fig = Figure(figsize=(11, 4.4))
    ax = fig.add_subplot(1, 2, 1)
    cs = ax.contourf(GN, GD, np.log(Z), levels=20, cmap="viridis")
    fig.colorbar(cs, ax=ax, label="log L(P, D) fitted")
    ax.scatter(N, D, c=np.log(L), cmap="viridis", edgecolors="k", linewidths=0.4, s=18,
               vmin=cs.get_clim()[0], vmax=cs.get_clim()[1])
    C = 6 * N * D
    Cg = np.logspace(np.log10(C.min()), np.log10(C.max()), 50)
    Nopt, Dopt = j.compute_optimal(Cg)
    ax.plot(Nopt, Dopt, "r--", lw=1.2, label="compute-optimal (C=6ND)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(GN.min(), GN.max())
    ax.set_ylim(GD.min(), GD.max())
    ax.set_xlabel("parameters P")
    ax.set_ylabel("tokens D")
    ax.legend(fontsize=7)
    p = j.params
    ax.set_title(f"E={p['E']:.3g} A={p['A']:.3g} B={p['B']:.3g} "
                 f"alpha={p['alpha']:.3f} beta={p['beta']:.3f}", fontsize=8)
    ax2 = fig.add_subplot(1, 2, 2)
    pred = j.predict(N, D)
    ax2.scatter(L, pred, s=10)
    lim = [min(L.min(), pred.min()), max(L.max(), pred.max())]
    ax2.plot(lim, lim, "k--", lw=0.8)
    ax2.set_xlabel("observed loss")
    ax2.set_ylabel("fitted loss")
    ax2.set_title(f"joint fit ({ff.family}), R^2(log L)={j.r2_log:.3f}", fontsize=9)
    return _save(fig, path)


def plot_metrics(ff: "FamilyFits", path: Path) -> Path | None:
    fits = {m: d["compute"] for m, d in ff.metrics.items() if d.get("compute") is not None}
    if not fits:
        return None
    k = len(fits)
    fig = Figure(figsize=(4 * k, 3.6))
    C = ff.runs["flops"].to_numpy()
    Cg = np.logspace(np.log10(C.min()) - 0.2, np.log10(C.max()) + 0.5, 100)
    for i, (m, f) in enumerate(fits.items()):
        ax = fig.add_subplot(1, k, i + 1)
        y = ff.runs[m].to_numpy()
        ax.scatter(C, y, s=14)
        ax.plot(Cg, f.predict(Cg), "-", lw=1)
        if f.samples is not None:
            ax.fill_between(Cg, *f.predict_ci(Cg), alpha=0.2)
        ax.set_xscale("log")
        ax.set_xlabel("compute C")
        ax.set_title(f"{m}: e={f.params['e']:.3g} beta={f.params['beta']:.3g} R2={f.r2:.2f}",
                     fontsize=8)
    return _save(fig, path)


def plot_report(report: "ScalingReport", out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    for fam, ff in report.families.items():
        for kind, fn in (("isoflop", plot_isoflop), ("frontier", plot_frontier),
                         ("surface", plot_surface), ("metrics", plot_metrics)):
            try:
                p = fn(ff, out / f"{kind}_{_slug(fam)}.png")
            except Exception as exc:  # a figure must not sink the report
                ff.errors[f"plot_{kind}"] = f"{type(exc).__name__}: {exc}"
                p = None
            if p is not None:
                written[f"{kind}_{fam}"] = p
    return written
