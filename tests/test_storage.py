import json
import os
import threading

import polars as pl
import pyarrow as pa
import pytest

from atlas import storage
from atlas.config import StorageConfig
from atlas.manifest import redact_uri


def _table(n):
    return pa.table({"x": list(range(n))})


def test_local_publish_is_atomic_and_versioned(tmp_path):
    root = storage.resolve(str(tmp_path))
    assert root.uri == f"file://{tmp_path}"
    with pytest.raises(storage.StorageError, match="not been published"):
        storage.table_path(root, "t")
    # An unpublished version is invisible to readers.
    v = storage.new_version(root, "t")
    assert not storage.table_exists(root, "t")
    storage.write_table(root, "t", _table(3))
    first = storage.current_version(root, "t")
    storage.write_table(root, "t", _table(5))
    assert storage.read_table(root, "t").num_rows == 5
    ptr = json.loads((tmp_path / "t" / "_CURRENT").read_text())
    assert ptr["rows"] == 5
    versions = sorted(p.name for p in (tmp_path / "t").iterdir() if p.name.startswith("v-"))
    # current + one previous kept; the never-committed version is not garbage to a publish
    # (it could be another run's work in progress) ...
    abandoned = v.path.rsplit("/", 1)[-1]
    assert len(versions) == 3 and first in versions and abandoned in versions
    storage.write_table(root, "t", _table(6))
    assert first not in {p.name for p in (tmp_path / "t").iterdir()}  # older committed: collected
    # ... only an explicit sweep with an age removes it.
    assert storage.remove_abandoned(root, "t", older_than_s=3600) == []
    assert storage.remove_abandoned(root, "t", older_than_s=-1) == [abandoned]
    assert storage.read_table(root, "t").num_rows == 6


def test_s3_roundtrip_read_by_independent_clients(s3_server, s3_client):
    s3_client.create_bucket(Bucket="store-test")
    root = storage.resolve("s3://store-test/run1", StorageConfig(s3_endpoint=s3_server, s3_allow_http=True))
    storage.write_table(root, "numbers", _table(7))
    # boto3 (not our code) sees the pointer and the data object
    keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket="store-test")["Contents"]]
    assert "run1/numbers/_CURRENT" in keys
    ptr = json.loads(s3_client.get_object(Bucket="store-test", Key="run1/numbers/_CURRENT")["Body"].read())
    assert ptr["rows"] == 7
    # polars over its own object_store client reads the committed version
    version_uri = storage.table_path(root, "numbers").uri
    df = pl.read_parquet(version_uri + "/*.parquet", storage_options={**storage.s3_storage_options(StorageConfig(s3_endpoint=s3_server, s3_allow_http=True)), "aws_access_key_id": "atlas-test-key", "aws_secret_access_key": "atlas-test-secret"})
    assert df["x"].sum() == 21


def test_uris_with_url_syntax_characters_name_the_right_file(tmp_path):
    """'#', '?', tabs and newlines are legal in file names and S3 keys; a URL parser would
    drop or cut them and open another file under this one's name."""
    for name in ("a#b.txt", "q?x=1.txt", "new\nline.txt", "tab\t.txt"):
        (tmp_path / name).write_text(name)
        loc = storage.resolve(f"file://{tmp_path}/{name}")
        assert loc.path == f"{tmp_path}/{name}" and storage.read_bytes(loc) == name.encode()
    s3 = storage.resolve("s3://bucket/dir/a#b?c", StorageConfig(s3_endpoint="https://s3.example"))
    assert s3.path == "bucket/dir/a#b?c" and s3.uri == "s3://bucket/dir/a#b?c"
    assert storage.resolve("relative/dir").path == os.path.abspath("relative/dir")


def test_bad_uris():
    with pytest.raises(storage.StorageError, match="unsupported URI scheme 'gs'"):
        storage.resolve("gs://bucket/x")
    with pytest.raises(storage.StorageError, match="without a bucket"):
        storage.resolve("s3:///x")


def test_redact_uri():
    assert redact_uri("s3://user:secret@bucket/p?X-Amz-Signature=abc") == "s3://bucket/p"
    assert redact_uri("http://127.0.0.1:9000") == "http://127.0.0.1:9000"


def test_plain_http_endpoint_refused_by_default(s3_server):
    assert StorageConfig().s3_allow_http is False
    # off this machine: refused (resolve only builds the filesystem; nothing is contacted)
    with pytest.raises(storage.StorageError, match="plain-http S3 endpoint .* refused.*s3_allow_http=true"):
        storage.resolve("s3://b/run", StorageConfig(s3_endpoint="http://192.0.2.7:9000"))
    with pytest.raises(storage.StorageError, match="refused"):
        storage.s3_storage_options(StorageConfig(s3_endpoint="http://s3.example:80"))
    assert storage.s3_storage_options(StorageConfig(s3_endpoint="http://192.0.2.7:9", s3_allow_http=True))
    # loopback never leaves the machine: the local test server needs no opt-in
    assert storage.s3_storage_options(StorageConfig(s3_endpoint=s3_server))["aws_endpoint_url"] == s3_server
    assert storage.s3_storage_options(StorageConfig(s3_endpoint="http://localhost:9"))
    # https endpoints need no opt-in
    assert storage.s3_storage_options(StorageConfig(s3_endpoint="https://s3.example"))["aws_endpoint_url"] == "https://s3.example"


def _versions(root, table):
    sel = storage.pafs.FileSelector(root.join(table).path, allow_not_found=True)
    return {i.base_name for i in root.fs.get_file_info(sel) if i.base_name.startswith("v-")}


@pytest.mark.parametrize("where", ["local", "s3"])
def test_concurrent_writers_never_lose_a_version_in_progress(where, tmp_path, request):
    """Run A writes a version slowly while run B publishes the same table three times.

    B's garbage collection must not touch A's unpublished version; A then commits it intact,
    and the versions that were committed and superseded are collected.
    """
    if where == "s3":
        s3_server, s3_client = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_client")
        s3_client.create_bucket(Bucket="concurrent")
        root = storage.resolve("s3://concurrent/run", StorageConfig(s3_endpoint=s3_server, s3_allow_http=True))
    else:
        root = storage.resolve(str(tmp_path))
    a_started, b_done = threading.Event(), threading.Event()
    a_result: dict = {}
    b_versions: list[str] = []

    def writer_a():
        version = storage.new_version(root, "t")
        storage.pq.write_table(pa.table({"x": [1, 2]}), version.join("part-00000.parquet").path, filesystem=root.fs)
        a_started.set()
        assert b_done.wait(60)
        storage.pq.write_table(pa.table({"x": [3]}), version.join("part-00001.parquet").path, filesystem=root.fs)
        a_result["ptr"] = storage.publish(root, "t", version, rows=3)

    def writer_b():
        assert a_started.wait(60)
        for n in (10, 20, 30):
            b_versions.append(storage.write_table(root, "t", _table(n))["version"])
        b_done.set()

    threads = [threading.Thread(target=writer_a), threading.Thread(target=writer_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert "ptr" in a_result, "writer A failed"
    assert storage.current_version(root, "t") == a_result["ptr"]["version"]
    assert sorted(storage.read_table(root, "t").column("x").to_pylist()) == [1, 2, 3]
    left = _versions(root, "t")
    # A (current) and B's last commit (previous) remain; B's first two were collected
    assert left == {a_result["ptr"]["version"], b_versions[-1]}, (left, b_versions)
    assert a_result["ptr"]["committed"] == [b_versions[-1], a_result["ptr"]["version"]]


def test_sorted_dataset_is_one_file_per_partition_and_globally_ordered(ray_cluster, tmp_path):
    """A small table sorts into one file (Ray Data's default would split it into up to 200);
    a large input (here: declared large) into one range partition per 128 MiB, read back in
    global key order across the files."""
    import random

    import ray.data

    keys = [f"doc-{i:05d}" for i in range(600)]
    random.Random(0).shuffle(keys)
    root = storage.resolve(str(tmp_path))
    for table, input_bytes, files in (("small", 10_000, 1), ("large", 3 * storage.SORT_PARTITION_BYTES, 3)):
        ds = ray.data.from_items([{"k": k, "v": len(k)} for k in keys], override_num_blocks=6).map_batches(lambda b: b, batch_format="pyarrow")
        ptr = storage.write_dataset(root, table, storage.sort_dataset(ds, "k", input_bytes))
        version = storage.table_path(root, table)
        written = sorted(f for f in os.listdir(version.path) if f.endswith(".parquet"))
        assert ptr["rows"] == 600 and len(written) == files, written
        assert storage.read_table(root, table).column("k").to_pylist() == sorted(keys)
