"""Request cache: generations stored as Parquet under ``<output root>/_cache/generations/``.

Key = sha256(model id, prompt, sampling parameters) (see :func:`atlas.engine.core.request_hash`).
Successful generations and *permanent* failures (a property of the request, e.g. a prompt
longer than the context) are stored; transient failures (an engine crash) are not, so such a
row is retried on the next run.
Every engine batch appends one new file (written in one step, by the engine actor that
generated it), so concurrent writers never collide, a crashed run leaves no partial file
behind and loses at most the batches that were in flight.

At scale the lookup is not a driver loop: :meth:`GenerationCache.dataset` reads the cache as
a Ray Dataset and :func:`atlas.engine.runner.stream_generate` joins it with the requests
inside Ray Data. :meth:`lookup` is for small, in-memory request lists.
"""

from __future__ import annotations

import io
import secrets
import time

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from atlas.storage import Location, write_bytes_atomic

CACHE_SCHEMA = pa.schema(
    [
        pa.field("request_hash", pa.string(), nullable=False),
        pa.field("model", pa.string(), nullable=False),
        pa.field("text", pa.string()),
        pa.field("output_tokens", pa.int32()),
        pa.field("finish_reason", pa.string()),
        pa.field("error", pa.string(), metadata={"doc": "permanent error of the request, else null"}),
        pa.field("created_at", pa.string(), nullable=False),
    ]
)


class GenerationCache:
    def __init__(self, root: Location):
        self.loc = root.join("_cache", "generations")

    def has_entries(self) -> bool:
        """True if any cache file exists (one listing call; no file is opened)."""
        return bool(self._files())

    def dataset(self, prefix: str = "_c_"):
        """The cache as a Ray Dataset (request_hash plus the result columns renamed ``prefix*``),
        for a join with a request Dataset."""
        import ray.data

        cols = ["request_hash", "model", "text", "output_tokens", "finish_reason", "error"]
        ds = ray.data.read_parquet(self.loc.path, filesystem=self.loc.fs, file_extensions=["parquet"]).select_columns(cols)
        return ds.rename_columns({c: prefix + c for c in cols if c != "request_hash"})

    def rows(self) -> int:
        """Number of cached entries (reads only the Parquet footers)."""
        files = self._files()
        if not files:
            return 0
        return sum(pq.ParquetFile(self.loc.fs.open_input_file(f)).metadata.num_rows for f in files)

    def _files(self) -> list[str]:
        sel = pafs.FileSelector(self.loc.path, allow_not_found=True)
        return sorted(i.path for i in self.loc.fs.get_file_info(sel) if i.type == pafs.FileType.File and i.path.endswith(".parquet"))

    def lookup(self, hashes: list[str]) -> dict[str, dict]:
        """Cached generations for ``hashes`` (a dict hash -> row)."""
        files = self._files()
        if not files or not hashes:
            return {}
        ds = pads.dataset(files, schema=CACHE_SCHEMA, filesystem=self.loc.fs, format="parquet")
        wanted = pa.array(sorted(set(hashes)), pa.string())
        tbl = ds.to_table(filter=pc.field("request_hash").isin(wanted))
        out: dict[str, dict] = {}
        for row in tbl.to_pylist():
            out[row["request_hash"]] = row  # later files win; identical keys hold identical requests
        return out

    def put(self, rows: list[dict]) -> int:
        if not rows:
            return 0
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        tbl = pa.Table.from_pylist([{**{k: r.get(k) for k in CACHE_SCHEMA.names}, "created_at": now} for r in rows], schema=CACHE_SCHEMA)
        buf = io.BytesIO()
        pq.write_table(tbl, buf)
        name = f"gen-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(4)}.parquet"
        write_bytes_atomic(self.loc.join(name), buf.getvalue())
        return tbl.num_rows
