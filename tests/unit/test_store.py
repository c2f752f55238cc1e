"""steps/lib/store/ over file://: manifests last, verified reads, content-addressed ids, resumable
uploads, aliases, the bounded local cache and store-URI parsing.

`StoreContract` (tests/store_contract.py) holds the behaviour every backend must have; `TestFileStore`
runs it over a local folder and tests/integration/test_store_s3.py runs the same class over a real S3
protocol server (moto's).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from steps.lib.config import load_config
from steps.lib.store import ArtifactError, FileBackend, LocalCache, Manifest, S3Backend, Store, artifact_id, open_store

pytest.register_assert_rewrite("tests.store_contract")  # before the import: failed contract asserts show values
from tests.store_contract import StoreContract, write_artifact  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


class TestFileStore(StoreContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return open_store(f"file://{tmp_path}/store", cache_dir=tmp_path / "cache")

    def test_staging_is_the_attempt_folder_and_commit_moves_it_into_place_without_sidecars(self, store: Store):
        root = Path(store.uri.removeprefix("file://"))
        w = store.begin("dataset", "f000000000000001", step="datagen")
        local = w.path("conversations/part-00000.jsonl")
        assert local.parent.parent == root / "staging/dataset/f000000000000001" / w.attempt
        local.write_text("row\n")
        w.upload("conversations/part-00000.jsonl", delete_local=True)
        assert local.read_text() == "row\n"  # "deleting the local copy" must not delete the stored one
        m = w.commit()
        assert [f["path"] for f in m.files] == ["conversations/part-00000.jsonl"]
        art_dir = root / "artifacts/dataset/f000000000000001"
        assert sorted(p.relative_to(art_dir).as_posix() for p in art_dir.rglob("*")) == \
            ["conversations", "conversations/part-00000.jsonl", "manifest.json"]
        assert not (root / "staging/dataset/f000000000000001" / w.attempt).exists()
        assert store.backend.get_bytes(store.lease_key("dataset", "f000000000000001")) is None

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

    def test_a_sha_mismatch_on_read_quarantines_so_the_step_rebuilds(self, store: Store):
        """Same size, other bytes: the reuse check (sizes) passes, so only the reader can break the loop."""
        w = store.begin("draft", "f000000000000005", step="train")
        w.path("m").write_bytes(b"good")
        w.upload("m")
        w.commit()
        Path(store.uri.removeprefix("file://"), "artifacts/draft/f000000000000005/m").write_bytes(b"evil")
        assert store.exists("draft", "f000000000000005")
        with pytest.raises(ArtifactError, match="sha256 does not match.*quarantined.*rebuilds it"):
            store.fetch_file("draft", "f000000000000005", "m")
        assert not store.exists("draft", "f000000000000005")
        assert store.begin("draft", "f000000000000005", step="train").reused is None     # rebuilt, not reused

    def test_gc_on_a_full_disk_frees_first_and_removes_hidden_debris(self, store: Store, monkeypatch):
        """Issue 27: gc's one write (taking a dead lease) waits for the space its deletes free; dot-files (a
        dead writer's temp files, lock files), even in a folder holding nothing else, go with their folders."""
        import errno
        import socket

        from steps.lib.store import LEASE, collect_garbage

        dead = {"owner": "t", "host": socket.gethostname(), "pid": 2**22 + 4321, "heartbeat": 0.0, "ttl": 60,
                "attempt": "a-dead"}
        store.backend.create_bytes(f"staging/hidden/0a00000000000001/{LEASE}", json.dumps(dead).encode())
        store.backend.put_bytes("staging/hidden/0a00000000000001/a-dead/shard", b"dead")
        write_artifact(store, "hidden", "ff00000000000001", {"x": b"1"})
        store.backend.put_bytes("staging/hidden/ff00000000000001/a-lost/shard", b"debris")
        root = Path(store.uri.removeprefix("file://"))
        hidden_only = root / "staging/draft/0b00000000000001/a-x"
        hidden_only.mkdir(parents=True)
        (hidden_only / f".shard-0.tmp-{2**22 + 4321}").write_bytes(b"partial")
        (hidden_only.parent / f".lease.json.tmp-{2**22 + 4321}").write_bytes(b"{}")
        freed: list[str] = []
        delete, swap = FileBackend.delete, FileBackend.swap_bytes

        def full_until_freed(backend, key, data, expect):
            if not freed:
                raise OSError(errno.ENOSPC, "No space left on device")
            return swap(backend, key, data, expect)

        monkeypatch.setattr(FileBackend, "delete", lambda backend, key: (freed.append(key), delete(backend, key)))
        monkeypatch.setattr(FileBackend, "swap_bytes", full_until_freed)
        out = collect_garbage(store)
        assert "staging/hidden/0a00000000000001/a-dead/shard" in {r["key"] for r in out["removed"]}
        assert f"staging/draft/0b00000000000001/a-x/.shard-0.tmp-{2**22 + 4321}" in {r["key"] for r in out["removed"]}
        assert out["kept"] == [] and not any((root / "staging").rglob("*")), list((root / "staging").rglob("*"))

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
    def bare(art_id: str) -> str:  # only the required fields, sealed as a writer seals the full form
        return json.dumps({"kind": "draft", "id": art_id, "step": "train",
                           "manifest_sha256": Manifest(kind="draft", id=art_id, step="train").checksum()})

    a, b = Manifest.from_json(bare("x")), Manifest.from_json(bare("y"))
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


def test_without_eaglenest_cache_each_store_gets_its_own_scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # two stores on one machine (make demo in two clones, the tests beside a demo) never share scratch;
    # the same store opened twice (relative or absolute spelling) finds its own again
    monkeypatch.delenv("EAGLENEST_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    a, b = open_store("file://out/a"), open_store("file://out/b")
    assert a.cache_dir != b.cache_dir
    assert a.cache_dir.parent == b.cache_dir.parent == Path(tempfile.gettempdir()) / "eaglenest-cache"
    assert open_store(f"file://{tmp_path}/out/a").cache_dir == a.cache_dir
    s3 = open_store("s3://bucket/a", endpoint_url="http://127.0.0.1:9")
    assert s3.cache_dir not in (a.cache_dir, open_store("s3://bucket/b", endpoint_url="http://127.0.0.1:9").cache_dir)


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


def test_a_plain_folder_path_is_a_file_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """What the store prints (`/abs/store`, or the folder of a `file://` URI) is accepted back as --store."""
    monkeypatch.chdir(tmp_path)
    assert open_store("rel/store", cache_dir=tmp_path / "c").uri == f"file://{(tmp_path / 'rel/store').resolve()}"
    assert open_store(str(tmp_path / "abs"), cache_dir=tmp_path / "c").backend.root == tmp_path / "abs"


@pytest.mark.parametrize("uri, fragment", [("http://host/x", "expected file://PATH, a folder path or s3://"),
                                           ("s3:///no-bucket", "needs a bucket"),
                                           ("file://", "needs a folder")])
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


def test_store_uri_precedence_is_explicit_then_env_then_config(monkeypatch, tmp_path):
    from steps.lib.store import store_uri_for

    monkeypatch.delenv("EAGLENEST_STORE", raising=False)
    monkeypatch.setenv("EAGLENEST_HOME", str(tmp_path))
    # a config's relative store is under EAGLENEST_HOME, wherever the command runs
    assert store_uri_for(None, "file://out/store") == f"file://{tmp_path.resolve()}/out/store"
    assert store_uri_for(None, "s3://bucket/p") == "s3://bucket/p"
    monkeypatch.setenv("EAGLENEST_STORE", "s3://worker/prefix")
    assert store_uri_for(None, "file://out/store") == "s3://worker/prefix"
    assert store_uri_for("file:///explicit", "file://out/store") == "file:///explicit"


def test_a_manifest_written_before_checksums_is_still_read_but_an_edited_one_is_not():
    legacy = {"kind": "draft", "id": "0" * 16, "step": "train", "metrics": {"loss": 1.5}}
    assert Manifest.from_json(json.dumps(legacy)).metrics == {"loss": 1.5}
    stamped = json.loads(Manifest(**legacy).to_json())
    stamped["metrics"]["loss"] = 0.1
    with pytest.raises(ArtifactError, match="manifest_sha256 does not match"):
        Manifest.from_json(json.dumps(stamped))


def test_listing_a_local_store_while_a_writer_prunes_a_folder_lists_what_is_left(tmp_path: Path, monkeypatch):
    # A training step prunes its old checkpoints while a reader (a flow's progress poll, `doctor`, another
    # run) lists the same staging folder: the folder vanishes between being seen and being opened. The removal
    # is made to land exactly there, in the walk's own call, so the race happens on every run of this test.
    backend = FileBackend(tmp_path)
    for n in (1, 2, 3):
        backend.put_bytes(f"staging/draft/d/a-1/checkpoint-{n}/model.safetensors", b"w")
    backend.put_bytes("staging/draft/d/a-1/.lock", b"")
    pruned = tmp_path / "staging/draft/d/a-1/checkpoint-1"
    real_scandir = os.scandir

    def prune_first(path):                         # rmtree itself scans by file descriptor (an int)
        if not isinstance(path, int) and Path(path) == pruned and pruned.exists():
            shutil.rmtree(pruned)                  # the writer's prune, between the reader's two looks
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", prune_first)
    assert backend.list("staging/draft/") == [f"staging/draft/d/a-1/checkpoint-{n}/model.safetensors" for n in (2, 3)]


def test_a_local_store_lists_keys_in_string_order_as_s3_does(tmp_path: Path):
    backend = FileBackend(tmp_path)
    for key in ("s/a/x", "s/a-b/x", "s/a.json"):
        backend.put_bytes(key, b"1")
    assert backend.list("s/") == ["s/a-b/x", "s/a.json", "s/a/x"]       # '-' < '.' < '/' as bytes
