"""`Store`: artifacts (read, verified, written through an `ArtifactWriter`), aliases and plain objects
over one backend, with a local cache folder for remote reads."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from steps.lib.errors import ArtifactError
from steps.lib.store.backends import Backend
from steps.lib.store.committed import is_committed, partial_files, quarantine, read_manifest
from steps.lib.store.ids import sha256_file, utc_now
from steps.lib.store.keys import alias_key, artifact_key, lease_key, staging_key, uri_of
from steps.lib.store.manifest import MANIFEST, Manifest
from steps.lib.store.writer import LEASE_TTL_S, ArtifactWriter, lease_is_dead

log = logging.getLogger("eaglenest.store")


class Store:
    """Artifacts and aliases over a file or S3 backend, plus a local cache for remote reads."""

    def __init__(self, uri: str, backend: Backend, cache_dir: Path):
        self.uri, self.backend, self.cache_dir = uri, backend, cache_dir

    # ids and keys (steps/lib/store/keys.py)
    @staticmethod
    def key(kind: str, art_id: str) -> str:
        return artifact_key(kind, art_id)

    @staticmethod
    def staging_key(kind: str, art_id: str) -> str:
        return staging_key(kind, art_id)

    @staticmethod
    def lease_key(kind: str, art_id: str) -> str:
        return lease_key(kind, art_id)

    def artifact_uri(self, kind: str, art_id: str) -> str:
        return uri_of(self.uri, artifact_key(kind, art_id))

    # reading (steps/lib/store/committed.py)
    def exists(self, kind: str, art_id: str) -> bool:
        """True for a committed artifact whose manifest checks out and whose files have their sizes (the
        reuse check of every step). A broken one is quarantined, so the step that asked recomputes it;
        reading its files still verifies their sha256."""
        return is_committed(self.backend, self.uri, kind, art_id)

    def quarantine(self, kind: str, art_id: str, reason: str) -> str:
        """Move a broken artifact folder aside to `quarantine/<kind>/<id>/<time>/`; returns where it went."""
        return quarantine(self.backend, self.uri, kind, art_id, reason)

    def manifest(self, kind: str, art_id: str) -> Manifest:
        return read_manifest(self.backend, self.uri, kind, art_id)

    def list(self, kind: str) -> list[str]:
        keys = (k.split("/") for k in self.backend.list(f"artifacts/{kind}/"))
        return sorted({parts[2] for parts in keys if len(parts) == 4 and parts[3] == MANIFEST})

    def partial_files(self, kind: str, art_id: str, attempt: str | None = None) -> list[dict[str, Any]]:
        """Files uploaded by an unfinished attempt at this artifact (default: the one its lease names)."""
        return partial_files(self.backend, kind, art_id, attempt)

    def local_path(self, key: str) -> Path | None:
        """The file behind `key` itself when the store is a local folder (file://); None for a remote store,
        whose reads are copies in the cache."""
        return self.backend.local_path(key)

    def fetch_file(self, kind: str, art_id: str, rel: str, manifest: Manifest | None = None,
                   *, verify: bool = True) -> Path:
        """A verified local path to one file of an artifact (downloaded to the cache if remote)."""
        m = manifest or self.manifest(kind, art_id)
        rec = m.file(rel)
        key = f"{self.key(kind, art_id)}/{rel}"
        local = self.backend.local_path(key)
        if local is not None:
            self._check_or_quarantine(kind, art_id, local, rec, rel, verify)
            return local
        local = self.cache_dir / kind / art_id / rel
        cached = local.is_file() and local.stat().st_size == rec["size"]
        if cached:
            try:
                self._check_file(local, rec, f"{self.artifact_uri(kind, art_id)}/{rel}", verify)
                return local
            except ArtifactError:
                pass  # a stale cached copy (another store, a killed download): fetch it again
        try:
            self.backend.get_file(key, local)
        except FileNotFoundError:
            raise ArtifactError(f"{self.artifact_uri(kind, art_id)}/{rel}: listed in the manifest but "
                                "missing from the store (deleted or never uploaded; re-run the step)") from None
        self._check_or_quarantine(kind, art_id, local, rec, rel, verify)
        return local

    def _check_or_quarantine(self, kind: str, art_id: str, local: Path, rec: dict[str, Any], rel: str,
                             verify: bool) -> None:
        """`_check_file` of the store's own bytes; a mismatch quarantines the artifact, so the step that
        makes it rebuilds it instead of reusing it (its reuse check reads sizes only) and failing again."""
        try:
            self._check_file(local, rec, f"{self.artifact_uri(kind, art_id)}/{rel}", verify)
        except ArtifactError as err:
            where = self.quarantine(kind, art_id, str(err))
            raise ArtifactError(f"{err}; quarantined it to {uri_of(self.uri, where)}: the next run of the step "
                                "that makes it rebuilds it") from None

    @staticmethod
    def _check_file(local: Path, rec: dict[str, Any], where: str, verify: bool) -> None:
        """Raise unless `local` has the manifest's size (and sha256 when `verify`)."""
        if not local.is_file():
            raise ArtifactError(f"{where}: listed in the manifest but missing")
        if local.stat().st_size != rec["size"]:
            raise ArtifactError(f"{where}: size {local.stat().st_size} != manifest {rec['size']} "
                                "(corrupt or overwritten; re-run the step)")
        if verify and sha256_file(local) != rec["sha256"]:
            raise ArtifactError(f"{where}: sha256 does not match the manifest (corrupt or overwritten; "
                                "re-run the step)")

    def fetch(self, kind: str, art_id: str, *, verify: bool = True) -> Path:
        """A verified local directory holding the whole artifact."""
        m = self.manifest(kind, art_id)
        for rec in m.files:
            self.fetch_file(kind, art_id, rec["path"], m, verify=verify)
        local = self.backend.local_path(self.key(kind, art_id))
        return local if local is not None else self.cache_dir / kind / art_id

    def verify(self, kind: str, art_id: str) -> Manifest:
        """Check every file of the artifact as the store holds it (not a cached copy) against its manifest:
        size, then sha256 (S3 objects are streamed through the hash, never held whole or cached)."""
        m = self.manifest(kind, art_id)
        fix = (f"delete {self.artifact_uri(kind, art_id)}/{MANIFEST} and re-run the {m.step!r} step to "
               "rebuild the artifact")
        for rec in m.files:
            key, where = f"{self.key(kind, art_id)}/{rec['path']}", f"{self.artifact_uri(kind, art_id)}/{rec['path']}"
            size = self.backend.size(key)
            if size is None:
                raise ArtifactError(f"{where}: listed in the manifest but missing from the store; {fix}")
            if size != rec["size"]:
                raise ArtifactError(f"{where}: size {size} != manifest {rec['size']} (corrupt or overwritten); {fix}")
            digest = self.backend.sha256(key)
            if digest is None:
                raise ArtifactError(f"{where}: listed in the manifest but missing from the store; {fix}")
            if digest != rec["sha256"]:
                raise ArtifactError(f"{where}: sha256 {digest} != manifest {rec['sha256']} (corrupt or "
                                    f"overwritten); {fix}")
        return m

    # writing
    def begin(self, kind: str, art_id: str, *, step: str, inputs: dict[str, str] | None = None,
              config: Any = None, staging: Path | None = None, join: str | None = None) -> ArtifactWriter:
        """Start, resume or wait to reuse an artifact: take its lease (waiting while another live writer
        holds it; resuming the attempt of a dead one), or `join` an attempt another rank of this job
        holds. When the artifact is committed meanwhile, the writer's `reused` is its manifest.

        Files are staged in `staging` when given (extraction stages shards in a scratch folder so
        its disk budget is measured the same way for every backend), else in the attempt's staging
        folder of the store (file://) or in the cache (s3://).
        """
        from steps.lib.config import config_dict, section_hash

        cfg = config_dict(config) if config is not None else {}
        m = Manifest(kind=kind, id=art_id, step=step, inputs=dict(inputs or {}),
                     config_hash=section_hash(cfg) if cfg else "", config=cfg)
        lease, reused = None, None
        if join is not None:
            attempt = join
        else:
            lease = self._acquire(kind, art_id)
            if lease is None:
                reused, attempt = self.manifest(kind, art_id), "reused"
            else:
                attempt = json.loads(lease)["attempt"]
        key = f"{self.staging_key(kind, art_id)}/{attempt}"
        if reused is not None:
            staging = self.cache_dir / "staging" / kind / art_id / f"reused-{uuid.uuid4().hex}"
        elif staging is None:
            local = self.backend.local_path(key)
            staging = local if local is not None else self.cache_dir / "staging" / kind / art_id / attempt
        staging.mkdir(parents=True, exist_ok=True)
        return ArtifactWriter(self.backend, self.uri, m, staging, attempt, lease=lease, reused=reused)

    def _acquire(self, kind: str, art_id: str) -> bytes | None:
        """This process's lease on the artifact (its bytes), or None once the artifact is committed."""
        key, waited = self.lease_key(kind, art_id), False
        ttl = float(os.environ.get("EAGLENEST_LEASE_TTL", LEASE_TTL_S))
        while True:
            if self.exists(kind, art_id):
                return None
            me = {"owner": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(),
                  "heartbeat": time.time(), "ttl": ttl}
            raw = self.backend.get_bytes(key)
            if raw is None:
                new = json.dumps({**me, "attempt": f"a-{uuid.uuid4().hex[:16]}"}).encode()
                if self.backend.create_bytes(key, new):
                    return new
                continue
            held = json.loads(raw)
            if lease_is_dead(held):
                new = json.dumps({**me, "attempt": held["attempt"]}).encode()
                if self.backend.swap_bytes(key, new, raw):   # one taker wins; the others see a live lease
                    log.info("store: resuming %s from attempt %s (its writer pid %s on %s stopped)",
                             self.artifact_uri(kind, art_id), held["attempt"], held.get("pid"), held.get("host"))
                    return new
                continue
            if not waited:
                log.info("store: waiting for %s: pid %s on %s is writing it", self.artifact_uri(kind, art_id),
                         held.get("pid"), held.get("host"))
                waited = True
            time.sleep(min(1.0, ttl / 8))

    # aliases
    def set_alias(self, name: str, kind: str, art_id: str, meta: dict[str, Any] | None = None) -> dict[str, Any]:
        """Point `name` at an existing artifact; the record keeps the one it replaced under `previous`."""
        if not self.exists(kind, art_id):
            raise ArtifactError(f"alias {name!r}: artifact {kind}/{art_id} does not exist")
        old = self.get_alias(name)
        rec = {"kind": kind, "id": art_id, "meta": meta or {}, "updated": utc_now(),
               "previous": {"kind": old["kind"], "id": old["id"]} if old else None}
        self.backend.put_bytes(alias_key(name), json.dumps(rec, indent=2).encode())
        return rec

    def get_alias(self, name: str) -> dict[str, Any] | None:
        """The alias record, None when there is none; a corrupt one is an ArtifactError naming its file."""
        raw = self.backend.get_bytes(alias_key(name))
        if not raw:
            return None
        where = uri_of(self.uri, alias_key(name))
        try:
            rec = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as err:
            raise ArtifactError(f"{where}: not valid JSON ({err}); delete it and promote an export again") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("kind"), str) or not isinstance(rec.get("id"), str):
            raise ArtifactError(f"{where}: not an alias record (needs \"kind\" and \"id\"); delete it and promote "
                                "an export again")
        return rec

    def alias_problem(self, name: str) -> str | None:
        """Why alias `name` cannot be trusted (corrupt, or its target missing or broken), None when it can or
        does not exist. The target's manifest and sizes are checked (`exists`: a broken one is quarantined)."""
        try:
            rec = self.get_alias(name)
        except ArtifactError as err:
            return str(err)
        if rec is None or self.exists(rec["kind"], rec["id"]):
            return None
        return (f"{uri_of(self.uri, alias_key(name))} points at {rec['kind']}/{rec['id']}, which is not in the store "
                "(deleted, or quarantined as broken); promote an export again")

    def restore_alias(self, name: str, record: dict[str, Any] | None) -> None:
        """Put back an alias record exactly as `get_alias` returned it (None: the alias did not exist)."""
        if record is None:
            self.backend.delete(alias_key(name))
        else:
            self.backend.put_bytes(alias_key(name), json.dumps(record, indent=2).encode())

    # plain objects: uploaded inputs such as `datasets/<name>/<file>`, versioned by ETag, no manifest
    def object_uri(self, key: str) -> str:
        return uri_of(self.uri, key)

    def stat(self, key: str) -> dict[str, Any] | None:
        """`{"size", "etag"}` of a stored object (its version: md5 for a whole upload), None if absent."""
        return self.backend.stat(key)

    def put_object(self, key: str, local: Path) -> dict[str, Any]:
        """Upload one file whole (its version is then its md5) and return the stored `stat`."""
        self.backend.put_file_whole(key, Path(local))
        landed = self.backend.stat(key)
        size = Path(local).stat().st_size
        if landed is None or landed["size"] != size:
            raise ArtifactError(f"upload of {self.object_uri(key)}: {landed and landed['size']} bytes landed, "
                                f"expected {size}")
        return landed

    def list_objects(self, prefix: str) -> list[str]:
        """Keys under `prefix`, without hidden or temporary files (names starting with a dot)."""
        return [k for k in self.backend.list(prefix) if not k.rsplit("/", 1)[-1].startswith(".")]

    def fetch_object(self, key: str) -> Path:
        """A local copy of a plain object (the file itself on file://, else a copy in the cache,
        downloaded again when its ETag changed)."""
        local = self.backend.local_path(key)
        if local is not None:       # a file store: the object is the file (no checksum needed to find it)
            if not local.is_file():
                raise FileNotFoundError(f"{self.object_uri(key)}: no such object in the store")
            return local
        stat = self.backend.stat(key)
        if stat is None:
            raise FileNotFoundError(f"{self.object_uri(key)}: no such object in the store")
        local = self.cache_dir / "objects" / stat["etag"] / key
        if not (local.is_file() and local.stat().st_size == stat["size"]):
            self.backend.get_file(key, local)
        if local.stat().st_size != stat["size"]:
            raise ArtifactError(f"{self.object_uri(key)}: downloaded {local.stat().st_size} bytes, expected "
                                f"{stat['size']} (changed while downloading? fetch it again)")
        return local
