import argparse
import json

import polars as pl
import pytest

from atlas import cli_scaling


def run_cli(argv):
    p = argparse.ArgumentParser(prog="atlas")
    sub = p.add_subparsers(dest="command", required=True)
    cli_scaling.add_commands(sub)
    args = p.parse_args(argv)
    return args.func(args)


def test_fit_json_and_exclude_highest_loss(chinchilla_csv, capsys):
    rc = run_cli(["scaling", "fit", "--runs", str(chinchilla_csv), "--json", "--bootstrap", "40"])
    assert rc == 0
    full = json.loads(capsys.readouterr().out)
    rc = run_cli(["scaling", "fit", "--runs", str(chinchilla_csv), "--json", "--bootstrap", "40",
                  "--exclude-highest-loss", "5"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    j, j0 = d["families"]["all"]["joint"], full["families"]["all"]["joint"]
    assert j0["n_runs"] == 245 and j["n_runs"] == 240
    assert d["n_excluded_highest_loss"] == 5
    assert j["params"]["alpha"] == pytest.approx(0.3478, rel=0.03)
    assert j["params"]["alpha"] != pytest.approx(j0["params"]["alpha"], rel=1e-4)
    lo, hi = j["ci"]["beta"]
    assert lo < j["params"]["beta"] < hi


def test_fit_writes_outputs_from_parquet(tmp_path, capsys, chinchilla_csv):
    df = pl.read_csv(chinchilla_csv).select(
        pl.col("Model Size").alias("params"), pl.col("Training FLOP").alias("flops"), "loss")
    p = tmp_path / "runs.parquet"
    df.write_parquet(p)
    rc = run_cli(["scaling", "fit", "--runs", str(p), "--bootstrap", "20", "--out",
                  str(tmp_path / "fits")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "alpha=" in out
    assert (tmp_path / "fits" / "fits.json").exists()
    assert (tmp_path / "fits" / "surface_all.png").exists()


def test_fit_bad_file_names_missing_column(tmp_path, capsys):
    p = tmp_path / "bad.csv"
    pl.DataFrame({"params": [1e6, 2e6], "tokens": [1e9, 1e9]}).write_csv(p)
    rc = run_cli(["scaling", "fit", "--runs", str(p)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "missing required column" in err and "loss" in err
    rc = run_cli(["scaling", "fit", "--runs", str(tmp_path / "nope.csv")])
    assert rc == 2 and "not found" in capsys.readouterr().err


def test_plan_json(tmp_path, capsys):
    rc = run_cli(["scaling", "plan", "--budgets", "1e10", "3e10", "--families", "ar",
                  "--sizes", "3", "--json", "--out", str(tmp_path / "plan.json")])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert len(d["runs"]) == 6
    assert all(abs(r["flops_ratio"] - 1) < 0.03 for r in d["runs"])
    assert (tmp_path / "plan.json").exists()
    rc = run_cli(["scaling", "plan", "--budgets", "1e5"])
    assert rc == 2


def test_registered_on_the_atlas_cli(chinchilla_csv, capsys):
    cli = pytest.importorskip("atlas.cli")
    if not hasattr(cli, "main"):
        pytest.skip("atlas.cli has no main yet")
    try:
        rc = cli.main(["scaling", "fit", "--runs", str(chinchilla_csv), "--json", "--bootstrap", "0",
                       "--exclude-highest-loss", "5"])
    except SystemExit as e:  # the lead's CLI does not register the group (yet)
        pytest.skip(f"scaling group not registered on atlas.cli ({e})")
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert d["families"]["all"]["joint"]["n_runs"] == 240


def test_parallel_bootstrap_matches_serial(chinchilla_csv):
    import numpy as np

    from model.scaling import exclude_highest_loss, fit_chinchilla, read_runs
    from model.scaling.table import as_arrays

    N, D, _, L = as_arrays(exclude_highest_loss(read_runs(chinchilla_csv), 5))
    a = fit_chinchilla(N, D, L, n_bootstrap=500, n_jobs=1, seed=7, n_refine=16)
    b = fit_chinchilla(N, D, L, n_bootstrap=500, n_jobs=2, seed=7, n_refine=16)
    np.testing.assert_allclose(a.samples, b.samples, rtol=1e-6)
