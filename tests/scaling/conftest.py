from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# A verbatim copy shipped with the project (tests/data/README.md), so no ../shared is needed.
CHINCHILLA_CSV = ROOT / "tests" / "data" / "scaling" / "chinchilla_figure4_extracted.csv"


@pytest.fixture(scope="session")
def chinchilla_csv() -> Path:
    assert CHINCHILLA_CSV.is_file(), f"shipped test data missing: {CHINCHILLA_CSV}"
    return CHINCHILLA_CSV


TRUE = dict(E=1.7, A=400.0, B=1500.0, alpha=0.34, beta=0.30)


def synthetic_runs(seed: int = 0, noise: float = 0.01, n_budgets: int = 6, n_sizes: int = 9,
                   true: dict | None = None):
    """IsoFLOP-style grid from a known Chinchilla law with multiplicative log-normal noise."""
    from model.scaling import chinchilla_loss

    p = dict(TRUE if true is None else true)
    rng = np.random.default_rng(seed)
    N, D, C = [], [], []
    for Cb in np.logspace(18, 21, n_budgets):
        nc = 0.09 * Cb ** 0.5
        for f in np.logspace(-1, 1, n_sizes):
            n = nc * f
            N.append(n)
            D.append(Cb / (6 * n))
            C.append(Cb)
    N, D, C = map(np.asarray, (N, D, C))
    L = chinchilla_loss(N, D, **p) * np.exp(rng.normal(0.0, noise, N.size))
    return N, D, C, L, p
