import json

import numpy as np
import polars as pl
import pytest

from model.scaling import fit_scaling, targets_frame, extrapolate

from .conftest import synthetic_runs


def _table(seed=0, noise=0.005, metric=True):
    N, D, C, L, t = synthetic_runs(seed=seed, noise=noise)
    rng = np.random.default_rng(seed)
    df = pl.DataFrame({"params": N, "tokens": D, "flops": C, "loss": L, "budget": C})
    if metric:
        m = 0.02 + 50.0 * C ** -0.2 + rng.normal(0, 0.001, C.size)
        df = df.with_columns(pl.Series("concept_loss", m))
    return df, t


def test_holdout_extrapolation_predicts_the_largest_runs():
    df, t = _table()
    cut = float(np.quantile(df["params"].to_numpy(), 0.8))
    rep = fit_scaling(df, holdout_params_above=cut, n_bootstrap=200, n_bootstrap_isoflop=100,
                      n_bootstrap_metrics=100)
    ex = rep.extrapolation
    held = df.filter(pl.col("params") > cut).height
    joint = ex.filter((pl.col("quantity") == "loss") & (pl.col("law") == "joint L(P,D)"))
    assert joint.height == held
    assert joint["actual"].is_not_null().all()
    # predicted vs actual: within 2% (noise 0.5%) for runs up to ~10x beyond the fit range
    assert joint["rel_error"].abs().max() < 0.02
    cm = ex.filter(pl.col("quantity") == "concept_loss")
    assert cm.height == 2 * held  # m(C) and m(P,D)
    assert rep.main.runs.height == df.height - held


def test_targets_frame_and_extrapolate_band():
    df, t = _table(metric=False)
    rep = fit_scaling(df, n_bootstrap=200, n_bootstrap_isoflop=100)
    tg = targets_frame(params=[8e9], flops=[1e23])
    ex = extrapolate(rep.main, tg)
    row = ex.filter(pl.col("law") == "joint L(P,D)").row(0, named=True)
    truth = t["E"] + t["A"] / 8e9 ** t["alpha"] + t["B"] / row["tokens"] ** t["beta"]
    assert row["lo"] <= truth <= row["hi"]
    assert np.isnan(row["actual"])


def test_report_writes_tables_json_and_pngs(tmp_path):
    df, _ = _table()
    df = df.with_columns(pl.lit("cdlm_concept").alias("family"))
    rep = fit_scaling(df, n_bootstrap=100, n_bootstrap_isoflop=100, n_bootstrap_metrics=100)
    out = rep.write(tmp_path)
    d = json.loads((tmp_path / "fits.json").read_text())
    fam = d["families"]["cdlm_concept"]
    assert fam["joint"]["params"]["alpha"] > 0 and fam["isoflop"]["params"]["a_P"] > 0
    assert fam["metrics"]["concept_loss"]["compute"]["r2"] > 0.9
    for name in ("isoflop", "frontier", "surface", "metrics"):
        png = tmp_path / f"{name}_cdlm_concept.png"
        assert png.exists() and png.read_bytes()[:4] == b"\x89PNG", name
    par = pl.read_parquet(tmp_path / "parameters.parquet")
    assert {"joint_chinchilla", "isoflop", "metric_compute", "metric_joint"} <= set(par["fit"])
    assert pl.read_csv(tmp_path / "isoflop_minima.csv").height == 6
    assert "fits_json" in out


def test_families_are_fitted_separately():
    a, _ = _table(seed=1, metric=False)
    b, _ = _table(seed=2, metric=False)
    b = b.with_columns(pl.col("loss") + 0.5)  # a worse family: higher irreducible loss
    df = pl.concat([a.with_columns(pl.lit("ar").alias("family")),
                    b.with_columns(pl.lit("cdlm").alias("family"))])
    rep = fit_scaling(df, n_bootstrap=50, n_bootstrap_isoflop=50)
    assert set(rep.families) == {"ar", "cdlm"}
    assert rep["cdlm"].joint.params["E"] > rep["ar"].joint.params["E"] + 0.3


def test_unknown_option_and_metric_rejected():
    df, _ = _table(metric=False)
    with pytest.raises(TypeError):
        fit_scaling(df, n_bootstraps=3)
    with pytest.raises(ValueError, match="nope"):
        fit_scaling(df, metrics=["nope"], n_bootstrap=0)
