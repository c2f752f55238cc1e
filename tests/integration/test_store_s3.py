"""steps/lib/store/ over s3:// against a real S3 protocol peer: moto's server on 127.0.0.1 (the
`s3_endpoint` fixture in tests/conftest.py), spoken to over HTTP through boto3's `endpoint_url` (no
in-process mocks). The behaviour is the same `StoreContract` (tests/store_contract.py) that
tests/unit/test_store.py runs over file://; S3-only checks follow it.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import boto3
import pytest

from steps.lib.store import ArtifactError, S3Backend, Store, open_store
from tests.conftest import S3_BUCKET as BUCKET

pytest.register_assert_rewrite("tests.store_contract")  # before the import: failed contract asserts show values
from tests.store_contract import StoreContract, write_artifact  # noqa: E402


def s3_store(endpoint: str, cache: Path, prefix: str | None = None) -> Store:
    """A store under a fresh prefix of the shared bucket, so every test starts empty."""
    return open_store(f"s3://{BUCKET}/{prefix or uuid.uuid4().hex}", cache_dir=cache, endpoint_url=endpoint)


class TestS3Store(StoreContract):
    @pytest.fixture
    def store(self, s3_endpoint: str, tmp_path: Path) -> Store:
        return s3_store(s3_endpoint, tmp_path / "cache")

    def test_objects_live_under_the_prefix_in_the_bucket(self, store: Store, s3_endpoint: str):
        write_artifact(store, "draft", "0000000000000001", {"model.safetensors": b"w" * 64})
        store.set_alias("production", "draft", "0000000000000001")
        prefix = store.backend.prefix
        keys = sorted(o["Key"] for o in boto3.client("s3", endpoint_url=s3_endpoint)
                      .list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/")["Contents"])
        assert keys == [f"{prefix}/aliases/production.json",
                        f"{prefix}/artifacts/draft/0000000000000001/manifest.json",
                        f"{prefix}/artifacts/draft/0000000000000001/model.safetensors"]

    def test_two_prefixes_in_one_bucket_do_not_see_each_other(self, s3_endpoint: str, tmp_path: Path):
        tag = uuid.uuid4().hex[:8]
        a = s3_store(s3_endpoint, tmp_path / "ca", f"{tag}/run")
        b = s3_store(s3_endpoint, tmp_path / "cb", f"{tag}/run-2")  # shares a string prefix with a
        write_artifact(a, "draft", "aaaaaaaaaaaaaaaa", {"m": b"a"})
        write_artifact(b, "draft", "bbbbbbbbbbbbbbbb", {"m": b"b"})
        assert a.list("draft") == ["aaaaaaaaaaaaaaaa"]
        assert b.list("draft") == ["bbbbbbbbbbbbbbbb"]
        assert not a.exists("draft", "bbbbbbbbbbbbbbbb")

    def test_fetch_downloads_into_the_cache_and_a_stale_copy_is_replaced(self, store: Store):
        data = bytes(range(256)) * 40
        write_artifact(store, "hidden", "cac0000000000001", {"shards/shard-00000.safetensors": data})
        d = store.fetch("hidden", "cac0000000000001")
        assert d == store.cache_dir / "hidden" / "cac0000000000001"
        local = d / "shards/shard-00000.safetensors"
        assert local.read_bytes() == data
        # a same-size stale copy (another store, an interrupted write) is fetched again, not trusted
        local.write_bytes(b"\0" * len(data))
        assert store.fetch_file("hidden", "cac0000000000001", "shards/shard-00000.safetensors").read_bytes() == data

    def test_early_upload_can_drop_the_local_copy(self, store: Store):
        w = store.begin("hidden", "d000000000000001", step="extract")
        local = w.path("shards/shard-00000.safetensors")
        assert store.cache_dir in local.parents  # staged locally, not in the bucket
        local.write_bytes(b"s" * 4096)
        w.upload("shards/shard-00000.safetensors", delete_local=True)
        assert not local.exists()
        assert store.backend.size(f"{w.key}/shards/shard-00000.safetensors") == 4096
        m = w.commit()
        assert m.files[0]["size"] == 4096

    def test_a_missing_bucket_is_an_error_not_an_empty_store(self, s3_endpoint: str, tmp_path: Path):
        store = open_store("s3://no-such-bucket/x", cache_dir=tmp_path, endpoint_url=s3_endpoint)
        assert isinstance(store.backend, S3Backend)
        with pytest.raises(ArtifactError, match="s3://no-such-bucket: no such bucket at http://127.0.0.1"):
            store.exists("draft", "0000000000000001")
        with pytest.raises(Exception, match="NoSuchBucket"):
            store.manifest("draft", "0000000000000001")

    def test_manifest_of_a_missing_artifact_names_the_s3_uri(self, store: Store):
        with pytest.raises(ArtifactError, match=rf"no artifact draft/ffffffffffffffff in {store.uri}"):
            store.manifest("draft", "ffffffffffffffff")
