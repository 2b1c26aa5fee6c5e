import json

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
    # current + one previous kept; the abandoned empty version was cleaned up
    assert len(versions) == 2 and first in versions and v.path.rsplit("/", 1)[-1] not in versions


def test_s3_roundtrip_read_by_independent_clients(s3_server, s3_client):
    s3_client.create_bucket(Bucket="store-test")
    root = storage.resolve("s3://store-test/run1", StorageConfig(s3_endpoint=s3_server))
    storage.write_table(root, "numbers", _table(7))
    # boto3 (not our code) sees the pointer and the data object
    keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket="store-test")["Contents"]]
    assert "run1/numbers/_CURRENT" in keys
    ptr = json.loads(s3_client.get_object(Bucket="store-test", Key="run1/numbers/_CURRENT")["Body"].read())
    assert ptr["rows"] == 7
    # polars over its own object_store client reads the committed version
    version_uri = storage.table_path(root, "numbers").uri
    df = pl.read_parquet(version_uri + "/*.parquet", storage_options={**storage.s3_storage_options(StorageConfig(s3_endpoint=s3_server)), "aws_access_key_id": "atlas-test-key", "aws_secret_access_key": "atlas-test-secret"})
    assert df["x"].sum() == 21


def test_bad_uris():
    with pytest.raises(storage.StorageError, match="unsupported URI scheme 'gs'"):
        storage.resolve("gs://bucket/x")
    with pytest.raises(storage.StorageError, match="without a bucket"):
        storage.resolve("s3:///x")


def test_redact_uri():
    assert redact_uri("s3://user:secret@bucket/p?X-Amz-Signature=abc") == "s3://bucket/p"
    assert redact_uri("http://127.0.0.1:9000") == "http://127.0.0.1:9000"
