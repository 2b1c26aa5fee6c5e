"""`atlas query RUN "SQL" --format table|csv|json|parquet [--out FILE]`.

Extends the ``query`` subcommand of atlas/cli.py with output formats; the SQL itself runs
through :func:`atlas.query.sql` (read-only: polars scans, nothing is written to the run).
"""

from __future__ import annotations

import argparse
import sys

FORMATS = ("table", "csv", "json", "parquet")


def extend(q: argparse.ArgumentParser) -> None:
    q.add_argument("--format", choices=FORMATS, default=None, help="output format (default: table; --csv means csv)")
    q.add_argument("--out", help="write the result to this file instead of stdout (needed for parquet on a terminal)")
    q.set_defaults(func=run)


def write(df, fmt: str, out: str | None, limit: int) -> None:
    import polars as pl

    if fmt == "table":
        with pl.Config(tbl_rows=limit, fmt_str_lengths=80):
            text = str(df.head(limit))
        _emit(text + "\n", out)
    elif fmt == "csv":
        _emit(df.write_csv(), out)
    elif fmt == "json":
        _emit(df.write_json() + "\n", out)
    else:
        if out:
            df.write_parquet(out)
        elif sys.stdout.isatty():
            raise SystemExit("atlas query: --format parquet to a terminal; give --out FILE or redirect stdout")
        else:
            df.write_parquet(sys.stdout.buffer)


def _emit(text: str, out: str | None) -> None:
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


def run(args: argparse.Namespace) -> int:
    from atlas import query
    from atlas.config import StorageConfig

    fmt = args.format or ("csv" if getattr(args, "csv", False) else "table")
    try:
        df = query.sql(args.output, args.sql, StorageConfig(s3_endpoint=args.s3_endpoint, s3_allow_http=args.s3_allow_http))
    except query.QueryError as e:
        print(f"atlas query: refused: {e}", file=sys.stderr)
        return 2
    write(df, fmt, args.out, args.limit)
    return 0
