"""steps/store.py over file://: manifests last, verified reads, content-addressed ids, resumable
uploads, aliases, the bounded local cache and store-URI parsing.

`StoreContract` holds the behaviour every backend must have; `TestFileStore` runs it over a
local folder and tests/integration/test_store_s3.py runs the same class over a real S3 protocol
server (moto's). The contract only talks to the store's public API and its backend's
`get_bytes`/`put_bytes` (to inspect or corrupt stored objects), so it is backend-agnostic.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from steps.config import load_config, section_hash
from steps.store import (
    MANIFEST,
    ArtifactError,
    FileBackend,
    LocalCache,
    Manifest,
    S3Backend,
    Store,
    artifact_id,
    open_store,
)

REPO = Path(__file__).resolve().parents[2]
SECRET_ID, SECRET_KEY = "AKIAEAGLENESTSECRETID", "eaglenest/SECRET+do-not-write-me"


class RecordingBackend:
    """Delegates to a real backend and records which keys were uploaded with put_file."""

    def __init__(self, inner: Any):
        self.inner, self.put_files = inner, []

    def put_file(self, key: str, local: Path) -> None:
        self.put_files.append(key)
        self.inner.put_file(key, local)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def write_artifact(store: Store, kind: str, art_id: str, files: dict[str, bytes], **kw: Any) -> Manifest:
    w = store.begin(kind, art_id, step=kw.pop("step", "test"), **kw)
    for rel, data in files.items():
        w.path(rel).write_bytes(data)
    return w.commit(metrics={"n": len(files)})


def raw_manifest(store: Store, kind: str, art_id: str) -> dict[str, Any]:
    raw = store.backend.get_bytes(f"{store.key(kind, art_id)}/{MANIFEST}")
    assert raw is not None
    return json.loads(raw)


class StoreContract:
    """Behaviour shared by every backend; subclasses provide a fresh, empty `store` fixture."""

    # --- manifest last ------------------------------------------------------------------------------

    def test_commit_writes_data_then_a_manifest_with_sizes_and_hashes(self, store: Store):
        files = {"a.bin": b"\x00\x01" * 100, "shards/shard-00000.safetensors": os.urandom(3000)}
        m = write_artifact(store, "hidden", "aaaa000000000001", files, inputs={"target": "t1"},
                           config={"lr": 1e-3})
        assert store.exists("hidden", "aaaa000000000001")
        on_store = raw_manifest(store, "hidden", "aaaa000000000001")
        assert on_store["files"] == m.files
        assert [f["path"] for f in m.files] == sorted(files)
        for f in m.files:
            assert f["size"] == len(files[f["path"]])
            assert f["sha256"] == hashlib.sha256(files[f["path"]]).hexdigest()
        assert on_store["inputs"] == {"target": "t1"}
        assert on_store["config_hash"] == section_hash({"lr": 1e-3})
        assert on_store["code_version"].startswith("0.1.0") and on_store["created"].endswith("Z")
        assert on_store["metrics"] == {"n": 2}
        # no upload records survive the commit, and none is listed as a file
        assert store.partial_files("hidden", "aaaa000000000001") == []
        assert not [k for k in store.backend.list(store.key("hidden", "aaaa000000000001")) if ".partial" in k]

    def test_writer_that_dies_before_commit_leaves_no_artifact(self, store: Store):
        w = store.begin("dataset", "dead000000000001", step="datagen")
        w.path("conversations/part-00000.jsonl").write_text('{"id": 1}\n')
        w.upload("conversations/part-00000.jsonl")
        w.path("conversations/part-00001.jsonl").write_text('{"id": 2}\n')
        del w  # abandoned: no commit
        assert not store.exists("dataset", "dead000000000001")
        assert "dead000000000001" not in store.list("dataset")
        with pytest.raises(ArtifactError) as e:
            store.manifest("dataset", "dead000000000001")
        assert "dataset/dead000000000001" in str(e.value) and "no manifest" in str(e.value)
        with pytest.raises(ArtifactError):
            store.fetch("dataset", "dead000000000001")

    def test_a_killed_writer_process_leaves_no_artifact_and_its_uploads_resume(self, store: Store, tmp_path: Path):
        endpoint = getattr(store.backend, "endpoint_url", None)
        script = textwrap.dedent(f"""
            import os, sys
            sys.path.insert(0, {str(REPO)!r})
            from steps.store import open_store
            store = open_store({store.uri!r}, cache_dir={str(store.cache_dir)!r}, endpoint_url={endpoint!r})
            w = store.begin("hidden", "kill000000000001", step="extract")
            w.path("shards/shard-00000.safetensors").write_bytes(b"x" * 5000)
            w.upload("shards/shard-00000.safetensors", delete_local=True)
            w.path("shards/shard-00001.safetensors").write_bytes(b"half")
            os._exit(9)
        """)
        proc = subprocess.run([sys.executable, "-c", script], env=os.environ.copy(), capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 9, proc.stderr
        assert not store.exists("hidden", "kill000000000001")
        assert [r["path"] for r in store.partial_files("hidden", "kill000000000001")] == \
            ["shards/shard-00000.safetensors"]
        w = store.begin("hidden", "kill000000000001", step="extract")
        assert w.has("shards/shard-00000.safetensors") and not w.has("shards/shard-00001.safetensors")
        w.path("shards/shard-00001.safetensors").write_bytes(b"y" * 5000)
        m = w.commit()
        assert [f["path"] for f in m.files] == ["shards/shard-00000.safetensors", "shards/shard-00001.safetensors"]
        d = store.fetch("hidden", "kill000000000001")
        assert (d / "shards/shard-00000.safetensors").read_bytes() == b"x" * 5000

    # --- verified reads -----------------------------------------------------------------------------

    def test_a_corrupted_byte_is_caught_on_read_naming_the_file(self, store: Store):
        data = os.urandom(4096)
        write_artifact(store, "draft", "c0de000000000001", {"model.safetensors": data, "ok.json": b"{}"})
        key = f"{store.key('draft', 'c0de000000000001')}/model.safetensors"
        flipped = bytearray(store.backend.get_bytes(key))
        flipped[1234] ^= 0xFF
        store.backend.put_bytes(key, bytes(flipped))
        with pytest.raises(ArtifactError) as e:
            store.fetch("draft", "c0de000000000001")
        assert "draft/c0de000000000001/model.safetensors" in str(e.value) and "sha256" in str(e.value)
        assert store.fetch_file("draft", "c0de000000000001", "ok.json").read_bytes() == b"{}"

    def test_a_truncated_or_deleted_file_is_caught_on_read(self, store: Store):
        write_artifact(store, "draft", "c0de000000000002", {"a.bin": b"abcdef", "b.bin": b"ghijkl"})
        base = store.key("draft", "c0de000000000002")
        store.backend.put_bytes(f"{base}/a.bin", b"abc")
        store.backend.delete(f"{base}/b.bin")
        with pytest.raises(ArtifactError, match=r"a\.bin: size 3 != manifest 6"):
            store.fetch_file("draft", "c0de000000000002", "a.bin")
        with pytest.raises(ArtifactError, match=r"b\.bin: listed in the manifest but missing"):
            store.fetch_file("draft", "c0de000000000002", "b.bin")
        with pytest.raises(ArtifactError, match=r"a\.bin: size 3 != 6"):
            store.verify("draft", "c0de000000000002")

    def test_a_file_not_in_the_manifest_is_an_error(self, store: Store):
        write_artifact(store, "vocab", "0000000000000001", {"vocab.safetensors": b"v"})
        with pytest.raises(ArtifactError, match="has no file 'other.bin'"):
            store.fetch_file("vocab", "0000000000000001", "other.bin")

    def test_a_corrupt_manifest_is_a_clear_error(self, store: Store):
        write_artifact(store, "vocab", "0000000000000002", {"vocab.safetensors": b"v"})
        store.backend.put_bytes(f"{store.key('vocab', '0000000000000002')}/{MANIFEST}", b"{not json")
        with pytest.raises(ArtifactError, match=r"vocab/0000000000000002/manifest\.json: manifest is not valid JSON"):
            store.manifest("vocab", "0000000000000002")

    def test_fetch_gives_a_local_directory_with_the_artifact(self, store: Store):
        files = {"config.json": b'{"a": 1}', "sub/dir/w.bin": os.urandom(2048)}
        write_artifact(store, "export", "e000000000000001", files)
        d = store.fetch("export", "e000000000000001")
        for rel, data in files.items():
            assert (d / rel).read_bytes() == data
        assert store.fetch("export", "e000000000000001") == d  # second fetch: same place, still verified

    # --- content-addressed ids ----------------------------------------------------------------------

    def test_same_config_and_inputs_find_the_finished_artifact_again(self, store: Store):
        cfg = load_config(REPO / "configs" / "tiny.yaml")
        inputs = {"target": "t" * 16, "dataset": "d" * 16}
        art = artifact_id("hidden", cfg.extract, inputs)
        write_artifact(store, "hidden", art, {"x": b"1"}, inputs=inputs, config=cfg.extract)
        reloaded = load_config(REPO / "configs" / "tiny.yaml")
        again = artifact_id("hidden", reloaded.extract, dict(reversed(inputs.items())))
        assert again == art and store.exists("hidden", again)
        changed = artifact_id("hidden", load_config(REPO / "configs" / "tiny.yaml",
                                                    ["extract.shard_tokens=8192"]).extract, inputs)
        assert changed != art and not store.exists("hidden", changed)
        assert raw_manifest(store, "hidden", art)["config_hash"] == section_hash(cfg.extract)

    # --- early uploads and resume -------------------------------------------------------------------

    def test_early_uploads_are_seen_by_a_resumed_writer_and_not_uploaded_again(self, store: Store):
        w = store.begin("hidden", "re00000000000001", step="extract")
        w.path("shards/shard-00000.safetensors").write_bytes(b"a" * 1000)
        rec = w.upload("shards/shard-00000.safetensors", delete_local=True, extra={"tokens": 7})
        assert rec["size"] == 1000 and rec["tokens"] == 7
        # crash; a new writer for the same id
        store.backend = RecordingBackend(store.backend)
        w2 = store.begin("hidden", "re00000000000001", step="extract")
        assert w2.has("shards/shard-00000.safetensors")
        assert w2.uploaded("shards/shard-00000.safetensors")["tokens"] == 7
        w2.path("shards/shard-00001.safetensors").write_bytes(b"b" * 1000)
        m = w2.commit()
        base = store.key("hidden", "re00000000000001")
        assert store.backend.put_files == [f"{base}/shards/shard-00001.safetensors"]
        assert [f["path"] for f in m.files] == ["shards/shard-00000.safetensors", "shards/shard-00001.safetensors"]
        assert set(m.files[0]) == {"path", "size", "sha256"}  # extra fields stay in the upload record
        assert store.fetch_file("hidden", "re00000000000001", "shards/shard-00000.safetensors").read_bytes() == \
            b"a" * 1000

    def test_an_upload_record_whose_object_is_gone_is_not_trusted(self, store: Store):
        w = store.begin("hidden", "re00000000000002", step="extract")
        w.path("s.bin").write_bytes(b"a" * 10)
        w.upload("s.bin", delete_local=True)
        store.backend.delete(f"{store.key('hidden', 're00000000000002')}/s.bin")
        assert store.partial_files("hidden", "re00000000000002") == []
        assert not store.begin("hidden", "re00000000000002", step="extract").has("s.bin")

    # --- listing ------------------------------------------------------------------------------------

    def test_list_gives_only_finished_artifacts_of_one_kind(self, store: Store):
        write_artifact(store, "draft", "b000000000000002", {"m": b"2"})
        write_artifact(store, "draft", "a000000000000001", {"m": b"1"})
        write_artifact(store, "vocab", "c000000000000003", {"v": b"3"})
        w = store.begin("draft", "d000000000000004", step="train")
        w.path("sub/manifest.json").write_text("{}")  # a data file that happens to share the name
        w.upload("sub/manifest.json")
        assert store.list("draft") == ["a000000000000001", "b000000000000002"]
        assert store.list("vocab") == ["c000000000000003"]
        assert store.list("export") == []

    # --- aliases ------------------------------------------------------------------------------------

    def test_aliases_move_record_the_previous_and_delete_nothing(self, store: Store):
        write_artifact(store, "export", "1000000000000001", {"m": b"one"})
        write_artifact(store, "export", "2000000000000002", {"m": b"two"})
        assert store.get_alias("production") is None
        first = store.set_alias("production", "export", "1000000000000001")
        assert first["previous"] is None
        second = store.set_alias("production", "export", "2000000000000002")
        assert second["previous"] == {"kind": "export", "id": "1000000000000001"}
        got = store.get_alias("production")
        assert (got["kind"], got["id"], got["previous"]["id"]) == ("export", "2000000000000002", "1000000000000001")
        # rollback is just another move
        back = store.set_alias("production", "export", "1000000000000001")
        assert back["previous"]["id"] == "2000000000000002"
        for art in ("1000000000000001", "2000000000000002"):
            assert store.exists("export", art)
            store.verify("export", art)

    def test_alias_meta_is_kept_and_a_record_restores_exactly(self, store: Store):
        write_artifact(store, "export", "1000000000000001", {"m": b"one"})
        write_artifact(store, "export", "2000000000000002", {"m": b"two"})
        assert store.set_alias("production", "export", "1000000000000001", meta={"tau": 2.0})["meta"] == {"tau": 2.0}
        saved = store.get_alias("production")
        store.set_alias("production", "export", "2000000000000002", meta={"flow_run_id": "r"})
        store.restore_alias("production", saved)
        assert store.get_alias("production") == saved
        store.restore_alias("production", None)           # "did not exist" restores to absent
        assert store.get_alias("production") is None

    def test_alias_to_a_missing_artifact_is_refused(self, store: Store):
        write_artifact(store, "export", "1000000000000001", {"m": b"one"})
        store.set_alias("production", "export", "1000000000000001")
        with pytest.raises(ArtifactError, match="export/ffffffffffffffff does not exist"):
            store.set_alias("production", "export", "ffffffffffffffff")
        assert store.get_alias("production")["id"] == "1000000000000001"

    # --- credentials --------------------------------------------------------------------------------

    def test_credentials_never_appear_in_manifests_or_records(self, store: Store, monkeypatch: pytest.MonkeyPatch):
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", SECRET_ID)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        fresh = open_store(store.uri, cache_dir=store.cache_dir,
                           endpoint_url=getattr(store.backend, "endpoint_url", None))
        w = fresh.begin("hidden", "5ec0000000000001", step="extract", config={"backend": "local"})
        w.path("a.bin").write_bytes(b"a")
        w.upload("a.bin")
        sidecars = [fresh.backend.get_bytes(k) for k in fresh.backend.list(fresh.key("hidden", "5ec0000000000001"))
                    if ".partial" in k]
        assert sidecars
        w.commit(meta={"store": fresh.uri})
        fresh.set_alias("production", "hidden", "5ec0000000000001")
        texts = [fresh.backend.get_bytes(f"{fresh.key('hidden', '5ec0000000000001')}/{MANIFEST}"),
                 fresh.backend.get_bytes("aliases/production.json"), *sidecars]
        for text in texts:
            assert SECRET_ID.encode() not in text and SECRET_KEY.encode() not in text
            assert b"SECRET" not in text


class TestFileStore(StoreContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return open_store(f"file://{tmp_path}/store", cache_dir=tmp_path / "cache")

    def test_staging_is_the_final_folder_and_commit_leaves_no_sidecars(self, store: Store):
        w = store.begin("dataset", "f000000000000001", step="datagen")
        local = w.path("conversations/part-00000.jsonl")
        assert local.parent.parent == Path(store.uri.removeprefix("file://")) / "artifacts/dataset/f000000000000001"
        local.write_text("row\n")
        w.upload("conversations/part-00000.jsonl", delete_local=True)
        assert local.read_text() == "row\n"  # "deleting the local copy" must not delete the stored one
        m = w.commit()
        assert [f["path"] for f in m.files] == ["conversations/part-00000.jsonl"]
        art_dir = local.parent.parent
        assert sorted(p.relative_to(art_dir).as_posix() for p in art_dir.rglob("*")) == \
            ["conversations", "conversations/part-00000.jsonl", "manifest.json"]

    def test_committing_again_does_not_list_the_old_manifest_as_a_file(self, store: Store):
        write_artifact(store, "draft", "f000000000000002", {"m": b"1"})
        m = store.begin("draft", "f000000000000002", step="train").commit()
        assert [f["path"] for f in m.files] == ["m"]
        store.fetch("draft", "f000000000000002")

    def test_fetch_of_a_file_store_reads_in_place(self, store: Store):
        write_artifact(store, "draft", "f000000000000003", {"m": b"1"})
        d = store.fetch("draft", "f000000000000003")
        assert d == Path(store.uri.removeprefix("file://")) / "artifacts/draft/f000000000000003"
        assert not (store.cache_dir / "draft").exists()

    def test_temp_and_hidden_files_in_staging_are_not_artifact_files(self, store: Store):
        w = store.begin("draft", "f000000000000004", step="train")
        w.path("m").write_bytes(b"1")
        w.path(".m.tmp-123").write_bytes(b"junk")
        w.path(".cache/x").write_bytes(b"junk")
        assert [f["path"] for f in w.commit().files] == ["m"]


# --- ids, manifests ---------------------------------------------------------------------------------

def test_artifact_id_is_a_content_address():
    a = artifact_id("hidden", {"x": 1, "y": [1, 2]}, {"target": "t", "dataset": "d"})
    assert len(a) == 16 and int(a, 16) >= 0
    assert a == artifact_id("hidden", {"y": [1, 2], "x": 1}, {"dataset": "d", "target": "t"})
    assert a != artifact_id("draft", {"x": 1, "y": [1, 2]}, {"target": "t", "dataset": "d"})
    assert a != artifact_id("hidden", {"x": 2, "y": [1, 2]}, {"target": "t", "dataset": "d"})
    assert a != artifact_id("hidden", {"x": 1, "y": [1, 2]}, {"target": "t", "dataset": "other"})


def test_artifact_id_of_a_config_section_is_the_id_of_its_values():
    cfg = load_config(REPO / "configs" / "tiny.yaml")
    assert artifact_id("draft", cfg.train) == artifact_id("draft", cfg.train.model_dump(mode="json"))


def test_manifest_round_trips_and_ignores_unknown_keys():
    m = Manifest(kind="draft", id="0" * 16, step="train", inputs={"vocab": "v"}, metrics={"loss": 1.5},
                 files=[{"path": "m", "size": 1, "sha256": "ab"}])
    data = json.loads(m.to_json())
    data["added_by_a_newer_writer"] = True
    back = Manifest.from_json(json.dumps(data))
    assert back == m


def test_manifest_defaults_are_fresh_and_required_fields_are_required():
    a = Manifest.from_json('{"kind": "draft", "id": "x", "step": "train"}')
    b = Manifest.from_json('{"kind": "draft", "id": "y", "step": "train"}')
    a.files.append({"path": "m"})
    assert b.files == [] and a.config_hash == ""
    with pytest.raises(ArtifactError, match="no 'step' field"):
        Manifest.from_json('{"kind": "draft", "id": "x"}')
    with pytest.raises(ArtifactError, match="JSON object"):
        Manifest.from_json("[1, 2]")


# --- open_store -------------------------------------------------------------------------------------

def test_relative_file_uri_is_relative_to_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    store = open_store("file://out/store", cache_dir=tmp_path / "c")
    assert isinstance(store.backend, FileBackend)
    assert store.backend.root == (tmp_path / "out/store").resolve()
    assert store.uri == f"file://{(tmp_path / 'out/store').resolve()}"
    assert (tmp_path / "out/store").is_dir()


def test_absolute_and_localhost_file_uris(tmp_path: Path):
    assert open_store(f"file://{tmp_path}/abs", cache_dir=tmp_path / "c").backend.root == tmp_path / "abs"
    assert open_store(f"file://localhost{tmp_path}/lh", cache_dir=tmp_path / "c").backend.root == tmp_path / "lh"


def test_store_uri_defaults_to_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("EAGLENEST_STORE", f"file://{tmp_path}/from-env")
    monkeypatch.setenv("EAGLENEST_CACHE", str(tmp_path / "cache-env"))
    store = open_store()
    assert store.backend.root == tmp_path / "from-env"
    assert store.cache_dir == tmp_path / "cache-env"


def test_s3_uri_gives_bucket_prefix_and_endpoint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    store = open_store("s3://my-bucket/runs/a/", cache_dir=tmp_path, endpoint_url="http://127.0.0.1:9")
    assert isinstance(store.backend, S3Backend)
    assert (store.backend.bucket, store.backend.prefix) == ("my-bucket", "runs/a")
    assert store.backend.endpoint_url == "http://127.0.0.1:9"
    assert store.uri == "s3://my-bucket/runs/a"
    assert store.backend._k("artifacts/x/1/manifest.json") == "runs/a/artifacts/x/1/manifest.json"
    bare = open_store("s3://my-bucket", cache_dir=tmp_path)
    assert bare.backend.prefix == "" and bare.backend._k("aliases/p.json") == "aliases/p.json"
    assert store.artifact_uri("draft", "abc") == "s3://my-bucket/runs/a/artifacts/draft/abc"


@pytest.mark.parametrize("uri, fragment", [("http://host/x", "expected file://PATH or s3://BUCKET/PREFIX"),
                                           ("s3:///no-bucket", "needs a bucket"),
                                           ("file://", "needs a folder"),
                                           ("out/store", "expected file://PATH")])
def test_bad_store_uris_are_refused(uri: str, fragment: str, tmp_path: Path):
    with pytest.raises(ValueError, match=fragment):
        open_store(uri, cache_dir=tmp_path)


# --- LocalCache -------------------------------------------------------------------------------------

def make_file(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * size)
    return path


def test_cache_evicts_least_recently_used_copies_to_stay_within_budget(tmp_path: Path):
    cache = LocalCache(budget_bytes=100)
    a, b, c, d = (make_file(tmp_path / n, 40) for n in "abcd")
    cache.admit(a, 40, owned=True)
    cache.admit(b, 40, owned=True)
    cache.admit(a, 40, owned=True)  # a is used again: b is now the oldest
    cache.admit(c, 40, owned=True)
    assert not b.exists() and a.exists() and c.exists()
    assert list(cache.iter_paths()) == [a, c]
    cache.admit(d, 40, owned=True)
    assert not a.exists() and list(cache.iter_paths()) == [c, d]
    assert cache.used_bytes == 80 <= cache.budget
    assert cache.peak_bytes == 80


def test_cache_peak_is_the_largest_usage_ever_and_files_it_does_not_own_are_kept(tmp_path: Path):
    cache = LocalCache(budget_bytes=1000)
    for i in range(5):
        cache.admit(make_file(tmp_path / f"s{i}", 150), 150, owned=True)
    assert cache.peak_bytes == 750 == cache.used_bytes
    store_file = make_file(tmp_path / "in-store", 900)
    cache.admit(store_file, 900, owned=False)  # e.g. a file:// store's own copy
    assert store_file.exists() and store_file not in list(cache.iter_paths())
    assert cache.used_bytes <= 1000 and cache.peak_bytes == 750


def test_cache_over_many_admissions_never_exceeds_budget(tmp_path: Path):
    cache = LocalCache(budget_bytes=10_000)
    sizes = [1234, 4321, 999, 5000, 77, 3000, 2500, 4100, 10, 6000] * 3
    for i, size in enumerate(sizes):
        cache.admit(make_file(tmp_path / f"f{i}", size), size, owned=True)
        assert cache.used_bytes <= 10_000
        on_disk = sum(p.stat().st_size for p in tmp_path.iterdir())
        assert on_disk == cache.used_bytes  # evicted copies are really gone
    assert cache.peak_bytes <= 10_000 and cache.peak_bytes >= max(sizes)


def test_store_uri_precedence_is_explicit_then_env_then_config(monkeypatch):
    from steps.store import store_uri_for

    monkeypatch.delenv("EAGLENEST_STORE", raising=False)
    assert store_uri_for(None, "file://out/store") == "file://out/store"
    monkeypatch.setenv("EAGLENEST_STORE", "s3://worker/prefix")
    assert store_uri_for(None, "file://out/store") == "s3://worker/prefix"
    assert store_uri_for("file:///explicit", "file://out/store") == "file:///explicit"
