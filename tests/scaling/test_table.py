import polars as pl
import pytest

from model.scaling import RunsTableError, exclude_highest_loss, metric_columns, read_runs


def test_reads_chinchilla_aliases_and_derives_tokens(chinchilla_csv):
    df = read_runs(chinchilla_csv)
    assert df.height == 245
    assert {"params", "tokens", "flops", "loss"} <= set(df.columns)
    # tokens = FLOP / (6 N)
    r = df.row(0, named=True)
    assert r["tokens"] == pytest.approx(r["flops"] / (6 * r["params"]), rel=1e-12)
    assert metric_columns(df) == []  # x, y, colours are not metrics


def test_missing_column_is_named(tmp_path):
    p = tmp_path / "bad.csv"
    pl.DataFrame({"params": [1e6, 2e6], "flops": [1e15, 2e15]}).write_csv(p)
    with pytest.raises(RunsTableError, match="loss"):
        read_runs(p)
    p2 = tmp_path / "bad2.parquet"
    pl.DataFrame({"params": [1e6], "loss": [3.0]}).write_parquet(p2)
    with pytest.raises(RunsTableError, match=r"tokens \(or flops\)"):
        read_runs(p2)


def test_nonpositive_and_format_errors(tmp_path):
    p = tmp_path / "neg.csv"
    pl.DataFrame({"params": [1e6, -1.0], "tokens": [1e9, 1e9], "loss": [3.0, 2.0]}).write_csv(p)
    with pytest.raises(RunsTableError, match="params"):
        read_runs(p)
    q = tmp_path / "x.json"
    q.write_text("{}")
    with pytest.raises(RunsTableError, match="unsupported"):
        read_runs(q)


def test_exclude_highest_loss_and_status_filter():
    df = pl.DataFrame({"params": [1e6, 2e6, 3e6, 4e6], "tokens": [1e9] * 4,
                       "loss": [3.0, 5.0, 2.0, 4.0], "status": ["ok", "ok", "ok", "error"],
                       "concept_loss": [0.1, 0.2, 0.3, None]})
    from model.scaling import normalize_runs

    n = normalize_runs(df)
    assert n.height == 3  # failed run dropped
    assert metric_columns(n) == ["concept_loss"]
    kept = exclude_highest_loss(n, 1)
    assert sorted(kept["loss"].to_list()) == [2.0, 3.0]
