"""`atlas query` reads only the run's own tables and can neither write nor delete."""

import hashlib

import pyarrow as pa
import pytest

from atlas import query, storage
from atlas.cli import main


@pytest.fixture()
def run_root(tmp_path):
    out = tmp_path / "run"
    root = storage.resolve(str(out))
    storage.write_table(root, "documents", pa.table({"doc_id": ["a", "b"], "text": ["x", "y"]}))
    storage.write_table(root, "quarantine", pa.table({"reason": ["empty"]}))
    # A Parquet file outside the run's tables (another run, a stray export, ...)
    other = storage.resolve(str(tmp_path / "other"))
    storage.write_table(other, "documents", pa.table({"doc_id": ["secret"], "text": ["not this run"]}))
    return out, storage.table_path(other, "documents").path + "/part-00000.parquet"


def _snapshot(path):
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*")) if p.is_file()}


def test_select_over_run_tables(run_root):
    out, _ = run_root
    assert query.sql(str(out), "SELECT count(*) AS n FROM documents")["n"].to_list() == [2]
    # a literal or comment that merely mentions a file function is fine
    df = query.sql(str(out), "SELECT 'read_parquet(x)' AS s /* read_csv( */ FROM documents -- read_ipc(\nLIMIT 1")
    assert df["s"].to_list() == ["read_parquet(x)"]
    df = query.sql(str(out), "WITH d AS (SELECT doc_id FROM documents) SELECT d.doc_id, q.reason FROM d CROSS JOIN quarantine q ORDER BY 1;")
    assert df.height == 2


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT * FROM read_parquet('{other}')",
        "SELECT * FROM READ_PARQUET('{other}')",
        'SELECT * FROM "read_parquet"(\'{other}\')',
        "SELECT * FROM read_csv('/etc/passwd')",
        "SELECT * FROM read_json('/etc/hostname')",
        "SELECT * FROM documents UNION ALL SELECT * FROM read_parquet('{other}')",
        "SELECT * FROM documents d, read_ipc('{other}') o",
        "SELECT * FROM (SELECT * FROM read_parquet ('{other}')) AS t",
    ],
)
def test_file_reading_functions_refused(run_root, sql):
    out, other = run_root
    with pytest.raises(query.QueryError, match=r"reads files outside the run"):
        query.sql(str(out), sql.format(other=other))


@pytest.mark.parametrize(
    "sql",
    [
        "DROP TABLE documents",
        "DELETE FROM documents WHERE doc_id = 'a'",
        "TRUNCATE TABLE documents",
        "INSERT INTO documents VALUES ('c', 'z')",
        "CREATE TABLE t2 AS SELECT * FROM documents",
        "COPY documents TO '/tmp/atlas-query-copy.parquet'",
        "SELECT 1; DROP TABLE documents",
        "  -- comment\n  drop table documents",
    ],
)
def test_statements_that_change_anything_are_refused(run_root, sql):
    out, _ = run_root
    before = _snapshot(out)
    with pytest.raises(query.QueryError, match=r"only SELECT / WITH|one statement"):
        query.sql(str(out), sql)
    assert _snapshot(out) == before
    assert query.sql(str(out), "SELECT count(*) AS n FROM documents")["n"].to_list() == [2]


def test_scan_accepts_only_table_names(run_root):
    out, _ = run_root
    assert query.scan(str(out), "documents").collect().height == 2
    for name in ("../other/documents", "documents/../../other/documents", "not_a_table"):
        with pytest.raises(query.QueryError, match="unknown table"):
            query.scan(str(out), name)


def test_plan_check_refuses_scans_of_other_paths(run_root):
    """Second line of defence: whatever produced it, a plan scanning another file is refused."""
    out, other = run_root
    import polars as pl

    root = storage.resolve(str(out))
    allowed = [storage.table_path(root, t).path for t in ("documents", "quarantine")]
    query._check_plan(query.scan(str(out), "documents").join(query.scan(str(out), "quarantine"), how="cross"), allowed)
    with pytest.raises(query.QueryError, match="not one of this run's tables"):
        query._check_plan(query.scan(str(out), "documents").join(pl.scan_parquet(other), on="doc_id"), allowed)
    # a sibling directory whose name merely starts like an allowed one is not inside it
    with pytest.raises(query.QueryError):
        query._check_plan(pl.scan_parquet(other), [other.rsplit("/", 2)[0] + "-x"])


def test_cli_query_refusal_exit_code(run_root, capsys):
    out, other = run_root
    assert main(["query", str(out), f"SELECT * FROM read_parquet('{other}')"]) == 2
    assert "refused" in capsys.readouterr().err
    assert main(["query", str(out), "SELECT doc_id FROM documents ORDER BY doc_id", "--csv"]) == 0
    assert capsys.readouterr().out.split() == ["doc_id", "a", "b"]


def test_query_over_s3_run_and_refusal(s3_server, s3_client):
    from atlas.config import StorageConfig

    s3_client.create_bucket(Bucket="query-run")
    scfg = StorageConfig(s3_endpoint=s3_server, s3_allow_http=True)
    root = storage.resolve("s3://query-run/r1", scfg)
    storage.write_table(root, "documents", pa.table({"doc_id": ["a", "b", "c"], "text": ["x", "y", "z"]}))
    other = storage.resolve("s3://query-run/r2", scfg)
    storage.write_table(other, "documents", pa.table({"doc_id": ["secret"], "text": ["no"]}))
    assert query.sql("s3://query-run/r1", "SELECT count(*) AS n FROM documents", scfg)["n"].to_list() == [3]
    other_file = storage.table_path(other, "documents").uri + "/part-00000.parquet"
    with pytest.raises(query.QueryError):
        query.sql("s3://query-run/r1", f"SELECT * FROM read_parquet('{other_file}')", scfg)
