"""The store behaviour every backend must have, as one class of tests: `StoreContract`.

tests/unit/test_store.py runs it over file:// (`TestFileStore`) and tests/integration/test_store_s3.py over a
real S3 protocol server (`TestS3Store`, moto's); each subclass gives a fresh, empty `store` fixture. The
contract only talks to the store's public API and its backend's `get_bytes`/`put_bytes` (to inspect or
corrupt stored objects), so it is backend-agnostic.

Not a test module (its name does not start with `test_`): the class is collected only through those
subclasses, once per backend. Both files register it for pytest's assertion rewriting before importing it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from steps.lib.config import load_config, section_hash
from steps.lib.store import MANIFEST, ArtifactError, Manifest, Store, artifact_id, open_store

REPO = Path(__file__).resolve().parents[1]
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
            from steps.lib.store import open_store
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
        # quarantined: the step that makes it rebuilds it rather than reusing it (sizes still match)
        assert "quarantined" in str(e.value) and not store.exists("draft", "c0de000000000001")

    def test_a_truncated_or_deleted_file_is_caught_on_read(self, store: Store):
        write_artifact(store, "draft", "c0de000000000002", {"a.bin": b"abcdef", "b.bin": b"ghijkl"})
        base = store.key("draft", "c0de000000000002")
        store.backend.put_bytes(f"{base}/a.bin", b"abc")
        store.backend.delete(f"{base}/b.bin")
        with pytest.raises(ArtifactError, match=r"a\.bin: size 3 != manifest 6"):
            store.verify("draft", "c0de000000000002")
        with pytest.raises(ArtifactError, match=r"b\.bin: listed in the manifest but missing"):
            store.fetch_file("draft", "c0de000000000002", "b.bin")
        write_artifact(store, "draft", "c0de000000000002", {"a.bin": b"abcdef"})    # rebuilt after quarantine
        store.backend.put_bytes(f"{base}/a.bin", b"abc")
        with pytest.raises(ArtifactError, match=r"a\.bin: size 3 != manifest 6"):
            store.fetch_file("draft", "c0de000000000002", "a.bin")

    def test_verify_hashes_every_file_and_catches_a_same_size_flipped_byte(self, store: Store):
        """A flipped byte keeps the size, so only the sha256 catches it; verify reads the store's bytes."""
        data = os.urandom(4096)
        write_artifact(store, "export", "c0de000000000003", {"sglang/model.safetensors": data, "ok.json": b"{}"})
        assert [f["path"] for f in store.verify("export", "c0de000000000003").files] == \
            ["ok.json", "sglang/model.safetensors"]
        store.fetch("export", "c0de000000000003")  # an s3 store now holds a good copy in its cache
        key = f"{store.key('export', 'c0de000000000003')}/sglang/model.safetensors"
        flipped = bytearray(data)
        flipped[2049] ^= 0x01
        store.backend.put_bytes(key, bytes(flipped))
        assert store.backend.size(key) == len(data)  # same size: a size-only check passes it
        want, got = hashlib.sha256(data).hexdigest(), hashlib.sha256(bytes(flipped)).hexdigest()
        with pytest.raises(ArtifactError) as e:
            store.verify("export", "c0de000000000003")
        msg = str(e.value)
        assert msg.startswith(f"{store.artifact_uri('export', 'c0de000000000003')}/sglang/model.safetensors: ")
        assert f"sha256 {got} != manifest {want}" in msg
        assert f"delete {store.artifact_uri('export', 'c0de000000000003')}/manifest.json and re-run the 'test' step" \
            in msg
        assert "\n" not in msg

    def test_verify_names_a_file_deleted_from_the_store(self, store: Store):
        write_artifact(store, "export", "c0de000000000004", {"a.bin": b"abc", "b.bin": b"def"})
        store.backend.delete(f"{store.key('export', 'c0de000000000004')}/b.bin")
        with pytest.raises(ArtifactError, match=r"export/c0de000000000004/b\.bin: listed in the manifest but "
                                                r"missing from the store; delete .*/manifest\.json"):
            store.verify("export", "c0de000000000004")

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
        assert w2.key == w.key  # the dead attempt is resumed, not restarted
        assert store.backend.put_files == [f"{w2.key}/shards/shard-00001.safetensors"]
        assert [f["path"] for f in m.files] == ["shards/shard-00000.safetensors", "shards/shard-00001.safetensors"]
        assert set(m.files[0]) == {"path", "size", "sha256"}  # extra fields stay in the upload record
        assert store.fetch_file("hidden", "re00000000000001", "shards/shard-00000.safetensors").read_bytes() == \
            b"a" * 1000

    def test_an_upload_record_whose_object_is_gone_is_not_trusted(self, store: Store):
        w = store.begin("hidden", "re00000000000002", step="extract")
        w.path("s.bin").write_bytes(b"a" * 10)
        w.upload("s.bin", delete_local=True)
        store.backend.delete(f"{w.key}/s.bin")
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
        sidecars = [fresh.backend.get_bytes(k) for k in fresh.backend.list(w.key)
                    if ".partial" in k]
        assert sidecars
        w.commit(meta={"store": fresh.uri})
        fresh.set_alias("production", "hidden", "5ec0000000000001")
        texts = [fresh.backend.get_bytes(f"{fresh.key('hidden', '5ec0000000000001')}/{MANIFEST}"),
                 fresh.backend.get_bytes("aliases/production.json"), *sidecars]
        for text in texts:
            assert SECRET_ID.encode() not in text and SECRET_KEY.encode() not in text
            assert b"SECRET" not in text

    # --- concurrent writers, repair, ids (issue 11) ------------------------------------------------

    def _writer_script(self, store: Store, art_id: str, tag: str, delay: float) -> str:
        """A process that writes `art_id` slowly (its bytes name it) and prints the id it got back."""
        endpoint = getattr(store.backend, "endpoint_url", None)
        return textwrap.dedent(f"""
            import sys, time
            sys.path.insert(0, {str(REPO)!r})
            from steps.lib.store import open_store
            store = open_store({store.uri!r}, cache_dir={str(store.cache_dir)!r} + "-{tag}", endpoint_url={endpoint!r})
            w = store.begin("hidden", {art_id!r}, step="extract")
            if w.reused is None:
                for i in range(3):
                    w.path(f"shards/shard-{{i:05d}}.safetensors").write_bytes(b"{tag}" * 4000)
                    w.upload(f"shards/shard-{{i:05d}}.safetensors", delete_local=True)
                    time.sleep({delay})
            m = w.commit()
            print(m.files[0]["sha256"])
        """)

    def test_two_concurrent_writer_processes_of_one_id_leave_one_intact_artifact(self, store: Store):
        procs = [subprocess.Popen([sys.executable, "-c", self._writer_script(store, "c0c0000000000001", tag, 0.5)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for tag in ("A", "B")]
        outs = [p.communicate(timeout=120) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
        m = store.verify("hidden", "c0c0000000000001")              # every byte matches the one manifest
        assert {o[0].strip() for o in outs} == {m.files[0]["sha256"]}  # both processes got that artifact back
        data = store.fetch_file("hidden", "c0c0000000000001", "shards/shard-00002.safetensors").read_bytes()
        assert data in (b"A" * 4000, b"B" * 4000)
        assert not [k for k in store.backend.list("staging/") if not k.endswith(".lock")]  # no debris, no lease

    def test_a_live_writer_is_waited_for_and_a_dead_ones_lease_is_taken_over(self, store: Store):
        slow = subprocess.Popen([sys.executable, "-c", self._writer_script(store, "c0c0000000000002", "A", 1.5)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lease = store.lease_key("hidden", "c0c0000000000002")
        deadline = time.time() + 60
        while store.backend.get_bytes(lease) is None and time.time() < deadline:
            time.sleep(0.05)
        holder = json.loads(store.backend.get_bytes(lease))
        w = store.begin("hidden", "c0c0000000000002", step="extract")   # waits: the lease's owner is alive
        assert slow.wait(60) == 0 and w.reused is not None and w.reused.files[0]["size"] == 4000
        assert holder["pid"] == slow.pid
        # a lease whose heartbeat is older than its TTL is taken over, its attempt resumed
        stale = json.dumps({**holder, "pid": os.getpid() + 10**6, "host": "elsewhere", "heartbeat": 0,
                            "attempt": "a-dead"}).encode()
        store.backend.create_bytes(store.lease_key("hidden", "c0c0000000000003"), stale)
        w = store.begin("hidden", "c0c0000000000003", step="extract")
        assert w.attempt == "a-dead" and w.reused is None

    def test_a_corrupt_artifact_is_quarantined_and_recomputed_by_the_next_run(self, store: Store):
        write_artifact(store, "draft", "c0c0000000000004", {"m.bin": b"x" * 100, "n.bin": b"y"})
        store.backend.delete(f"{store.key('draft', 'c0c0000000000004')}/n.bin")
        assert not store.exists("draft", "c0c0000000000004")       # the reuse check sees it and moves it aside
        assert store.backend.list("quarantine/draft/c0c0000000000004/")
        m = write_artifact(store, "draft", "c0c0000000000004", {"m.bin": b"x" * 100, "n.bin": b"y"})
        assert store.exists("draft", "c0c0000000000004") and store.verify("draft", m.id) == m

    def test_a_hand_edited_manifest_is_refused_in_one_line_and_repaired_by_a_rerun(self, store: Store):
        write_artifact(store, "verify", "c0c0000000000005", {"report.json": b"{}"})
        key = f"{store.key('verify', 'c0c0000000000005')}/{MANIFEST}"
        store.backend.put_bytes(key, store.backend.get_bytes(key).replace(b'"n": 1', b'"n": 4.35'))
        with pytest.raises(ArtifactError) as e:
            store.manifest("verify", "c0c0000000000005")
        msg = str(e.value)
        assert msg.startswith(f"{store.artifact_uri('verify', 'c0c0000000000005')}/manifest.json: manifest_sha256")
        assert "re-run the step" in msg and "\n" not in msg
        assert not store.exists("verify", "c0c0000000000005")
        write_artifact(store, "verify", "c0c0000000000005", {"report.json": b"{}"})
        assert store.manifest("verify", "c0c0000000000005").metrics == {"n": 1}

    @pytest.mark.parametrize("bad", ["../../../outside/evil", "../hidden/aaaa000000000001", "/etc", "..", "",
                                     "a/b", ".hidden"])
    def test_ids_that_leave_the_store_are_refused(self, store: Store, bad: str):
        with pytest.raises(ArtifactError, match="is not a plain name"):
            store.manifest("draft", bad)
        with pytest.raises(ArtifactError, match="is not a plain name"):
            store.exists("draft", bad)
        with pytest.raises(ArtifactError, match="is not a plain name"):
            store.begin(bad, "aaaa000000000001", step="x")

    def test_a_manifest_of_another_artifact_is_not_read_as_this_one(self, store: Store):
        write_artifact(store, "hidden", "c0c0000000000006", {"x": b"1"})
        key = store.key("hidden", "c0c0000000000006")
        store.backend.put_bytes(f"{store.key('draft', 'c0c0000000000006')}/{MANIFEST}",
                                store.backend.get_bytes(f"{key}/{MANIFEST}"))
        with pytest.raises(ArtifactError, match="holds hidden/c0c0000000000006, not draft/c0c0000000000006"):
            store.manifest("draft", "c0c0000000000006")

    # --- maintenance: `eaglenest store verify|gc` (issue 11) -----------------------------------------

    def test_store_verify_hashes_every_artifact_and_names_the_corrupt_one(self, store: Store):
        from steps.lib.store import verify_all

        write_artifact(store, "draft", "dddd000000000001", {"m.bin": os.urandom(2048)})
        write_artifact(store, "export", "eeee000000000001", {"s/m.bin": os.urandom(2048)})
        assert [(r["kind"], r["id"], r["ok"]) for r in verify_all(store)] == \
            [("draft", "dddd000000000001", True), ("export", "eeee000000000001", True)]
        key = f"{store.key('export', 'eeee000000000001')}/s/m.bin"
        flipped = bytearray(store.backend.get_bytes(key))
        flipped[7] ^= 0x10
        store.backend.put_bytes(key, bytes(flipped))                  # same size: only sha256 sees it
        bad = [r for r in verify_all(store) if not r["ok"]]
        assert [(r["kind"], r["id"]) for r in bad] == [("export", "eeee000000000001")] and "sha256" in bad[0]["error"]
        assert [r["id"] for r in verify_all(store, kind="draft")] == ["dddd000000000001"]
        assert verify_all(store, art_id="dddd000000000001")[0]["ok"]
        with pytest.raises(ArtifactError, match="not an artifact id"):
            verify_all(store, art_id="../export/eeee000000000001")

    def test_gc_removes_debris_orphans_and_expired_leases_and_keeps_a_live_writer(self, store: Store):
        import socket

        from steps.lib.store import LEASE, collect_garbage

        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        try:
            def lease(art_id: str, attempt: str, pid: int, heartbeat: float) -> None:
                rec = {"owner": "t", "host": socket.gethostname(), "pid": pid, "heartbeat": heartbeat, "ttl": 60,
                       "attempt": attempt}
                store.backend.create_bytes(f"staging/hidden/{art_id}/{LEASE}", json.dumps(rec).encode())

            write_artifact(store, "hidden", "9c00000000000001", {"x": b"1"})
            store.backend.put_bytes("staging/hidden/9c00000000000001/a-lost/shard", b"debris")   # lost the race
            lease("9c00000000000002", "a-live", sleeper.pid, time.time())                           # a live writer
            store.backend.put_bytes("staging/hidden/9c00000000000002/a-live/shard", b"live" * 10)
            store.backend.put_bytes("staging/hidden/9c00000000000002/a-old/shard", b"orphan")
            lease("9c00000000000003", "a-dead", 2**22 + 12345, 0.0)                                # expired
            store.backend.put_bytes("staging/hidden/9c00000000000003/a-dead/shard", b"dead" * 10)
            store.backend.put_bytes("staging/hidden/9c00000000000004/a-none/shard", b"nobody")    # no lease
            dry = collect_garbage(store, dry_run=True)
            assert len(store.backend.list("staging/")) == 7 and dry["dry_run"]     # a dry run removes nothing
            out = collect_garbage(store)
            assert {r["key"] for r in out["removed"]} == {r["key"] for r in dry["removed"]} == {
                "staging/hidden/9c00000000000001/a-lost/shard", "staging/hidden/9c00000000000002/a-old/shard",
                f"staging/hidden/9c00000000000003/{LEASE}", "staging/hidden/9c00000000000003/a-dead/shard",
                "staging/hidden/9c00000000000004/a-none/shard"} | (
                # the committed writer's lock file, hidden from listings, is debris too (a local store only)
                {"staging/hidden/9c00000000000001/.lease.json.lock"} if store.backend.local_path("") else set())
            assert store.backend.list("staging/") == ["staging/hidden/9c00000000000002/a-live/shard",
                                                      f"staging/hidden/9c00000000000002/{LEASE}"]
            assert store.verify("hidden", "9c00000000000001").files[0]["size"] == 1
            assert store.partial_files("hidden", "9c00000000000003") == []      # the next writer starts afresh
        finally:
            sleeper.kill()
            sleeper.wait()
