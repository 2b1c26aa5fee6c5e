"""Request cache: generations stored as Parquet under ``<output root>/_cache/generations/``.

Key = sha256(model id, prompt, sampling parameters) (see :func:`atlas.engine.core.request_hash`).
Successful generations and *permanent* failures (a property of the request, e.g. a prompt
longer than the context) are stored; transient failures (an engine crash) are not, so such a
row is retried on the next run.
Each run appends one new file (written in one step), so concurrent writers never collide and
a crashed run leaves no partial file behind.
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
