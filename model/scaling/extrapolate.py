"""Extrapolation of fitted laws to target sizes (paper Tables 7/8): predicted vs actual."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

if TYPE_CHECKING:  # pragma: no cover
    from .report import FamilyFits

__all__ = ["extrapolate", "targets_frame"]


def targets_frame(params=None, tokens=None, flops=None, flops_per_param_token: float = 6.0,
                  **actual) -> pl.DataFrame:
    """Build a targets table from arrays/scalars; missing tokens = flops / (k N).

    ``actual`` may carry known outcomes, e.g. ``loss=[2.1]`` or ``concept_loss=[...]``.
    """
    cols: dict[str, np.ndarray] = {}
    if params is None:
        raise ValueError("targets need params")
    cols["params"] = np.atleast_1d(np.asarray(params, dtype=np.float64))
    if tokens is None and flops is None:
        raise ValueError("targets need tokens or flops")
    if tokens is None:
        tokens = np.atleast_1d(np.asarray(flops, dtype=np.float64)) / (flops_per_param_token * cols["params"])
    cols["tokens"] = np.broadcast_to(np.atleast_1d(np.asarray(tokens, dtype=np.float64)), cols["params"].shape)
    if flops is None:
        flops = flops_per_param_token * cols["params"] * cols["tokens"]
    cols["flops"] = np.broadcast_to(np.atleast_1d(np.asarray(flops, dtype=np.float64)), cols["params"].shape)
    for k, v in actual.items():
        cols[k] = np.broadcast_to(np.atleast_1d(np.asarray(v, dtype=np.float64)), cols["params"].shape)
    return pl.DataFrame({k: np.array(v) for k, v in cols.items()})


def extrapolate(fits: "FamilyFits", targets: pl.DataFrame) -> pl.DataFrame:
    """Predict loss (joint fit) and each fitted metric at ``targets``.

    Returns one row per (target, quantity): params, tokens, flops, quantity, law,
    predicted, lo, hi (bootstrap band at the fits' CI level), actual (if the target table
    has that column), error = predicted - actual, rel_error.
    """
    P = targets["params"].to_numpy().astype(np.float64)
    D = targets["tokens"].to_numpy().astype(np.float64)
    C = (targets["flops"].to_numpy().astype(np.float64) if "flops" in targets.columns
         else 6.0 * P * D)
    rows: list[dict] = []

    def add(quantity, law, pred, lo, hi):
        act = (targets[quantity].to_numpy().astype(np.float64)
               if quantity in targets.columns else np.full(P.shape, np.nan))
        for i in range(P.size):
            a = float(act[i])
            err = float(pred[i] - a) if math.isfinite(a) else math.nan
            rows.append({"family": fits.family, "params": float(P[i]), "tokens": float(D[i]),
                         "flops": float(C[i]), "quantity": quantity, "law": law,
                         "predicted": float(pred[i]), "lo": float(lo[i]), "hi": float(hi[i]),
                         "actual": a, "error": err,
                         "rel_error": err / a if math.isfinite(err) and a != 0 else math.nan})

    if fits.joint is not None:
        lo, hi = fits.joint.predict_ci(P, D)
        add("loss", "joint L(P,D)", fits.joint.predict(P, D), lo, hi)
    if fits.isoflop is not None:
        p = fits.isoflop.predict(C)["loss_opt"]
        add("loss", "isoflop L*(C) (compute-optimal)", p, np.full(P.shape, np.nan),
            np.full(P.shape, np.nan))
    for name, mf in fits.metrics.items():
        if mf.get("joint") is not None:
            f = mf["joint"]
            lo, hi = f.predict_ci(P, D)
            add(name, "joint m(P,D)", f.predict(P, D), lo, hi)
        if mf.get("compute") is not None:
            f = mf["compute"]
            lo, hi = f.predict_ci(C)
            add(name, "m(C)", f.predict(C), lo, hi)
    schema = {"family": pl.Utf8, "params": pl.Float64, "tokens": pl.Float64, "flops": pl.Float64,
              "quantity": pl.Utf8, "law": pl.Utf8, "predicted": pl.Float64, "lo": pl.Float64,
              "hi": pl.Float64, "actual": pl.Float64, "error": pl.Float64,
              "rel_error": pl.Float64}
    return pl.DataFrame(rows, schema=schema)
