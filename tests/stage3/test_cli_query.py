"""`atlas query RUN SQL --format ...` over a run's published tables (no Ray needed)."""

from __future__ import annotations

import json
import os

import polars as pl

from atlas import cli, schemas, storage
from tests.stage3.fixtures import planted


def _files(path: str) -> dict[str, int]:
    return {os.path.join(d, f): os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs}


def test_query_formats_and_read_only(tmp_path, capsys):
    chunks, _, _ = planted(20)
    root = storage.resolve(str(tmp_path / "run"))
    storage.write_table(root, "chunks", schemas.conform(chunks, schemas.CHUNKS))
    sql = "SELECT doc_id, count(*) AS n FROM chunks GROUP BY doc_id ORDER BY doc_id"
    before = _files(root.path)

    assert cli.main(["query", root.uri, sql, "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sum(r["n"] for r in rows) == 20 and rows[0]["doc_id"] == "d000"

    assert cli.main(["query", root.uri, sql, "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "doc_id,n"

    out = tmp_path / "r.parquet"
    assert cli.main(["query", root.uri, sql, "--format", "parquet", "--out", str(out)]) == 0
    assert pl.read_parquet(out)["n"].sum() == 20

    assert cli.main(["query", root.uri, "SELECT count(*) AS n FROM chunks"]) == 0
    assert "20" in capsys.readouterr().out

    # DDL in the query only touches the in-memory SQL context, never the run's files.
    for stmt in ("DROP TABLE chunks", "CREATE TABLE chunks2 AS SELECT * FROM chunks"):
        try:
            cli.main(["query", root.uri, stmt, "--format", "csv"])
        except Exception:
            pass
    assert _files(root.path) == before
