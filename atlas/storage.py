"""Storage by URI (``file://``, plain paths, ``s3://``) and atomic publication of tables.

Layout of a run's output root::

    <root>/_manifest.json              run manifest (config, versions, per-stage status)
    <root>/<table>/_CURRENT            JSON pointer to the committed version
    <root>/<table>/v-<id>/part-*.parquet

A table is written into a fresh version directory, and only then is ``_CURRENT`` replaced in a
single operation (rename on a local disk, one PUT on S3), so a reader that resolves a table
through :func:`table_path` never sees a half-written stage. Object stores have no atomic
directory rename, which is why the pointer (and not the directory name) is the commit.

Garbage collection on publish deletes only versions that were *committed* before (the
pointer lists them under ``committed``) and are older than the ones kept. A version directory
that was never committed is never deleted by a publish: it may belong to another run that is
still writing (two runs may share an output root; nothing on S3 tells a live writer from a
dead one without a lease), so abandoned versions are left for an explicit
:func:`remove_abandoned` with an age the operator chooses.
"""

from __future__ import annotations

import calendar
import ipaddress
import json
import os
import secrets
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from atlas.config import StorageConfig

POINTER = "_CURRENT"
MANIFEST = "_manifest.json"


class StorageError(RuntimeError):
    pass


@dataclass(frozen=True)
class Location:
    """A resolved URI: a pyarrow filesystem plus a path inside it (no scheme)."""

    fs: pafs.FileSystem
    path: str
    uri: str

    def join(self, *parts: str) -> "Location":
        path = "/".join([self.path.rstrip("/"), *[p.strip("/") for p in parts]])
        uri = "/".join([self.uri.rstrip("/"), *[p.strip("/") for p in parts]])
        return Location(self.fs, path, uri)

    @property
    def is_s3(self) -> bool:
        return self.uri.startswith("s3://")


def _is_loopback(host: str | None) -> bool:
    """Plain http to this machine never leaves it, so a local S3-compatible server needs no opt-in."""
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def _s3_options(cfg: StorageConfig | None) -> dict[str, Any]:
    cfg = cfg or StorageConfig()
    endpoint = cfg.s3_endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = cfg.s3_region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    opts: dict[str, Any] = {}
    if endpoint:
        parsed = urllib.parse.urlparse(endpoint)
        if parsed.scheme == "http" and not cfg.s3_allow_http and not _is_loopback(parsed.hostname):
            raise StorageError(
                f"plain-http S3 endpoint {endpoint} refused: requests would travel unencrypted; "
                "use https, or set storage.s3_allow_http=true"
            )
        opts["endpoint_override"] = parsed.netloc or parsed.path
        opts["scheme"] = parsed.scheme or "https"
    if region:
        opts["region"] = region
    return opts


def s3_storage_options(cfg: StorageConfig | None) -> dict[str, str]:
    """Options in the form polars / object_store expect (endpoint URL + region)."""
    o = _s3_options(cfg)
    out: dict[str, str] = {}
    if "endpoint_override" in o:
        out["aws_endpoint_url"] = f"{o['scheme']}://{o['endpoint_override']}"
        out["aws_allow_http"] = "true" if o["scheme"] == "http" else "false"
    if "region" in o:
        out["aws_region"] = o["region"]
    return out


def resolve(uri: str, cfg: StorageConfig | None = None) -> Location:
    """Map a URI (or local path) to a filesystem and path. Credentials follow the AWS chain.

    URIs are split by hand, not with ``urllib.parse``: object keys and file names may hold
    ``#``, ``?``, tabs or newlines, which a URL parser would cut off or drop (and then read
    another file under this one's name)."""
    if not uri:
        raise StorageError("empty URI")
    scheme, sep, rest = uri.partition("://")
    if not sep or "/" in scheme:
        scheme, rest = "", uri
    scheme = scheme.lower()
    if scheme == "s3":
        bucket = rest.split("/", 1)[0]
        if not bucket:
            raise StorageError(f"s3 URI without a bucket: {uri!r}")
        fs = pafs.S3FileSystem(**_s3_options(cfg))
        path = f"{bucket}/{rest[len(bucket):].lstrip('/')}".rstrip("/")
        return Location(fs, path, f"s3://{path}")
    if scheme in ("", "file"):
        local = os.path.abspath(os.path.expanduser(rest))
        return Location(pafs.LocalFileSystem(), local, f"file://{local}")
    raise StorageError(f"unsupported URI scheme {scheme!r} in {uri!r} (use file:// or s3://)")


def exists(loc: Location) -> bool:
    return loc.fs.get_file_info(loc.path).type != pafs.FileType.NotFound


def read_bytes(loc: Location) -> bytes:
    with loc.fs.open_input_stream(loc.path) as f:
        return f.read()


def write_bytes_atomic(loc: Location, data: bytes) -> None:
    """Replace one object in a single step: a PUT on S3, write-then-rename on a local disk."""
    if loc.is_s3:
        with loc.fs.open_output_stream(loc.path) as f:
            f.write(data)
        return
    os.makedirs(os.path.dirname(loc.path), exist_ok=True)
    tmp = f"{loc.path}.tmp-{secrets.token_hex(4)}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, loc.path)


def read_json(loc: Location) -> Any:
    return json.loads(read_bytes(loc).decode("utf-8"))


def write_json_atomic(loc: Location, obj: Any) -> None:
    write_bytes_atomic(loc, json.dumps(obj, indent=2, sort_keys=True, default=str).encode("utf-8"))


# ---------------------------------------------------------------- tables


def new_version(root: Location, table: str) -> Location:
    """A fresh, unpublished version directory for ``table``."""
    vid = f"v-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"
    loc = root.join(table, vid)
    loc.fs.create_dir(loc.path, recursive=True)
    return loc


def publish(root: Location, table: str, version: Location, rows: int, keep_previous: int = 1) -> dict[str, Any]:
    """Commit ``version`` as the current content of ``table``; delete older *committed* versions.

    Kept: the new version and the ``keep_previous`` most recently committed ones (a reader that
    resolved the pointer just before still finds its files). Versions never committed are not
    touched (see the module docstring). Two runs publishing the same table at once: the last
    pointer write wins and the other run's version drops out of ``committed``; it is then
    leaked (left for :func:`remove_abandoned`), never deleted while in use.
    """
    name = version.path.rsplit("/", 1)[-1]
    old = read_pointer(root, table)
    committed: list[str] = []
    if old:
        committed = [v for v in old.get("committed", []) if v != old["version"]] + [old["version"]]
    committed = [v for v in committed if v != name]
    keep = committed[-keep_previous:] if keep_previous > 0 else []
    garbage = [v for v in committed if v not in keep]
    pointer = {
        "table": table,
        "version": name,
        "rows": int(rows),
        "committed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "committed": [*keep, name],  # oldest first; only these may be garbage-collected later
    }
    write_json_atomic(root.join(table, POINTER), pointer)
    for v in garbage:
        loc = root.join(table, v)
        if exists(loc):
            root.fs.delete_dir(loc.path)
    return pointer


def read_pointer(root: Location, table: str) -> dict[str, Any] | None:
    ptr = root.join(table, POINTER)
    if not exists(ptr):
        return None
    return read_json(ptr)


def _version_time(name: str) -> float | None:
    """Creation time encoded in a version name (``v-YYYYmmddTHHMMSS-xxxxxx``), or None."""
    try:
        return calendar.timegm(time.strptime(name.split("-")[1], "%Y%m%dT%H%M%S"))
    except (IndexError, ValueError):
        return None


def remove_abandoned(root: Location, table: str, older_than_s: float) -> list[str]:
    """Delete version directories of ``table`` that are not committed and were created more
    than ``older_than_s`` seconds ago (crashed writers). Choose an age longer than any run
    could still be writing that table. Returns the removed version names."""
    ptr = read_pointer(root, table) or {}
    live = {ptr.get("version"), *ptr.get("committed", [])}
    now = time.time()
    removed = []
    selector = pafs.FileSelector(root.join(table).path, allow_not_found=True)
    for info in root.fs.get_file_info(selector):
        name = info.base_name
        created = _version_time(name)
        if info.type != pafs.FileType.Directory or not name.startswith("v-") or name in live:
            continue
        if created is not None and now - created > older_than_s:
            root.fs.delete_dir(info.path)
            removed.append(name)
    return sorted(removed)


def current_version(root: Location, table: str) -> str | None:
    ptr = read_pointer(root, table)
    return None if ptr is None else ptr["version"]


def table_path(root: Location, table: str) -> Location:
    """The committed version directory of ``table``; raises if it was never published."""
    version = current_version(root, table)
    if version is None:
        raise StorageError(f"table {table!r} has not been published under {root.uri}")
    return root.join(table, version)


def table_exists(root: Location, table: str) -> bool:
    return current_version(root, table) is not None


def write_table(root: Location, table: str, data: pa.Table) -> dict[str, Any]:
    """Write a (small) Arrow table as one Parquet file and publish it."""
    version = new_version(root, table)
    pq.write_table(data, version.join("part-00000.parquet").path, filesystem=version.fs)
    return publish(root, table, version, data.num_rows)


def read_table(root: Location, table: str, columns: list[str] | None = None) -> pa.Table:
    loc = table_path(root, table)
    # Partitioned tables (annotations: source=<s>/part-*.parquet) keep the partition column
    # inside their files; hive parsing of the directory names would add it a second time.
    return pq.read_table(loc.path, filesystem=loc.fs, columns=columns, partitioning=None)


def _require_shared(root: Location, table: str) -> None:
    """Ray Data writes each block on the node that holds it: a local path on a multi-node
    cluster would scatter the table over several disks. (The runner refuses such a run up
    front, see atlas.cluster.check_shared_storage; this is the last line.)"""
    if root.is_s3:
        return
    import ray

    if ray.is_initialized():
        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        if nodes > 1:
            raise StorageError(
                f"cannot write table {table!r} to the local path {root.uri} from a {nodes}-node Ray cluster; use an s3:// output"
            )


def write_dataset(root: Location, table: str, ds: Any, schema: pa.Schema | None = None) -> dict[str, Any]:
    """Write a Ray Dataset with Ray Data's Parquet writer, then publish it.

    An empty dataset still produces an (empty) Parquet file with ``schema`` so that readers
    get the documented columns.
    """
    _require_shared(root, table)
    version = new_version(root, table)
    ds = ds.materialize()
    rows = ds.count()
    if rows == 0:
        if schema is None:
            raise StorageError(f"cannot write empty table {table!r} without a schema")
        pq.write_table(schema.empty_table(), version.join("part-00000.parquet").path, filesystem=version.fs)
    else:
        ds.write_parquet(version.path, filesystem=version.fs)
    return publish(root, table, version, rows)


SORT_PARTITION_BYTES = 128 * 2**20  # in-memory input bytes per range partition (one output file each)


def sort_dataset(ds: Any, key: str, input_bytes: int) -> Any:
    """``ds`` globally sorted by ``key`` in one range partition (so one Parquet file) per
    ~128 MiB of input. Ray Data's sort takes its partition count from the input's estimated
    blocks and falls back to 200 when it has no estimate (after a ``map_batches``): that split
    a 60-row chunks table into 20 files and cost ~10 s of a 13 s chunk stage."""
    n = max(1, -(-int(input_bytes) // SORT_PARTITION_BYTES))
    return ds.repartition(n).sort(key)


def read_dataset(root: Location, table: str) -> Any:
    import ray.data

    loc = table_path(root, table)
    return ray.data.read_parquet(loc.path, filesystem=loc.fs)
