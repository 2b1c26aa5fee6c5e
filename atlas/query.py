"""Read-only access to a run's tables as polars LazyFrames, and SQL over them."""

from __future__ import annotations

import polars as pl

from atlas import schemas, storage
from atlas.config import StorageConfig


def _storage_options(root: storage.Location, cfg: StorageConfig | None) -> dict[str, str] | None:
    if not root.is_s3:
        return None
    return storage.s3_storage_options(cfg) or None


def scan(output_uri: str, table: str, cfg: StorageConfig | None = None) -> pl.LazyFrame:
    """The committed version of ``table`` in the run at ``output_uri``."""
    root = storage.resolve(output_uri, cfg)
    loc = storage.table_path(root, table)
    uri = loc.uri if root.is_s3 else loc.path
    return pl.scan_parquet(f"{uri}/*.parquet", storage_options=_storage_options(root, cfg))


def tables(output_uri: str, cfg: StorageConfig | None = None) -> list[str]:
    root = storage.resolve(output_uri, cfg)
    return [t for t in schemas.TABLES if storage.table_exists(root, t)]


def sql(output_uri: str, query: str, cfg: StorageConfig | None = None) -> pl.DataFrame:
    """Run SQL over every published table of a run (table names as in ``atlas schemas``)."""
    ctx = pl.SQLContext({t: scan(output_uri, t, cfg) for t in tables(output_uri, cfg)})
    return ctx.execute(query).collect()
