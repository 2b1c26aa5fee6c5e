"""Bootstrap helpers shared by the fits: resample weights, percentile CIs, parallel map."""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Sequence

import numpy as np

__all__ = ["resample_weights", "percentile_ci", "parallel_chunks", "default_jobs",
           "single_thread_blas"]


def single_thread_blas():
    """Context manager limiting BLAS to one thread.

    The fits make many tiny BLAS calls (L-BFGS-B's level-1 routines, 3-column lstsq);
    a multi-threaded OpenBLAS turns each into a thread wake-up, which on a busy machine
    made them ~30x slower.  No-op when threadpoolctl is unavailable.
    """
    try:
        from threadpoolctl import threadpool_limits

        return threadpool_limits(1)
    except Exception:  # pragma: no cover
        import contextlib

        return contextlib.nullcontext()


def resample_weights(n: int, n_boot: int, seed: int | None,
                     strata: np.ndarray | None = None) -> np.ndarray:
    """(n_boot, n) multiplicity weights of nonparametric bootstrap resamples.

    With ``strata`` (one integer label per row) rows are resampled within each
    stratum (used by the IsoFLOP fit: resample runs within each budget).
    """
    rng = np.random.default_rng(seed)
    w = np.zeros((n_boot, n), dtype=np.float64)
    if strata is None:
        idx = rng.integers(0, n, size=(n_boot, n))
        for b in range(n_boot):
            w[b] = np.bincount(idx[b], minlength=n)
        return w
    strata = np.asarray(strata)
    for s in np.unique(strata):
        rows = np.flatnonzero(strata == s)
        pick = rng.integers(0, rows.size, size=(n_boot, rows.size))
        for b in range(n_boot):
            w[b, rows] = np.bincount(pick[b], minlength=rows.size)
    return w


def percentile_ci(samples: np.ndarray, level: float = 0.90) -> tuple[np.ndarray, np.ndarray]:
    """Percentile interval of bootstrap ``samples`` (n_boot, k), ignoring NaN rows."""
    samples = np.asarray(samples, dtype=np.float64)
    if samples.ndim == 1:
        samples = samples[:, None]
    ok = np.all(np.isfinite(samples), axis=1)
    if not ok.any():
        nan = np.full(samples.shape[1], np.nan)
        return nan, nan
    q = (1.0 - level) / 2.0
    lo, hi = np.quantile(samples[ok], [q, 1.0 - q], axis=0)
    return lo, hi


def default_jobs() -> int:
    """Worker processes for bootstraps: ATLAS_SCALING_JOBS, else min(4, cpu_count // 2).

    Half the cores: on small shared machines (2 cores) forking workers measured slower
    than serial; on larger hosts 4 workers cut a 4,000-resample bootstrap ~3x.
    """
    env = os.environ.get("ATLAS_SCALING_JOBS")
    if env:
        return max(1, int(env))
    return max(1, min(4, (os.cpu_count() or 1) // 2))


def _limit_blas_threads() -> None:
    """Worker initializer: one BLAS thread per process (oversubscription is very slow)."""
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(1)
    except Exception:  # pragma: no cover - threadpoolctl is optional
        pass


def _ray_driver_active() -> bool:
    import sys

    ray = sys.modules.get("ray")
    try:
        return bool(ray is not None and ray.is_initialized())
    except Exception:  # pragma: no cover
        return False


def parallel_chunks(fn: Callable[[np.ndarray], np.ndarray], weights: np.ndarray,
                    n_jobs: int | None, min_per_job: int = 250) -> np.ndarray:
    """Apply ``fn`` (weights chunk -> results chunk) over row-chunks of ``weights``.

    Uses a process pool (fork where available) when there is enough work; ``fn``
    must be picklable (a module-level function or functools.partial of one).
    """
    n_boot = weights.shape[0]
    jobs = default_jobs() if n_jobs is None else max(1, int(n_jobs))
    jobs = min(jobs, max(1, n_boot // min_per_job))
    if jobs > 1 and _ray_driver_active():
        jobs = 1  # never fork a live Ray driver (its threads and sockets do not survive fork)
    if jobs <= 1:
        try:
            from threadpoolctl import threadpool_limits
        except Exception:  # pragma: no cover
            return fn(weights)
        with threadpool_limits(1):
            return fn(weights)
    chunks: Sequence[np.ndarray] = np.array_split(weights, jobs)
    import multiprocessing as mp

    try:
        ctx = mp.get_context("fork")
    except ValueError:  # pragma: no cover - non-POSIX
        ctx = mp.get_context("spawn")
    try:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx,
                                 initializer=_limit_blas_threads) as ex:
            parts = list(ex.map(fn, chunks))
    except Exception:  # pragma: no cover - fall back to serial on pool failures
        return fn(weights)
    return np.concatenate(parts, axis=0)
