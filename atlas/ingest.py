"""Ingest: a folder or prefix of .txt / .jsonl / .parquet files -> ``documents`` + ``quarantine``.

Each file is one Ray Data row (a unit of work); a worker reads it and emits one row per
record, either a document or a quarantine entry carrying the reason. Bad records never stop
the run, and every valid record survives: ids derive from the file's path relative to the
input root plus the record key, so the same corpus gets the same ids wherever it is stored.
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


class IngestError(RuntimeError):
    pass


def doc_id_for(relative_path: str, record: str) -> str:
    return hashlib.sha256(f"{relative_path}#{record}".encode("utf-8")).hexdigest()[:20]


def list_inputs(input_uri: str, storage_cfg: StorageConfig, formats: list[str]) -> list[dict[str, str]]:
    """Every ingestible file under ``input_uri`` (a folder, prefix or single file), sorted."""
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
    for f in files:
        rel = f.path[len(base) + 1 :]
        if any(part.startswith((".", "_")) for part in rel.split("/")):
            continue  # hidden files, _SUCCESS markers, our own _CURRENT pointers
        kind = SUFFIXES.get("." + f.base_name.rsplit(".", 1)[-1].lower()) if "." in f.base_name else None
        if kind is None or kind not in formats:
            continue
        scheme = "s3://" if loc.is_s3 else "file://"
        out.append({"uri": scheme + f.path, "relative": rel, "kind": kind, "size": str(f.size)})
    if not out:
        raise IngestError(f"no .txt / .jsonl / .parquet files under {input_uri}")
    return sorted(out, key=lambda r: r["relative"])


def _snippet(raw: bytes | str) -> str:
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "replace")
    return raw[:SNIPPET_BYTES].decode("utf-8", "backslashreplace")


def _quarantine(source: str, record: str, reason: str, detail: str, raw: bytes | str = b"") -> dict[str, Any]:
    return {"kind": "quarantine", "stage": "ingest", "source": source, "record": record, "reason": reason, "detail": detail, "snippet": _snippet(raw)}


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
        "source_id": None if source_id is None else str(source_id),
        "title": None if title is None else str(title),
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
        raw = f.read()
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


def _records_jsonl(fs: pafs.FileSystem, path: str, item: dict[str, str], cfg: IngestConfig) -> Iterator[dict[str, Any]]:
    source, rel = item["uri"], item["relative"]
    with fs.open_input_stream(path) as f:
        data = f.read()
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        record = f"line:{lineno}"
        if not raw.strip():
            continue  # blank separator lines are not records
        if len(raw) > cfg.max_bytes:
            yield _quarantine(source, record, "oversized", f"record is {len(raw)} bytes > ingest.max_bytes={cfg.max_bytes}", raw)
            continue
        try:
            line = _decode(raw)
        except UnicodeDecodeError as e:
            yield _quarantine(source, record, "undecodable", f"not valid UTF-8 at byte {e.start}", raw)
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            yield _quarantine(source, record, "malformed", f"invalid JSON: {e.msg} at column {e.colno}", raw)
            continue
        yield _from_mapping(rel, source, record, obj, cfg, raw)


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
    row = 0
    for batch in pf.iter_batches(batch_size=1024):
        for obj in batch.to_pylist():
            record = f"row:{row}"
            row += 1
            text = obj.get(cfg.text_field)
            raw = text if isinstance(text, str) else repr(text)
            yield _from_mapping(rel, source, record, obj, cfg, raw)


_READERS = {"txt": _records_txt, "jsonl": _records_jsonl, "parquet": _records_parquet}


def read_file(item: dict[str, str], cfg: IngestConfig, storage_cfg: StorageConfig) -> list[dict[str, Any]]:
    """All records of one input file, as document or quarantine rows (never raises on content)."""
    loc = storage.resolve(item["uri"], storage_cfg)
    try:
        return list(_READERS[item["kind"]](loc.fs, loc.path, item, cfg))
    except OSError as e:  # the file vanished or could not be read: quarantine, keep going
        return [_quarantine(item["uri"], "file", "unreadable", f"{type(e).__name__}: {e}")]


def ingest(input_uri: str, root: storage.Location, cfg: IngestConfig, storage_cfg: StorageConfig) -> dict[str, Any]:
    """Run ingest as a Ray Data job and publish ``documents`` and ``quarantine``."""
    import ray.data

    files = list_inputs(input_uri, storage_cfg, cfg.formats)

    def parse(batch: dict[str, Any]) -> dict[str, Any]:
        rows: list[dict[str, Any]] = []
        for i in range(len(batch["uri"])):
            item = {k: str(batch[k][i]) for k in ("uri", "relative", "kind", "size")}
            rows.extend(read_file(item, cfg, storage_cfg))
        # One column per field of either table; the ``kind`` column routes rows below.
        names = ["kind", *dict.fromkeys(schemas.DOCUMENTS.names + schemas.QUARANTINE.names)]
        return {n: [r.get(n) for r in rows] for n in names}

    parsed = ray.data.from_items(files, override_num_blocks=min(len(files), 64)).map_batches(
        parse, batch_size=8, batch_format="numpy", num_cpus=0.5
    ).materialize()

    docs = parsed.filter(lambda r: r["kind"] == "document")
    docs = docs.map_batches(lambda b: schemas.conform(b, schemas.DOCUMENTS), batch_format="pyarrow")
    docs = docs.sort("doc_id")
    if cfg.max_documents:
        docs = docs.limit(cfg.max_documents)
    bad = parsed.filter(lambda r: r["kind"] == "quarantine").map_batches(
        lambda b: schemas.conform(b, schemas.QUARANTINE), batch_format="pyarrow"
    )
    doc_ptr = storage.write_dataset(root, "documents", docs, schemas.DOCUMENTS)
    q_rows = bad.take_all()
    q_table = pa.Table.from_pylist([{k: r[k] for k in schemas.QUARANTINE.names} for r in q_rows], schema=schemas.QUARANTINE)
    storage.write_table(root, "quarantine", q_table)
    reasons: dict[str, int] = {}
    for r in q_rows:
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    return {"files": len(files), "documents": doc_ptr["rows"], "quarantined": len(q_rows), "quarantine_reasons": reasons}


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
