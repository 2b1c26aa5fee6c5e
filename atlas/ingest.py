"""Ingest: a folder or prefix of .txt / .jsonl / .parquet files -> ``documents`` + ``quarantine``.

Each file is one Ray Data row (a unit of work); a worker reads it and emits one row per
record, either a document or a quarantine entry carrying the reason. Bad records never stop
the run, and every valid record survives: ids derive from the file's path relative to the
input root plus the record key, so the same corpus gets the same ids wherever it is stored.

Hostile input: whatever exception one record raises (deeply nested or huge-number JSON, lone
surrogates that Arrow cannot store, a bug in a reader) quarantines that record; whatever a
file raises (unreadable, truncated Parquet page) quarantines the rest of that file, keeping
the records read before it. JSONL is read as a stream of lines with a bounded buffer, so a
huge file or a line without an end never sits whole in memory. Files under the input that are
not ingested (hidden, unsupported suffix) are counted in the stats, never dropped silently.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from atlas import schemas, storage
from atlas.config import IngestConfig, StorageConfig

SUFFIXES = {".txt": "txt", ".text": "txt", ".md": "txt", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
SNIPPET_BYTES = 80
READ_BLOCK = 1 << 20  # JSONL stream read size
ROWS_PER_BATCH = 2048  # rows a worker emits per output batch (bounds worker memory for huge files)


class IngestError(RuntimeError):
    pass


def doc_id_for(relative_path: str, record: str) -> str:
    return hashlib.sha256(f"{relative_path}#{record}".encode("utf-8")).hexdigest()[:20]


def scan_inputs(input_uri: str, storage_cfg: StorageConfig, formats: list[str]) -> tuple[list[dict[str, str]], dict[str, int]]:
    """Every ingestible file under ``input_uri`` (a folder, prefix or single file), sorted, and
    the counts of files left out by reason (``hidden``, ``unsupported_format``,
    ``undecodable_name``)."""
    loc = storage.resolve(input_uri, storage_cfg)
    info = loc.fs.get_file_info(loc.path)
    if info.type == pafs.FileType.NotFound:
        raise IngestError(f"input not found: {input_uri}")
    if info.type == pafs.FileType.File:
        base, files = loc.path.rsplit("/", 1)[0], [info]
    else:
        base = loc.path.rstrip("/")
        files = [f for f in loc.fs.get_file_info(pafs.FileSelector(loc.path, recursive=True)) if f.type == pafs.FileType.File]
    out = []
    skipped: dict[str, int] = {}
    for f in files:
        try:
            rel = f.path[len(base) + 1 :]
        except UnicodeDecodeError:  # a file name that is not UTF-8 cannot be named in a table
            skipped["undecodable_name"] = skipped.get("undecodable_name", 0) + 1
            continue
        if any(part.startswith((".", "_")) for part in rel.split("/")):
            skipped["hidden"] = skipped.get("hidden", 0) + 1  # dotfiles, _SUCCESS markers, our _CURRENT pointers
            continue
        kind = SUFFIXES.get("." + f.base_name.rsplit(".", 1)[-1].lower()) if "." in f.base_name else None
        if kind is None or kind not in formats:
            skipped["unsupported_format"] = skipped.get("unsupported_format", 0) + 1
            continue
        scheme = "s3://" if loc.is_s3 else "file://"
        out.append({"uri": scheme + f.path, "relative": rel, "kind": kind, "size": str(f.size)})
    if not out:
        raise IngestError(f"no .txt / .jsonl / .parquet files under {input_uri}")
    return sorted(out, key=lambda r: r["relative"]), skipped


def list_inputs(input_uri: str, storage_cfg: StorageConfig, formats: list[str]) -> list[dict[str, str]]:
    """The ingestible files of :func:`scan_inputs`."""
    return scan_inputs(input_uri, storage_cfg, formats)[0]


def _safe(text: str) -> str:
    """``text`` made storable as UTF-8 (lone surrogates escaped), for quarantine fields."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _snippet(raw: bytes | str) -> str:
    if isinstance(raw, str):
        raw = raw[: SNIPPET_BYTES * 4].encode("utf-8", "backslashreplace")
    return raw[:SNIPPET_BYTES].decode("utf-8", "backslashreplace")


def _quarantine(source: str, record: str, reason: str, detail: str, raw: bytes | str = b"") -> dict[str, Any]:
    return {
        "kind": "quarantine",
        "stage": "ingest",
        "source": _safe(source),
        "record": record,
        "reason": reason,
        "detail": _safe(detail)[:1000],
        "snippet": _snippet(raw),
    }


def _error_detail(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:500]


def _looks_binary(raw: bytes) -> bool:
    return b"\x00" in raw[:4096]


def _check_text(text: Any, source: str, record: str, cfg: IngestConfig, raw: bytes | str) -> dict[str, Any] | None:
    """None if ``text`` is an acceptable document body, else a quarantine row."""
    if not isinstance(text, str):
        return _quarantine(source, record, "wrong_schema", f"field {cfg.text_field!r} is {type(text).__name__}, not a string", raw)
    if len(text.encode("utf-8", "surrogatepass")) > cfg.max_bytes:
        return _quarantine(source, record, "oversized", f"document exceeds ingest.max_bytes={cfg.max_bytes}", raw)
    if len(text.strip()) < cfg.min_chars:
        return _quarantine(source, record, "empty", f"fewer than {cfg.min_chars} non-blank characters", raw)
    if "\x00" in text:
        return _quarantine(source, record, "undecodable", "text contains NUL bytes (binary content)", raw)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # lone surrogates (e.g. "\ud800" in JSON): Arrow cannot store them
        return _quarantine(source, record, "undecodable", f"text is not valid Unicode (lone surrogate at character {e.start})", raw)
    return None


def _document(rel: str, source: str, record: str, text: str, source_id: Any = None, title: Any = None) -> dict[str, Any]:
    if title is None:
        first = text.lstrip().split("\n", 1)[0].strip().lstrip("#").strip()
        title = first[:200] or None
    return {
        "kind": "document",
        "doc_id": doc_id_for(rel, record),
        "source": source,
        "record": record,
        "source_id": None if source_id is None else _safe(str(source_id)),
        "title": None if title is None else _safe(str(title))[:1000],
        "text": text,
        "n_chars": len(text),
    }


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8")  # strict: undecodable bytes are the caller's quarantine reason


def _records_txt(fs: pafs.FileSystem, path: str, item: dict[str, str], cfg: IngestConfig) -> Iterator[dict[str, Any]]:
    source, rel = item["uri"], item["relative"]
    if int(item["size"]) > cfg.max_bytes:
        with fs.open_input_stream(path) as f:
            head = f.read(SNIPPET_BYTES)
        yield _quarantine(source, "file", "oversized", f"file is {item['size']} bytes > ingest.max_bytes={cfg.max_bytes}", head)
        return
    with fs.open_input_stream(path) as f:
        raw = f.read(cfg.max_bytes + 1)  # bounded: the file may have grown since it was listed
    if len(raw) > cfg.max_bytes:
        yield _quarantine(source, "file", "oversized", f"file is > ingest.max_bytes={cfg.max_bytes} bytes", raw)
        return
    if _looks_binary(raw):
        yield _quarantine(source, "file", "undecodable", "binary content (NUL bytes)", raw)
        return
    try:
        text = _decode(raw)
    except UnicodeDecodeError as e:
        yield _quarantine(source, "file", "undecodable", f"not valid UTF-8 at byte {e.start}", raw)
        return
    bad = _check_text(text, source, "file", cfg, raw)
    yield bad or _document(rel, source, "file", text)


def _from_mapping(rel: str, source: str, record: str, obj: Any, cfg: IngestConfig, raw: bytes | str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        return _quarantine(source, record, "wrong_schema", f"record is a JSON {type(obj).__name__}, not an object", raw)
    if cfg.text_field not in obj:
        return _quarantine(source, record, "wrong_schema", f"missing field {cfg.text_field!r}", raw)
    text = obj[cfg.text_field]
    bad = _check_text(text, source, record, cfg, raw)
    if bad:
        return bad
    sid = obj.get(cfg.id_field) if cfg.id_field else None
    return _document(rel, source, record, text, source_id=sid, title=obj.get("title"))


def _lines(f: Any, max_bytes: int) -> Iterator[tuple[int, bytes | None, int]]:
    """(line number, line bytes or None if longer than ``max_bytes``, line length) from a
    stream, reading ``READ_BLOCK`` at a time; an overlong line is skipped without being kept."""
    lineno, buf, overlong = 0, b"", 0
    while True:
        block = f.read(READ_BLOCK)
        if not block:
            break
        parts = (buf + block).split(b"\n") if not overlong else block.split(b"\n")
        if overlong:
            if len(parts) == 1:
                overlong += len(block)
                continue
            lineno += 1
            yield lineno, None, overlong + len(parts[0])
            overlong, parts = 0, parts[1:]
        buf = parts.pop()
        for line in parts:
            lineno += 1
            yield (lineno, line, len(line)) if len(line) <= max_bytes else (lineno, None, len(line))
        if len(buf) > max_bytes:
            overlong, buf = len(buf), b""
    if overlong:
        yield lineno + 1, None, overlong
    elif buf:
        yield lineno + 1, buf, len(buf)


def _parse_json_line(rel: str, source: str, record: str, raw: bytes, cfg: IngestConfig) -> dict[str, Any]:
    try:
        line = _decode(raw)
    except UnicodeDecodeError as e:
        return _quarantine(source, record, "undecodable", f"not valid UTF-8 at byte {e.start}", raw)
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return _quarantine(source, record, "malformed", f"invalid JSON: {e.msg} at column {e.colno}", raw)
    except (RecursionError, ValueError) as e:  # nesting too deep, integers beyond Python's digit limit
        return _quarantine(source, record, "malformed", f"JSON not representable: {_error_detail(e)}", raw)
    return _from_mapping(rel, source, record, obj, cfg, raw)


def _records_jsonl(fs: pafs.FileSystem, path: str, item: dict[str, str], cfg: IngestConfig) -> Iterator[dict[str, Any]]:
    source, rel = item["uri"], item["relative"]
    with fs.open_input_stream(path) as f:
        for lineno, raw, size in _lines(f, cfg.max_bytes):
            record = f"line:{lineno}"
            if raw is None:
                yield _quarantine(source, record, "oversized", f"record is {size} bytes > ingest.max_bytes={cfg.max_bytes}")
                continue
            if not raw.strip():
                continue  # blank separator lines are not records
            yield _guarded(source, record, raw, lambda: _parse_json_line(rel, source, record, raw, cfg))


def _records_parquet(fs: pafs.FileSystem, path: str, item: dict[str, str], cfg: IngestConfig) -> Iterator[dict[str, Any]]:
    source, rel = item["uri"], item["relative"]
    try:
        pf = pq.ParquetFile(fs.open_input_file(path))
    except Exception as e:  # a corrupt or non-Parquet file: one quarantine row for the file
        yield _quarantine(source, "file", "malformed", f"unreadable Parquet: {e}")
        return
    if cfg.text_field not in pf.schema_arrow.names:
        yield _quarantine(source, "file", "wrong_schema", f"missing column {cfg.text_field!r} (has {pf.schema_arrow.names})")
        return
    start = 0
    # Row group by row group: a corrupt one quarantines its rows and reading goes on.
    for rg in range(pf.metadata.num_row_groups):
        n = pf.metadata.row_group(rg).num_rows
        row = start
        try:
            for batch in pf.iter_batches(batch_size=1024, row_groups=[rg]):
                for obj in batch.to_pylist():
                    record = f"row:{row}"
                    row += 1
                    text = obj.get(cfg.text_field)
                    raw = text if isinstance(text, str) else repr(text)[:SNIPPET_BYTES]
                    yield _guarded(source, record, raw, lambda: _from_mapping(rel, source, record, obj, cfg, raw))
        except Exception as e:  # noqa: BLE001 - corrupt pages, undecodable values
            rows = f"rows:{row}-{start + n - 1}" if row < start + n else f"rows:{row}-"
            yield _quarantine(source, rows, "malformed", f"row group {rg} unreadable from row {row}: {_error_detail(e)}")
        start += n


def _guarded(source: str, record: str, raw: bytes | str, make: Any) -> dict[str, Any]:
    """``make()`` (one record's row); any exception it raises quarantines just that record."""
    try:
        return make()
    except Exception as e:  # noqa: BLE001 - one record must never fail the run
        return _quarantine(source, record, "reader_error", _error_detail(e), raw)


_READERS = {"txt": _records_txt, "jsonl": _records_jsonl, "parquet": _records_parquet}


def iter_file(item: dict[str, str], cfg: IngestConfig, storage_cfg: StorageConfig) -> Iterator[dict[str, Any]]:
    """All records of one input file, as document or quarantine rows; never raises on content.

    An exception from the file itself (vanished, unreadable, corrupt half-way) ends the file with
    one quarantine row (record ``file``) naming how many records were read before it."""
    done = 0
    try:
        loc = storage.resolve(item["uri"], storage_cfg)
        for row in _READERS[item["kind"]](loc.fs, loc.path, item, cfg):
            done += 1
            yield row
    except Exception as e:  # noqa: BLE001 - one file must never fail the run
        reason = "unreadable" if isinstance(e, OSError) else "reader_error"
        where = f" after {done} record(s)" if done else ""
        yield _quarantine(item["uri"], "file", reason, f"reading stopped{where}: {_error_detail(e)}")


def read_file(item: dict[str, str], cfg: IngestConfig, storage_cfg: StorageConfig) -> list[dict[str, Any]]:
    """:func:`iter_file` as a list (small files, tests)."""
    return list(iter_file(item, cfg, storage_cfg))


_ROW_FIELDS = ["kind", *dict.fromkeys(schemas.DOCUMENTS.names + schemas.QUARANTINE.names)]


def parse_files(batch: dict[str, Any], cfg: IngestConfig, storage_cfg: StorageConfig) -> Iterator[dict[str, Any]]:
    """Ray Data UDF: a batch of file items -> batches of at most ``ROWS_PER_BATCH`` rows (one
    column per field of either table; ``kind`` routes rows to documents or quarantine)."""
    rows: list[dict[str, Any]] = []
    for i in range(len(batch["uri"])):
        item = {k: str(batch[k][i]) for k in ("uri", "relative", "kind", "size")}
        for row in iter_file(item, cfg, storage_cfg):
            rows.append(row)
            if len(rows) >= ROWS_PER_BATCH:
                yield {n: [r.get(n) for r in rows] for n in _ROW_FIELDS}
                rows = []
    if rows:
        yield {n: [r.get(n) for r in rows] for n in _ROW_FIELDS}


def ingest(input_uri: str, root: storage.Location, cfg: IngestConfig, storage_cfg: StorageConfig) -> dict[str, Any]:
    """Run ingest as a Ray Data job and publish ``documents`` and ``quarantine``."""
    import ray.data

    files, skipped = scan_inputs(input_uri, storage_cfg, cfg.formats)

    def parse(batch: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield from parse_files(batch, cfg, storage_cfg)

    parsed = ray.data.from_items(files, override_num_blocks=min(len(files), 64)).map_batches(
        parse, batch_size=8, batch_format="numpy", num_cpus=0.5
    ).materialize()

    from ray.data.expressions import col

    docs = parsed.filter(expr=col("kind") == "document")
    docs = docs.map_batches(lambda b: schemas.conform(b, schemas.DOCUMENTS), batch_format="pyarrow")
    docs = storage.sort_dataset(docs, "doc_id", parsed.size_bytes())
    if cfg.max_documents:
        docs = docs.limit(cfg.max_documents)
    bad = parsed.filter(expr=col("kind") == "quarantine").map_batches(
        lambda b: schemas.conform(b, schemas.QUARANTINE), batch_format="pyarrow"
    )
    doc_ptr = storage.write_dataset(root, "documents", docs, schemas.DOCUMENTS)
    q_rows = bad.take_all()
    q_table = pa.Table.from_pylist([{k: r[k] for k in schemas.QUARANTINE.names} for r in q_rows], schema=schemas.QUARANTINE)
    storage.write_table(root, "quarantine", q_table)
    reasons: dict[str, int] = {}
    for r in q_rows:
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    return {
        "files": len(files),
        "documents": doc_ptr["rows"],
        "quarantined": len(q_rows),
        "quarantine_reasons": reasons,
        "quarantined_files": len({r["source"] for r in q_rows if r["record"] == "file"}),
        "skipped_files": sum(skipped.values()),
        "skipped_file_reasons": skipped,
    }


# ---------------------------------------------------------------- stage


from atlas.stage import BaseStage, register  # noqa: E402 - the stage wrapper needs the functions above


@register
class IngestStage(BaseStage):
    """corpus (``cfg.input``) -> ``documents`` + ``quarantine``."""

    name = "ingest"
    inputs = ()
    outputs = ("documents", "quarantine")
    config_keys = ("input", "ingest")

    def source_fingerprint(self, cfg) -> str | None:
        # The corpus is not a run table: its listing (paths + sizes) stands in for a version.
        files = list_inputs(cfg.input, cfg.storage, cfg.ingest.formats)
        return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()

    def run(self, ctx) -> dict:
        return ingest(ctx.cfg.input, ctx.root, ctx.cfg.ingest, ctx.cfg.storage)
