"""Saturating power laws for loss / interpretability metrics.

* :func:`fit_power_law`  m(x) = e + A x^-beta          (e.g. metric vs compute C, or L*(C))
* :func:`fit_joint_power` m(P, D) = e + A_P P^-alpha + A_D D^-beta

Both are least squares in the metric's own units.  For fixed exponents the model is
linear in (e, A...), so the exponents are found by *variable projection*: the
coefficients are solved in closed form, the exponent(s) scanned on a grid and then
polished with a bounded scalar / Nelder-Mead search.  ``A`` may be negative, so metrics
that *rise* with scale (concept contribution, AUC) fit the same form, saturating at e.
``fix_e`` pins the offset (e.g. ``fix_e=0`` for a pure power law).

Inputs are rescaled by their geometric mean internally for conditioning; the reported
A is in the original units (A = A' x_ref^beta).  R^2 is on the metric scale; CIs are
bootstrap percentile intervals over runs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import minimize, minimize_scalar

from .bootstrap import parallel_chunks, percentile_ci, resample_weights

__all__ = ["PowerLawFit", "fit_power_law", "fit_joint_power"]

_EXP_MAX = 3.0


def _wlstsq(X: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, float]:
    sw = np.sqrt(w)
    coef, *_ = np.linalg.lstsq(X * sw[:, None], y * sw, rcond=None)
    r = y - X @ coef
    return coef, float(np.dot(w, r * r))


def _design(exps, xs, fix_e):
    cols = [] if fix_e is not None else [np.ones_like(xs[0])]
    cols += [x ** (-b) for x, b in zip(xs, exps)]
    return np.stack(cols, axis=1)


def _solve(xs: list[np.ndarray], y: np.ndarray, w: np.ndarray, fix_e: float | None,
           exp_max: float, start: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, float]:
    """Return (exponents, linear coefs [e?, A...], sse) minimising weighted SSE."""
    yy = y if fix_e is None else y - fix_e

    def sse(exps):
        exps = np.asarray(exps)
        if np.any(exps < 0) or np.any(exps > exp_max):
            return 1e300
        return _wlstsq(_design(exps, xs, fix_e), yy, w)[1]

    k = len(xs)
    grid1 = np.concatenate([np.linspace(0.005, 0.2, 40), np.linspace(0.2, exp_max, 60)[1:]])
    if k == 1:
        vals = np.array([sse([b]) for b in grid1])
        i = int(np.argmin(vals))
        lo = grid1[max(i - 1, 0)]
        hi = grid1[min(i + 1, len(grid1) - 1)]
        res = minimize_scalar(lambda b: sse([b]), bounds=(max(lo, 1e-6), hi), method="bounded",
                              options={"xatol": 1e-8})
        best = np.array([res.x]) if res.fun <= vals[i] else np.array([grid1[i]])
    else:
        if start is not None:  # bootstrap warm start: polish only
            best = np.asarray(start, dtype=np.float64)
            best_v = sse(best)
        else:
            g = grid1[::3]
            best_v, best = math.inf, None
            for a in g:
                for b in g:
                    v = sse([a, b])
                    if v < best_v:
                        best_v, best = v, np.array([a, b])
        res = minimize(sse, best, method="Nelder-Mead",
                       options={"xatol": 1e-7, "fatol": 1e-14, "maxiter": 2000})
        if res.fun <= best_v:
            best = np.asarray(res.x)
    coef, s = _wlstsq(_design(best, xs, fix_e), yy, w)
    return best, coef, s


def _pack(exps, coef, fix_e, xrefs):
    """Unscale to the original units -> vector [e, A_1, ..., exp_1, ...]."""
    if fix_e is None:
        e, As = coef[0], coef[1:]
    else:
        e, As = fix_e, coef
    As = np.array([A * xr ** b for A, xr, b in zip(As, xrefs, exps)])
    return np.concatenate([[e], As, exps])


def _boot_chunk(weights, xs, y, fix_e, exp_max, xrefs, start):
    k = len(xs)
    out = np.full((weights.shape[0], 1 + 2 * k), np.nan)
    for i, w in enumerate(weights):
        try:
            exps, coef, _ = _solve(xs, y, w, fix_e, exp_max, start)
            out[i] = _pack(exps, coef, fix_e, xrefs)
        except Exception:
            pass
    return out


@dataclass
class PowerLawFit:
    """A fitted saturating power law; ``params`` keyed e, A (or A_P, A_D), beta (or alpha, beta)."""

    formula: str
    inputs: tuple[str, ...]
    params: dict[str, float]
    ci: dict[str, tuple[float, float]]
    ci_level: float
    r2: float
    n: int
    n_bootstrap: int
    fixed: dict[str, float] = field(default_factory=dict)
    samples: np.ndarray | None = field(default=None, repr=False)
    name: str = ""
    at_bounds: list[str] = field(default_factory=list)  # exponents stuck at 0 or exp_max

    def _vec_predict(self, vec: np.ndarray, *xs) -> np.ndarray:
        k = len(self.inputs)
        out = vec[0]
        for j in range(k):
            out = out + vec[1 + j] * np.asarray(xs[j], dtype=np.float64) ** (-vec[1 + k + j])
        return out

    def _vec(self) -> np.ndarray:
        return np.array(list(self.params.values()))

    def predict(self, *xs) -> np.ndarray:
        return self._vec_predict(self._vec(), *xs)

    def predict_ci(self, *xs, level: float | None = None):
        arrs = [np.atleast_1d(np.asarray(x, dtype=np.float64)) for x in xs]
        if self.samples is None:
            nan = np.full(arrs[0].shape, np.nan)
            return nan, nan
        s = self.samples[np.all(np.isfinite(self.samples), axis=1)]
        preds = np.stack([self._vec_predict(v, *arrs) for v in s])
        q = (1.0 - (level or self.ci_level)) / 2.0
        lo, hi = np.quantile(preds, [q, 1 - q], axis=0)
        return lo, hi

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "formula": self.formula, "inputs": list(self.inputs),
                "params": self.params, "ci": {k: list(v) for k, v in self.ci.items()},
                "ci_level": self.ci_level, "r2": self.r2, "n": self.n,
                "n_bootstrap": self.n_bootstrap, "fixed": self.fixed, "at_bounds": self.at_bounds}


def _fit(xs_raw: list[np.ndarray], y: np.ndarray, names: list[str], formula: str,
         inputs: tuple[str, ...], *, fix_e, n_bootstrap, ci_level, seed, n_jobs,
         exp_max, name) -> PowerLawFit:
    y = np.asarray(y, dtype=np.float64)
    xs_raw = [np.asarray(x, dtype=np.float64) for x in xs_raw]
    ok = np.isfinite(y) & np.all([np.isfinite(x) & (x > 0) for x in xs_raw], axis=0)
    y = y[ok]
    xs_raw = [x[ok] for x in xs_raw]
    n_free = (0 if fix_e is not None else 1) + 2 * len(xs_raw)
    if y.size < n_free + 1:
        raise ValueError(f"{name or formula}: need at least {n_free + 1} points (got {y.size})")
    xrefs = [float(np.exp(np.mean(np.log(x)))) for x in xs_raw]
    xs = [x / r for x, r in zip(xs_raw, xrefs)]
    w1 = np.ones_like(y)
    exps, coef, sse = _solve(xs, y, w1, fix_e, exp_max)
    vec = _pack(exps, coef, fix_e, xrefs)
    sst = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - sse / sst if sst > 0 else math.nan
    ci = {k: (math.nan, math.nan) for k in names}
    samples = None
    if n_bootstrap and n_bootstrap > 0:
        wts = resample_weights(y.size, n_bootstrap, seed)
        fn = functools.partial(_boot_chunk, xs=xs, y=y, fix_e=fix_e, exp_max=exp_max, xrefs=xrefs,
                               start=exps if len(xs) > 1 else None)
        samples = parallel_chunks(fn, wts, n_jobs, min_per_job=200)
        lo, hi = percentile_ci(samples, ci_level)
        ci = {k: (float(lo[i]), float(hi[i])) for i, k in enumerate(names)}
    fixed = {"e": float(fix_e)} if fix_e is not None else {}
    k = len(xs_raw)
    at_bounds = [n for n, v in zip(names[1 + k:], exps) if v < 1e-4 or v > exp_max - 1e-4]
    return PowerLawFit(formula=formula, inputs=inputs,
                       params={k: float(v) for k, v in zip(names, vec)}, ci=ci,
                       ci_level=ci_level, r2=float(r2), n=int(y.size),
                       n_bootstrap=int(n_bootstrap or 0), fixed=fixed, samples=samples, name=name,
                       at_bounds=at_bounds)


def fit_power_law(x, y, *, fix_e: float | None = None, n_bootstrap: int = 1000,
                  ci_level: float = 0.90, seed: int | None = 0, n_jobs: int | None = 1,
                  exp_max: float = _EXP_MAX, name: str = "", input_name: str = "C") -> PowerLawFit:
    """Fit m(x) = e + A x^-beta (beta in [0, exp_max]); bootstrap percentile CIs."""
    return _fit([x], y, ["e", "A", "beta"], f"m({input_name}) = e + A*{input_name}^-beta",
                (input_name,), fix_e=fix_e, n_bootstrap=n_bootstrap, ci_level=ci_level,
                seed=seed, n_jobs=n_jobs, exp_max=exp_max, name=name)


def fit_joint_power(params, tokens, y, *, fix_e: float | None = None, n_bootstrap: int = 500,
                    ci_level: float = 0.90, seed: int | None = 0, n_jobs: int | None = 1,
                    exp_max: float = _EXP_MAX, name: str = "") -> PowerLawFit:
    """Fit m(P, D) = e + A_P P^-alpha + A_D D^-beta; bootstrap percentile CIs."""
    return _fit([params, tokens], y, ["e", "A_P", "A_D", "alpha", "beta"],
                "m(P,D) = e + A_P*P^-alpha + A_D*D^-beta", ("P", "D"), fix_e=fix_e,
                n_bootstrap=n_bootstrap, ci_level=ci_level, seed=seed, n_jobs=n_jobs,
                exp_max=exp_max, name=name)
