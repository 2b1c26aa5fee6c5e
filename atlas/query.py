"""Read-only access to a run's tables as polars LazyFrames, and SQL over them.

``atlas query`` must read only the run's own tables. polars SQL also has table functions
(``read_parquet('/any/path')``, ``read_csv(...)``) that read arbitrary files, and statements
(``DROP TABLE``) that change the context. :func:`sql` therefore

1. accepts one ``SELECT`` / ``WITH`` statement and refuses any ``read_*`` / ``scan_*`` call
   (checked on the tokens, so string literals and comments cannot hide or fake one), and
2. before collecting, checks the query plan: every file scan must lie inside a committed
   version directory of this run (a second line of defence against table functions polars
   may add later).

The frames are ``scan_parquet`` over committed versions, so nothing here can write or delete.
"""

from __future__ import annotations

import re

import polars as pl

from atlas import schemas, storage
from atlas.config import StorageConfig


class QueryError(ValueError):
    """A query refused before it ran; the message says why."""


def _storage_options(root: storage.Location, cfg: StorageConfig | None) -> dict[str, str] | None:
    if not root.is_s3:
        return None
    return storage.s3_storage_options(cfg) or None


def _version_uri(root: storage.Location, table: str) -> str:
    loc = storage.table_path(root, table)
    return loc.uri if root.is_s3 else loc.path


def scan(output_uri: str, table: str, cfg: StorageConfig | None = None) -> pl.LazyFrame:
    """The committed version of ``table`` in the run at ``output_uri``."""
    if table not in schemas.TABLES:  # also keeps names like "../other-run/documents" out
        raise QueryError(f"unknown table {table!r}; the run's tables: {sorted(schemas.TABLES)}")
    root = storage.resolve(output_uri, cfg)
    # `**` also reaches partitioned tables (annotations: source=<s>/part-*.parquet); every
    # partition column is stored inside the files, so hive parsing stays off.
    return pl.scan_parquet(
        f"{_version_uri(root, table)}/**/*.parquet", hive_partitioning=False, storage_options=_storage_options(root, cfg)
    )


def tables(output_uri: str, cfg: StorageConfig | None = None) -> list[str]:
    root = storage.resolve(output_uri, cfg)
    return [t for t in schemas.TABLES if storage.table_exists(root, t)]


# ----------------------------------------------------------------- SQL checks

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<comment>--[^\n]*|/\*.*?\*/)
  | (?P<string>'(?:[^']|'')*')
  | (?P<qident>"(?:[^"]|"")*"|`[^`]*`)
  | (?P<word>[A-Za-z_][A-Za-z0-9_$]*)
  | (?P<number>\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)
  | (?P<punct>.)
    """,
    re.S | re.X,
)
_STATEMENTS = {"select", "with"}
_FILE_FUNCTIONS = re.compile(r"^(read|scan)_", re.I)


def _tokens(query: str) -> list[tuple[str, str]]:
    out = []
    for m in _TOKEN.finditer(query):
        kind = m.lastgroup
        if kind in ("ws", "comment"):
            continue
        text = m.group()
        if kind == "qident":
            text = text[1:-1].replace('""', '"')
        out.append((kind, text))
    return out


def check_sql(query: str) -> None:
    """Raise :class:`QueryError` unless ``query`` is one read-only SELECT without file functions."""
    toks = _tokens(query)
    while toks and toks[-1] == ("punct", ";"):
        toks.pop()
    if not toks:
        raise QueryError("empty query")
    if ("punct", ";") in toks:
        raise QueryError("one statement per query")
    first = next((t for k, t in toks if k != "punct" or t != "("), "")
    if first.lower() not in _STATEMENTS:
        raise QueryError(f"only SELECT / WITH queries are allowed (got {first.upper()!r}); the run's tables are read-only")
    for (kind, text), nxt in zip(toks, toks[1:]):
        if kind in ("word", "qident") and nxt == ("punct", "(") and _FILE_FUNCTIONS.match(text):
            raise QueryError(f"{text}(...) reads files outside the run; query the run's tables by name instead")


_SCAN = re.compile(r"\b\w+ SCAN \[([^\]]*)\]")


def _check_plan(lf: pl.LazyFrame, allowed: list[str]) -> None:
    """Every scan in the plan must read a committed version directory of this run."""
    plan = lf.explain(optimized=False)
    for m in _SCAN.finditer(plan):
        for src in (s.strip() for s in m.group(1).split(",")):
            if not src or re.fullmatch(r"\.\.\. ?\d+ other sources?", src):
                continue
            if not any(src.startswith(prefix.rstrip("/") + "/") for prefix in allowed):
                raise QueryError(f"query reads {src!r}, which is not one of this run's tables")


def sql(output_uri: str, query: str, cfg: StorageConfig | None = None) -> pl.DataFrame:
    """Run one SELECT over the run's published tables (table names as in ``atlas schemas``)."""
    check_sql(query)
    root = storage.resolve(output_uri, cfg)
    names = tables(output_uri, cfg)
    frames = {t: scan(output_uri, t, cfg) for t in names}
    # A fresh context per query: nothing registered here outlives it.
    lf = pl.SQLContext(frames).execute(query, eager=False)
    _check_plan(lf, [_version_uri(root, t) for t in names])
    return lf.collect()
