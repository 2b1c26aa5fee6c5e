"""IsoFLOP analysis (Chinchilla Approach 2; paper Tables 6, 23).

For each compute budget C the runs of that budget (different sizes, same FLOPs) are
fitted with a parabola of loss in ln(params); its vertex gives the compute-optimal size
P*(C), the loss L*(C) and the tokens D*(C) = C / (k P*), where k = C / (P D) is the
FLOPs-per-parameter-token of that budget's runs (6 for the 6ND convention, a bit more
when the attention term is counted).  Across budgets:

    P* ~ C^aP,   D* ~ C^aD        (least squares in log-log)
    L* = E + A C^-aL              (E: the irreducible loss; fitted when >= 4 budgets,
                                   otherwise fixed to ``irreducible`` -- e.g. the joint
                                   fit's E -- or 0)

90% CIs come from a stratified bootstrap: runs are resampled within each budget and
the whole chain (parabolas -> exponents) is refitted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from .bootstrap import percentile_ci, resample_weights
from .power import fit_power_law

__all__ = ["IsoFLOPFit", "fit_isoflop", "assign_budgets"]


def assign_budgets(flops: np.ndarray, budget: np.ndarray | None = None,
                   rel_tol: float = 0.15) -> tuple[np.ndarray, np.ndarray]:
    """Label each run with a budget index; return (labels, budget values).

    With an explicit ``budget`` column its distinct values are the budgets.  Otherwise
    runs are clustered on log10(flops): sorted, a new budget starts where consecutive
    runs differ by more than ``rel_tol`` (relative).  A cluster's value is the geometric
    mean of its FLOPs; clusters spanning more than a factor (1 + rel_tol)^2 are not
    IsoFLOP slices and their runs get label -1 (ignored).
    """
    flops = np.asarray(flops, dtype=np.float64)
    if budget is not None:
        budget = np.asarray(budget, dtype=np.float64)
        values, labels = np.unique(budget, return_inverse=True)
        return labels, values
    order = np.argsort(flops)
    lf = np.log(flops[order])
    labels_sorted = np.concatenate([[0], np.cumsum(np.diff(lf) > math.log1p(rel_tol))])
    labels = np.empty_like(labels_sorted)
    labels[order] = labels_sorted
    groups = np.unique(labels_sorted)
    # a cluster whose FLOPs spread exceeds (1 + rel_tol)^2 is a chain, not an IsoFLOP slice
    keep = [g for g in groups
            if lf[labels_sorted == g].max() - lf[labels_sorted == g].min() <= 2 * math.log1p(rel_tol)]
    remap = {g: i for i, g in enumerate(keep)}
    labels = np.array([remap.get(g, -1) for g in labels], dtype=np.int64)
    values = np.array([math.exp(lf[labels_sorted == g].mean()) for g in keep])
    return labels, values


def _parabola(lnP: np.ndarray, L: np.ndarray, w: np.ndarray, interior: bool = True):
    """Weighted fit L = a x^2 + b x + c; return (x*, L*, a), or None if not convex or
    (``interior``) if the vertex lies outside the sampled sizes (an extrapolated minimum)."""
    use = w > 0
    if np.unique(lnP[use]).size < 3:
        return None
    X = np.stack([lnP ** 2, lnP, np.ones_like(lnP)], axis=1)
    sw = np.sqrt(w)
    (a, b, c), *_ = np.linalg.lstsq(X * sw[:, None], L * sw, rcond=None)
    if not a > 0:
        return None
    x = -b / (2 * a)
    if interior and not (lnP[use].min() <= x <= lnP[use].max()):
        return None
    return x, c - b * b / (4 * a), a


def _chain(lnP, L, kpt, labels, values, w, irreducible, min_budgets=2, interior=True):
    """One pass: per-budget minima then the exponents. Returns (minima, exps) arrays."""
    nb = values.size
    mins = np.full((nb, 3), np.nan)  # P*, D*, L*
    for g in range(nb):
        m = labels == g
        r = _parabola(lnP[m], L[m], w[m], interior)
        if r is None:
            continue
        P = math.exp(r[0])
        k = float(np.median(kpt[m]))
        mins[g] = (P, values[g] / (k * P), r[1])
    ok = np.all(np.isfinite(mins), axis=1)
    exps = np.full(6, np.nan)  # aP, cP, aD, cD, aL, E  (+A stored separately)
    A_L = math.nan
    if ok.sum() >= min_budgets:
        lc = np.log(values[ok])
        aP, cP = np.polyfit(lc, np.log(mins[ok, 0]), 1)
        aD, cD = np.polyfit(lc, np.log(mins[ok, 1]), 1)
        fix_e = None if (irreducible == "fit" and ok.sum() >= 4) else (
            0.0 if irreducible in (None, "fit") else float(irreducible))
        try:
            pf = fit_power_law(values[ok], mins[ok, 2], fix_e=fix_e, n_bootstrap=0)
            aL, E, A_L = pf.params["beta"], pf.params["e"], pf.params["A"]
        except ValueError:
            aL, E = math.nan, math.nan
        exps[:] = (aP, cP, aD, cD, aL, E)
    return mins, exps, A_L


@dataclass
class IsoFLOPFit:
    """Per-budget minima table and the compute-optimal exponents with CIs."""

    minima: pl.DataFrame
    params: dict[str, float]
    ci: dict[str, tuple[float, float]]
    ci_level: float
    n_bootstrap: int
    irreducible_mode: str
    samples: np.ndarray | None = field(default=None, repr=False)
    parabolas: list[dict[str, Any]] = field(default_factory=list)

    def predict(self, flops) -> dict[str, np.ndarray]:
        C = np.asarray(flops, dtype=np.float64)
        p = self.params
        return {"params_opt": np.exp(p["c_P"]) * C ** p["a_P"],
                "tokens_opt": np.exp(p["c_D"]) * C ** p["a_D"],
                "loss_opt": p["E"] + p["A_L"] * C ** (-p["a_L"])}

    def to_dict(self) -> dict[str, Any]:
        return {"model": "P* = exp(c_P) C^a_P; D* = exp(c_D) C^a_D; L* = E + A_L C^-a_L",
                "params": self.params, "ci": {k: list(v) for k, v in self.ci.items()},
                "ci_level": self.ci_level, "n_bootstrap": self.n_bootstrap,
                "irreducible": self.irreducible_mode,
                "budgets": self.minima.to_dicts()}


def fit_isoflop(params, tokens, flops, loss, *, budget=None, n_bootstrap: int = 1000,
                ci_level: float = 0.90, seed: int | None = 0,
                irreducible: float | str | None = "fit", rel_tol: float = 0.15,
                require_interior: bool = True) -> IsoFLOPFit:
    """IsoFLOP fit of a runs table (see module doc). ``budget``: optional nominal budgets.

    ``require_interior``: a budget counts only if its parabola's vertex lies within the
    sizes trained at that budget (otherwise the "optimum" is an extrapolation and the
    grid should be widened); also applied to each bootstrap resample.
    """
    N = np.asarray(params, dtype=np.float64)
    D = np.asarray(tokens, dtype=np.float64)
    C = np.asarray(flops, dtype=np.float64)
    L = np.asarray(loss, dtype=np.float64)
    labels, values = assign_budgets(C, budget, rel_tol)
    lnP = np.log(N)
    kpt = C / (N * D)
    w1 = np.ones_like(L)
    mins, exps, A_L = _chain(lnP, L, kpt, labels, values, w1, irreducible,
                             interior=require_interior)
    ok = np.all(np.isfinite(mins), axis=1)
    if ok.sum() < 2:
        why = " and its minimum inside the sampled sizes" if require_interior else ""
        raise ValueError(
            f"IsoFLOP fit needs >= 2 budgets with >= 3 distinct sizes and a convex loss curve{why}; "
            f"got {int(ok.sum())} usable of {values.size} budget(s)")
    mode = ("fit" if (irreducible == "fit" and ok.sum() >= 4) else
            f"fixed={0.0 if irreducible in (None, 'fit') else float(irreducible)}")
    names = ["a_P", "c_P", "a_D", "c_D", "a_L", "E", "A_L"]
    point = dict(zip(names, [float(v) for v in exps] + [float(A_L)]))
    ci = {k: (math.nan, math.nan) for k in names}
    samples = None
    bmins = None
    if n_bootstrap and n_bootstrap > 0:
        wts = resample_weights(L.size, n_bootstrap, seed, strata=labels)
        samples = np.full((n_bootstrap, len(names)), np.nan)
        bmins = np.full((n_bootstrap, values.size, 3), np.nan)
        for i, w in enumerate(wts):
            m_i, e_i, a_i = _chain(lnP, L, kpt, labels, values, w, irreducible,
                                   interior=require_interior)
            samples[i, :6] = e_i
            samples[i, 6] = a_i
            bmins[i] = m_i
        lo, hi = percentile_ci(samples, ci_level)
        ci = {k: (float(lo[j]), float(hi[j])) for j, k in enumerate(names)}
    q = (1 - ci_level) / 2
    rows = []
    parabolas = []
    for g in range(values.size):
        m = labels == g
        row = {"budget": float(values[g]), "n_runs": int(m.sum()),
               "n_sizes": int(np.unique(N[m]).size),
               "params_opt": float(mins[g, 0]), "tokens_opt": float(mins[g, 1]),
               "loss_opt": float(mins[g, 2]),
               "interior": bool(ok[g] and N[m].min() <= mins[g, 0] <= N[m].max())}
        if bmins is not None:
            for j, key in enumerate(("params_opt", "tokens_opt", "loss_opt")):
                col = bmins[:, g, j]
                col = col[np.isfinite(col)]
                lo_, hi_ = (np.quantile(col, [q, 1 - q]) if col.size else (math.nan, math.nan))
                row[f"{key}_lo"], row[f"{key}_hi"] = float(lo_), float(hi_)
        rows.append(row)
        if np.unique(lnP[m]).size >= 3:
            X = np.stack([lnP[m] ** 2, lnP[m], np.ones(m.sum())], axis=1)
            coef, *_ = np.linalg.lstsq(X, L[m], rcond=None)
            parabolas.append({"budget": float(values[g]), "coef": [float(c) for c in coef]})
    return IsoFLOPFit(minima=pl.DataFrame(rows), params=point, ci=ci, ci_level=ci_level,
                      n_bootstrap=int(n_bootstrap or 0), irreducible_mode=mode,
                      samples=samples, parabolas=parabolas)
