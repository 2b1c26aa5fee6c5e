"""Runs-table I/O for the scaling analysis.

A *runs table* has one row per training run with at least

* ``params``  -- model parameter count N,
* ``tokens``  -- training tokens D, **or** ``flops`` -- training compute C,
* ``loss``    -- final validation loss (nats / token),

plus any number of optional numeric metric columns (e.g. ``concept_loss``) and an
optional ``budget`` column (the nominal IsoFLOP budget a run was planned for) and
``family`` column.

When only one of ``tokens`` / ``flops`` is present the other is derived with the
standard dense-transformer approximation C = 6 N D (the convention used by the
Chinchilla data and by Besiroglu et al. 2024: D = FLOP / (6 N)).  Tables written by
the sweep runner carry both, with ``flops`` computed by ``model.flops`` (6N plus
the attention term), so no approximation is applied to them.

A few common spellings are accepted as aliases (matched case-insensitively, with
spaces / dashes treated as underscores), e.g. the Epoch AI extraction of Chinchilla
Figure 4 uses ``Model Size`` and ``Training FLOP``.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import polars as pl

__all__ = [
    "RunsTableError",
    "REQUIRED_COLUMNS",
    "COLUMN_ALIASES",
    "read_runs",
    "read_targets",
    "normalize_runs",
    "exclude_highest_loss",
    "write_table",
    "metric_columns",
]

REQUIRED_COLUMNS = ("params", "loss")

# canonical name -> accepted spellings (after normalisation: lower case, [ -] -> _)
COLUMN_ALIASES: dict[str, tuple[str, ...]] = {
    "params": ("params", "n", "n_params", "num_params", "parameters", "model_size"),
    "tokens": ("tokens", "d", "n_tokens", "num_tokens", "train_tokens", "tokens_seen"),
    "flops": ("flops", "c", "compute", "training_flop", "training_flops", "train_flops"),
    "loss": ("loss", "l", "val_loss", "validation_loss", "final_loss"),
}

# columns that are never treated as interpretability metrics
_NON_METRIC = {
    "params", "tokens", "flops", "loss", "budget", "family", "run_id", "status",
    "error", "wall_s", "train_loss", "tokens_seen", "params_non_embedding",
    "params_embedding", "params_concept", "n_layers", "d_model", "n_heads",
    "attempts", "seed", "x", "y", "color", "hex_color", "shape", "size_index",
    "budget_index", "flops_per_token", "seq_len", "batch_size", "steps", "lr",
    "params_total", "train_s", "prep_s", "tokens_per_s", "flops_6nd", "flops_ratio",
    "target_params", "val_loss", "grad_norm",
}


class RunsTableError(ValueError):
    """The runs table is malformed (missing column, non-positive values, ...)."""


def _norm(name: str) -> str:
    return re.sub(r"[\s\-]+", "_", name.strip().lower())


def _rename_aliases(df: pl.DataFrame) -> pl.DataFrame:
    present = {_norm(c): c for c in df.columns}
    rename: dict[str, str] = {}
    for canon, spellings in COLUMN_ALIASES.items():
        if canon in df.columns:
            continue
        for s in spellings:
            if s in present and present[s] not in rename and present[s] not in COLUMN_ALIASES:
                rename[present[s]] = canon
                break
    return df.rename(rename) if rename else df


def normalize_runs(df: pl.DataFrame, *, source: str = "runs table") -> pl.DataFrame:
    """Validate a runs table and fill ``tokens``/``flops`` (C = 6 N D if one is missing).

    Raises :class:`RunsTableError` naming the missing / bad column.
    """
    df = _rename_aliases(df)
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if "tokens" not in df.columns and "flops" not in df.columns:
        missing.append("tokens (or flops)")
    if missing:
        raise RunsTableError(
            f"{source}: missing required column(s): {', '.join(missing)}; "
            f"found columns: {', '.join(df.columns) or '(none)'}. "
            "Expected columns: params, tokens (or flops), loss, optional metric columns."
        )
    if "status" in df.columns:
        df = df.filter(pl.col("status").cast(pl.Utf8) == "ok")
    num = [c for c in ("params", "tokens", "flops", "loss") if c in df.columns]
    try:
        df = df.with_columns([pl.col(c).cast(pl.Float64) for c in num])
    except Exception as exc:  # polars raises InvalidOperationError etc.
        raise RunsTableError(f"{source}: columns {num} must be numeric ({exc})") from exc
    df = df.drop_nulls(subset=num)
    if "tokens" not in df.columns:
        df = df.with_columns((pl.col("flops") / (6.0 * pl.col("params"))).alias("tokens"))
    if "flops" not in df.columns:
        df = df.with_columns((6.0 * pl.col("params") * pl.col("tokens")).alias("flops"))
    for c in ("params", "tokens", "flops", "loss"):
        bad = df.filter(~(pl.col(c) > 0) | ~pl.col(c).is_finite())
        if bad.height:
            raise RunsTableError(f"{source}: column '{c}' must be finite and > 0 "
                                 f"({bad.height} bad row(s))")
    if df.height == 0:
        raise RunsTableError(f"{source}: no usable rows")
    return df


def read_runs(path: str | Path) -> pl.DataFrame:
    """Read a CSV or Parquet runs table and :func:`normalize_runs` it."""
    p = Path(path)
    if not p.exists():
        raise RunsTableError(f"runs table not found: {p}")
    suffix = p.suffix.lower()
    try:
        if suffix in (".parquet", ".pq"):
            df = pl.read_parquet(p)
        elif suffix in (".csv", ".txt", ".tsv"):
            df = pl.read_csv(p, separator="\t" if suffix == ".tsv" else ",",
                             infer_schema_length=10000)
        else:
            raise RunsTableError(f"{p}: unsupported table format '{suffix}' (use .csv or .parquet)")
    except RunsTableError:
        raise
    except Exception as exc:
        raise RunsTableError(f"{p}: cannot read table ({exc})") from exc
    return normalize_runs(df, source=str(p))


def read_targets(path: str | Path) -> pl.DataFrame:
    """Read a targets table for extrapolation: ``params`` and ``tokens`` or ``flops``
    (C = 6 N D fills the other); ``loss`` / metric columns, when present, are actuals."""
    p = Path(path)
    if not p.exists():
        raise RunsTableError(f"targets table not found: {p}")
    df = pl.read_parquet(p) if p.suffix.lower() in (".parquet", ".pq") else pl.read_csv(p)
    df = _rename_aliases(df)
    if "params" not in df.columns or ("tokens" not in df.columns and "flops" not in df.columns):
        raise RunsTableError(f"{p}: targets need columns params and tokens (or flops); "
                             f"found: {', '.join(df.columns)}")
    df = df.with_columns([pl.col(c).cast(pl.Float64) for c in ("params", "tokens", "flops")
                          if c in df.columns])
    if "tokens" not in df.columns:
        df = df.with_columns((pl.col("flops") / (6.0 * pl.col("params"))).alias("tokens"))
    if "flops" not in df.columns:
        df = df.with_columns((6.0 * pl.col("params") * pl.col("tokens")).alias("flops"))
    return df


def exclude_highest_loss(df: pl.DataFrame, n: int) -> pl.DataFrame:
    """Drop the ``n`` runs with the highest loss (Besiroglu et al. drop 5)."""
    if n <= 0:
        return df
    if n >= df.height:
        raise RunsTableError(f"cannot drop {n} highest-loss runs from a table of {df.height}")
    return df.sort("loss", descending=True).slice(n).sort(["flops", "params"])


def metric_columns(df: pl.DataFrame) -> list[str]:
    """Numeric columns other than the bookkeeping ones: the interpretability metrics."""
    out = []
    for c, dt in zip(df.columns, df.dtypes):
        if c in _NON_METRIC or c.startswith("params_"):
            continue
        if dt.is_numeric() and df[c].drop_nulls().len() > 0:
            out.append(c)
    return out


def write_table(df: pl.DataFrame, path: str | Path) -> Path:
    """Write ``df`` as Parquet or CSV according to the suffix (atomic rename)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    suffix = p.suffix.lower()
    if suffix in (".parquet", ".pq"):
        df.write_parquet(tmp)
    elif suffix == ".csv":
        flat = df.select([c for c, dt in zip(df.columns, df.dtypes)
                          if not isinstance(dt, (pl.List, pl.Struct, pl.Array))])
        flat.write_csv(tmp)
    else:
        raise ValueError(f"unsupported table suffix: {p.suffix}")
    tmp.replace(p)
    return p


def as_arrays(df: pl.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(params, tokens, flops, loss) as float64 numpy arrays."""
    return tuple(df[c].to_numpy().astype(np.float64) for c in ("params", "tokens", "flops", "loss"))
