import time

import pytest

from model.scaling import exclude_highest_loss, fit_chinchilla, read_runs
from model.scaling.table import as_arrays

from .conftest import synthetic_runs

PUBLISHED = dict(alpha=0.3478, beta=0.3658, E=1.82, A=482.01, B=2085.43)  # Besiroglu et al. 2024
TOL = dict(alpha=0.03, beta=0.03, E=0.03, A=0.05, B=0.05)


def test_reproduces_published_chinchilla_replication(chinchilla_csv):
    df = exclude_highest_loss(read_runs(chinchilla_csv), 5)
    assert df.height == 240
    N, D, _, L = as_arrays(df)
    t0 = time.perf_counter()
    fit = fit_chinchilla(N, D, L, n_bootstrap=300, seed=1)
    elapsed = time.perf_counter() - t0
    for k, v in PUBLISHED.items():
        assert fit.params[k] == pytest.approx(v, rel=TOL[k]), (k, fit.params[k])
    for k in PUBLISHED:
        lo, hi = fit.ci[k]
        assert lo < fit.params[k] < hi, k
        assert hi > lo
    # the published standard errors (alpha 0.02, beta 0.02, E 0.03) are of this size
    assert 0.005 < fit.se["alpha"] < 0.05 and 0.005 < fit.se["E"] < 0.08
    assert fit.r2_log > 0.99
    # closed-form compute-optimal exponent a = beta / (alpha + beta) ~ 0.51 for this fit
    assert fit.to_dict()["compute_optimal_exponents"]["a_N"] == pytest.approx(0.514, abs=0.02)
    print(f"chinchilla fit: {fit.params} ({elapsed:.1f}s incl. 300 bootstraps)")


def test_full_grid_matches_screened_grid(chinchilla_csv):
    df = exclude_highest_loss(read_runs(chinchilla_csv), 5)
    N, D, _, L = as_arrays(df)
    a = fit_chinchilla(N, D, L, n_bootstrap=0, n_refine=16)
    b = fit_chinchilla(N, D, L, n_bootstrap=0, n_refine=256)
    for k in a.params:
        assert a.params[k] == pytest.approx(b.params[k], rel=1e-3)


def test_recovers_synthetic_parameters_within_cis():
    N, D, _, L, true = synthetic_runs(seed=3, noise=0.01)
    fit = fit_chinchilla(N, D, L, n_bootstrap=300, seed=0, ci_level=0.95)
    for k, v in true.items():
        lo, hi = fit.ci[k]
        assert lo <= v <= hi, (k, v, fit.ci[k], fit.params[k])
    assert fit.params["alpha"] == pytest.approx(true["alpha"], rel=0.15)
    assert fit.params["E"] == pytest.approx(true["E"], rel=0.10)
    # predictions and their bootstrap band
    lo, hi = fit.predict_ci([1e10], [2e11])
    truth = true["E"] + true["A"] / 1e10 ** true["alpha"] + true["B"] / 2e11 ** true["beta"]
    assert lo[0] <= truth <= hi[0]


def test_noisier_data_gives_wider_cis():
    N, D, _, L, _ = synthetic_runs(seed=5, noise=0.005)
    narrow = fit_chinchilla(N, D, L, n_bootstrap=150, seed=0)
    N, D, _, L, _ = synthetic_runs(seed=5, noise=0.03)
    wide = fit_chinchilla(N, D, L, n_bootstrap=150, seed=0)
    w = lambda f, k: f.ci[k][1] - f.ci[k][0]  # noqa: E731
    assert w(wide, "alpha") > 2 * w(narrow, "alpha")


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="at least 6"):
        fit_chinchilla([1e6] * 3, [1e9] * 3, [3.0] * 3)
    with pytest.raises(ValueError, match="> 0"):
        fit_chinchilla([1e6] * 6 + [-1], [1e9] * 7, [3.0] * 7)
