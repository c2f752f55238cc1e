"""The commit protocol: one writer per artifact holds its lease (renewed by a heartbeat thread, taken
over once dead), stages files under its attempt, and `commit()` puts them in place and creates the manifest."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from steps.lib.errors import ArtifactError
from steps.lib.store.backends import Backend
from steps.lib.store.committed import is_committed, partial_files, quarantine, read_manifest
from steps.lib.store.ids import code_version, sha256_file, utc_now
from steps.lib.store.keys import PARTIAL, artifact_key, attempt_key, lease_key, staging_key, uri_of
from steps.lib.store.manifest import MANIFEST, Manifest, is_data_file

#: seconds without a heartbeat after which a writer's lease may be taken over (EAGLENEST_LEASE_TTL).
LEASE_TTL_S = 120.0


def _remove_empty_dirs(top: Path | None) -> None:
    """Remove `top` and its sub-folders if they hold no files (a local store's spent `.partial/`)."""
    if top is None or not top.is_dir():
        return
    for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        if not any(d.iterdir()):
            d.rmdir()
    if not any(top.iterdir()):
        top.rmdir()


def _pid_gone(pid: int) -> bool:
    """True when no process `pid` runs on this host (a zombie counts as gone: it is dead, only unreaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def lease_is_dead(rec: dict[str, Any]) -> bool:
    """A lease may be taken over when its heartbeat is older than its TTL, or sooner when its owner
    provably cannot renew it: a process of this host that is gone, or this very process (a process does
    not race itself; its abandoned writer finds the lease gone and stops)."""
    if time.time() - float(rec.get("heartbeat", 0)) > float(rec.get("ttl", LEASE_TTL_S)):
        return True
    if rec.get("host") != socket.gethostname():
        return False
    return rec.get("pid") == os.getpid() or _pid_gone(int(rec.get("pid", 0)))


def _heartbeat(ref: weakref.ReferenceType, stop: threading.Event, every: float) -> None:
    """Renew a writer's lease until it commits, is discarded or is garbage (holds only a weak reference)."""
    while not stop.wait(every):
        writer = ref()
        if writer is None or not writer.renew():
            return
        del writer


class ArtifactWriter:
    """Stages files for one attempt at an artifact; `commit()` puts them in place and creates the manifest.

    Files can be uploaded early with `upload(path)` (extraction uploads each shard as soon as it is
    written, then deletes the local copy): they are recorded with size and sha256 under the attempt,
    and a later writer that takes the lease over resumes from them (`committed.partial_files`). The writer
holds the store's backend and root, never the `Store`: what both need is in `keys` and `committed`.
    `reused` is set when another writer committed the artifact while this one waited for the lease:
    callers return it instead of recomputing, and `commit()` hands it back.
    """

    def __init__(self, backend: Backend, root: str, manifest: Manifest, staging: Path, attempt: str, *,
                 lease: bytes | None = None, reused: Manifest | None = None):
        self.backend, self.root = backend, root
        self.manifest, self.staging, self.attempt = manifest, staging, attempt
        self.reused, self._lease, self.lost = reused, lease, False
        self._uploaded: dict[str, dict[str, Any]] = {}
        if reused is None:
            self.reload()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        if lease is not None:
            ttl = float(json.loads(lease)["ttl"])
            self._beat = threading.Thread(target=_heartbeat, args=(weakref.ref(self), self._stop, ttl / 4),
                                          daemon=True, name=f"lease-{manifest.id}")
            self._beat.start()
            weakref.finalize(self, self._stop.set)

    def reload(self) -> None:
        """Pick up the upload records of the attempt, including those other ranks of the job wrote."""
        for rec in partial_files(self.backend, self.manifest.kind, self.manifest.id, self.attempt):
            self._uploaded[rec["path"]] = rec

    @property
    def key(self) -> str:
        """The attempt's staging prefix in the store (never the artifact's final folder)."""
        return attempt_key(self.manifest.kind, self.manifest.id, self.attempt)

    @property
    def artifact_uri(self) -> str:
        """Where the artifact will be once committed (for messages)."""
        return uri_of(self.root, artifact_key(self.manifest.kind, self.manifest.id))

    def landed_path(self, rel: str) -> Path | None:
        """The uploaded file itself when the store is a local folder (file://); None for a remote store."""
        return self.backend.local_path(f"{self.key}/{rel}")

    def _lease_key(self) -> str:
        return lease_key(self.manifest.kind, self.manifest.id)

    def _committed(self) -> Manifest | None:
        kind, art_id = self.manifest.kind, self.manifest.id
        return read_manifest(self.backend, self.root, kind, art_id) \
            if is_committed(self.backend, self.root, kind, art_id) else None

    def renew(self) -> bool:
        """Refresh the lease's heartbeat; False (and `lost`) if another writer took it over."""
        if self._lease is None:
            return True
        new = json.dumps({**json.loads(self._lease), "heartbeat": time.time()}).encode()
        if self.backend.swap_bytes(self._lease_key(), new, self._lease):
            self._lease = new
            return True
        self.lost = True
        return False

    def _check_lease(self) -> None:
        if self.lost:
            raise ArtifactError(f"{self.artifact_uri}: this writer's "
                                "lease was taken over (no heartbeat for longer than its TTL); its work is "
                                "abandoned, re-run the step to reuse or resume the other writer's")

    def path(self, rel: str) -> Path:
        """Local staging path for a data file (parents created)."""
        p = self.staging / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def has(self, rel: str) -> bool:
        return rel in self._uploaded

    def uploaded(self, rel: str) -> dict[str, Any] | None:
        return self._uploaded.get(rel)

    def upload(self, rel: str, *, delete_local: bool = False, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Upload a staged file now, verify it landed, record it; optionally delete the local copy."""
        self._check_lease()
        local = self.staging / rel
        size, digest = local.stat().st_size, sha256_file(local)
        self.backend.put_file(f"{self.key}/{rel}", local)
        landed = self.backend.size(f"{self.key}/{rel}")
        if landed != size:
            raise ArtifactError(f"upload of {self.key}/{rel}: {landed} bytes landed, expected {size}")
        rec = {"path": rel, "size": size, "sha256": digest, **(extra or {})}
        # A sidecar makes the upload visible to a resumed run before the manifest exists.
        self.backend.put_bytes(f"{self.key}/{PARTIAL}/{rel}.json", json.dumps(rec).encode())
        self._uploaded[rel] = rec
        if delete_local and self.backend.local_path(f"{self.key}/{rel}") != local.resolve():
            local.unlink()
        return rec

    def commit(self, *, metrics: dict[str, Any] | None = None, meta: dict[str, Any] | None = None) -> Manifest:
        """Upload what is left, move the attempt into place, create the manifest (last, only if absent).

        Returns the committed manifest: this writer's, or the first writer's when another one won."""
        kind, art_id = self.manifest.kind, self.manifest.id
        if self.reused is not None:
            return self.reused
        self._check_lease()
        for p in sorted(self.staging.rglob("*")):
            rel = p.relative_to(self.staging).as_posix()
            if p.is_file() and rel not in self._uploaded and is_data_file(rel):
                self.upload(rel)
        m = self.manifest
        m.files = sorted(({k: v for k, v in r.items() if k in ("path", "size", "sha256")}
                          for r in self._uploaded.values()), key=lambda r: r["path"])
        m.metrics.update(metrics or {})
        m.meta.update(meta or {})
        m.created = utc_now()
        m.code_version = code_version()
        backend, final = self.backend, artifact_key(kind, art_id)
        if (won := self._committed()) is not None:   # another writer finished first: reuse, drop ours
            self.discard()
            return won
        # Upload records are resume state, not artifact files: gone before the attempt moves into place.
        for k in backend.list(f"{self.key}/{PARTIAL}/"):
            backend.delete(k)
        _remove_empty_dirs(backend.local_path(f"{self.key}/{PARTIAL}"))
        listed = {f["path"] for f in m.files}
        local = backend.local_path(self.key)
        leftovers = ([p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()] if local is not None
                     else [k[len(self.key) + 1:] for k in backend.list(f"{self.key}/")])
        for rel in leftovers:                       # temp and hidden files, removed checkpoints: not the artifact
            if rel not in listed:
                backend.delete(f"{self.key}/{rel}")
        if backend.local_path(final) is not None:
            # file://: the manifest goes in with the files, and one rename publishes both; it fails when
            # a folder is already there (a winner's, or debris without a valid manifest: quarantined).
            backend.put_bytes(f"{self.key}/{MANIFEST}", m.to_json().encode())
            while not backend.move_prefix(self.key, final):
                if (won := self._committed()) is not None:
                    self.discard()
                    return won
                quarantine(backend, self.root, kind, art_id, "an unfinished folder without a valid manifest")
        else:
            backend.move_prefix(f"{self.key}/", f"{final}/")
            if not backend.create_bytes(f"{final}/{MANIFEST}", m.to_json().encode()):
                self.discard()
                return read_manifest(backend, self.root, kind, art_id)
        self.discard()
        return read_manifest(backend, self.root, kind, art_id)

    def discard(self) -> None:
        """Drop this attempt's staging (store and local) and release the lease."""
        backend = self.backend
        for k in backend.list(f"{self.key}/"):
            backend.delete(k)
        local = backend.local_path(self.key)
        if local is not None:
            shutil.rmtree(local, ignore_errors=True)
        if self.staging != local:
            shutil.rmtree(self.staging, ignore_errors=True)
        self._stop.set()
        # A renewal in flight would replace the lease after the release below read it: the release's
        # compare-and-swap would then miss, leaving the lease behind (seen once through a faulty S3 proxy).
        if self._beat is not None and self._beat is not threading.current_thread():
            self._beat.join(timeout=60)
        if self._lease is not None and not self.lost:
            backend.swap_bytes(self._lease_key(), None, self._lease)
            self._lease = None
        _remove_empty_dirs(backend.local_path(staging_key(self.manifest.kind, self.manifest.id)))
