"""The artifact store: content-addressed artifacts with manifests, aliases and lineage.

Layout under the store root (a local folder for `file://`, a bucket prefix for `s3://`):

    staging/<kind>/<id>/lease.json             who is writing this artifact now (owner, heartbeat, TTL)
    staging/<kind>/<id>/<attempt>/<files>      that writer's files and `.partial/` upload records
    artifacts/<kind>/<id>/<data files>         put in place at commit, never written to before
    artifacts/<kind>/<id>/manifest.json        created last and only if absent: no manifest, no artifact
    quarantine/<kind>/<id>/<time>/             a committed artifact that failed verification
    aliases/<name>.json                        {"kind", "id", "previous", "updated"}

Commit protocol. One writer at a time holds an artifact's lease (created only if absent; taken
over by compare-and-swap once its heartbeat is older than its TTL or its process is gone); others
wait for it, then reuse what it committed. The holder stages under its own attempt prefix; commit
moves the files into `artifacts/<kind>/<id>/` (file://: one `rename` of the attempt folder, which
fails if another writer's folder is there; s3://: server-side copies) and creates the manifest
with an exclusive create (file: `os.link`; S3: `PUT If-None-Match: *`). A writer that finds a
manifest at commit verifies it and reuses it. A killed writer's attempt is resumed by the next one.

An artifact id is derived from what produced it (kind, config section, input ids), so the same
inputs give the same id and finished work is reused. Readers verify every file's size and sha256
against the manifest before use. Promotion moves aliases; nothing is overwritten by it.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol
from urllib.parse import urlparse

log = logging.getLogger("eaglenest.store")

CODE_VERSION = "0.1.0"
#: bumped when a change makes earlier artifacts of the same config wrong to reuse.
ID_SCHEMA = 1
MANIFEST = "manifest.json"
#: per-artifact folder of upload records that make early uploads visible to a resumed writer.
PARTIAL = ".partial"
#: S3's limit for one PUT; objects put whole up to this size get their md5 as ETag.
SINGLE_PUT_MAX_BYTES = 5 * 1024**3
LEASE = "lease.json"
#: seconds without a heartbeat after which a writer's lease may be taken over (EAGLENEST_LEASE_TTL).
LEASE_TTL_S = 120.0
#: what a kind or an id may look like: one path segment, never `.`, `..`, `/` or absolute. Step ids are
#: `artifact_id()`'s 16 hex; the wider set admits hand-named test fixtures, not paths.
SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
ARTIFACT_ID = re.compile(r"[0-9a-f]{16}")


class ArtifactError(RuntimeError):
    """An artifact is missing, incomplete or does not match its manifest."""


def sha256_file(src: str | Path | BinaryIO) -> str:
    """sha256 hex of a file, given its path or an open binary stream (read through in chunks, never whole)."""
    if not isinstance(src, (str, Path)):
        return hashlib.file_digest(src, "sha256").hexdigest()
    with open(src, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_ref(kind: str, art_id: str) -> None:
    """Refuse a kind or id that is not one plain path segment, so nothing outside the store is read."""
    for what, value in (("kind", kind), ("id", art_id)):
        if not isinstance(value, str) or not SEGMENT.fullmatch(value):
            raise ArtifactError(f"artifact {what} {value!r} is not a plain name (ids are 16 hex digits, e.g. "
                                f"{artifact_id('x', {})}); '..', '/' and absolute paths are refused")


def parse_artifact_id(text: str) -> str:
    """An artifact id as given on a command line: exactly 16 lowercase hex digits (argparse `type=`)."""
    if not ARTIFACT_ID.fullmatch(text):
        import argparse

        raise argparse.ArgumentTypeError(f"{text!r} is not an artifact id (16 hex digits, as printed by the step "
                                         "that made it)")
    return text


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def artifact_id(kind: str, config: Any, inputs: dict[str, str] | None = None) -> str:
    """Content address of an artifact: 16 hex of sha256(kind, id schema, config, inputs)."""
    if hasattr(config, "model_dump"):  # a pydantic section: hash its values, not its repr
        config = config.model_dump(mode="json")
    blob = canonical_json({"kind": kind, "schema": ID_SCHEMA, "config": config, "inputs": inputs or {}})
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def code_version() -> str:
    """Package version plus the git commit when run from a checkout."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return f"{CODE_VERSION}+g{sha}" if sha else CODE_VERSION


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def is_data_file(rel: str) -> bool:
    """True for an artifact's data files; false for the manifest, `.partial/` records and temp files."""
    parts = rel.split("/")
    return rel != MANIFEST and not any(part.startswith(".") for part in parts)


def _remove_empty_dirs(top: Path | None) -> None:
    """Remove `top` and its sub-folders if they hold no files (a local store's spent `.partial/`)."""
    if top is None or not top.is_dir():
        return
    for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        if not any(d.iterdir()):
            d.rmdir()
    if not any(top.iterdir()):
        top.rmdir()


# --- backends ---------------------------------------------------------------------------------------

class Backend(Protocol):
    def put_file(self, key: str, local: Path) -> None: ...
    def put_bytes(self, key: str, data: bytes) -> None: ...
    def get_file(self, key: str, local: Path) -> None: ...
    def get_bytes(self, key: str) -> bytes | None: ...
    def size(self, key: str) -> int | None: ...
    def list(self, prefix: str) -> list[str]: ...
    def delete(self, key: str) -> None: ...
    def local_path(self, key: str) -> Path | None: ...
    def stat(self, key: str) -> dict[str, Any] | None: ...
    def put_file_whole(self, key: str, local: Path) -> None: ...
    def sha256(self, key: str) -> str | None: ...
    def create_bytes(self, key: str, data: bytes) -> bool: ...
    def swap_bytes(self, key: str, data: bytes | None, expect: bytes) -> bool: ...
    def move_prefix(self, src: str, dst: str) -> bool: ...


def md5_file(path: str | Path) -> str:
    """The S3 ETag of a single-part upload of this file, so a local store reports the same versions."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, lambda: hashlib.md5(usedforsecurity=False)).hexdigest()


class FileBackend:
    """A folder on a local or mounted filesystem. Writes go through a temp file + rename."""

    def __init__(self, root: Path):
        self.root = root.resolve()

    def _p(self, key: str) -> Path:
        return self.root / key

    def put_file(self, key: str, local: Path) -> None:
        dst = self._p(key)
        if Path(local).resolve() == dst:
            return
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
        shutil.copyfile(local, tmp)
        os.replace(tmp, dst)

    def put_bytes(self, key: str, data: bytes) -> None:
        dst = self._p(key)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, dst)

    def get_file(self, key: str, local: Path) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self._p(key), local)

    def get_bytes(self, key: str) -> bytes | None:
        p = self._p(key)
        return p.read_bytes() if p.is_file() else None

    def size(self, key: str) -> int | None:
        p = self._p(key)
        return p.stat().st_size if p.is_file() else None

    def list(self, prefix: str) -> list[str]:
        base = self._p(prefix)
        if not base.exists():
            return []
        return sorted(str(p.relative_to(self.root)) for p in base.rglob("*")
                      if p.is_file() and not p.name.startswith("."))

    def delete(self, key: str) -> None:
        self._p(key).unlink(missing_ok=True)

    def local_path(self, key: str) -> Path | None:
        return self._p(key)

    def stat(self, key: str) -> dict[str, Any] | None:
        """Size and content version (md5 hex, as S3's ETag of a single-part upload), or None if absent."""
        p = self._p(key)
        return {"size": p.stat().st_size, "etag": md5_file(p)} if p.is_file() else None

    def put_file_whole(self, key: str, local: Path) -> None:
        self.put_file(key, local)

    def sha256(self, key: str) -> str | None:
        """sha256 hex of the stored file, or None if it is absent."""
        p = self._p(key)
        return sha256_file(p) if p.is_file() else None

    def create_bytes(self, key: str, data: bytes) -> bool:
        """Create `key` holding `data` unless it exists; False if it did. The bytes are complete in a temp
        file first and `os.link` publishes them: it fails when the name exists, so two creators never
        both win and a reader never sees half a file."""
        dst = self._p(key)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.tmp-{uuid.uuid4().hex}")
        tmp.write_bytes(data)
        try:
            os.link(tmp, dst)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink()

    def swap_bytes(self, key: str, data: bytes | None, expect: bytes) -> bool:
        """Replace (or, with data None, delete) `key` only if it still holds `expect`: compare-and-swap
        under an flock, so a lease is taken over by one writer only."""
        dst = self._p(key)
        if not dst.parent.is_dir():
            return False
        with open(dst.with_name(f".{dst.name}.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not dst.is_file() or dst.read_bytes() != expect:
                return False
            if data is None:
                dst.unlink()
            else:
                self.put_bytes(key, data)
            return True

    def move_prefix(self, src: str, dst: str) -> bool:
        """Rename folder `src` to `dst` in one step; False if `dst` exists and is not empty (another
        writer's folder is there) or `src` is gone."""
        target = self._p(dst)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(self._p(src), target)
            return True
        except FileNotFoundError:
            return False
        except OSError as err:
            if err.errno in (39, 17):  # ENOTEMPTY, EEXIST
                return False
            raise


class S3Backend:
    """An S3 bucket prefix through boto3; `endpoint_url` points at MinIO or any S3-compatible store.

    Credentials come from the usual boto3 chain (environment, profile); they are never written
    into manifests or logs.
    """

    def __init__(self, bucket: str, prefix: str, endpoint_url: str | None = None):
        import boto3

        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.endpoint_url = endpoint_url
        self.client = boto3.client("s3", endpoint_url=endpoint_url)
        self._bucket_seen = False

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put_file(self, key: str, local: Path) -> None:
        self.client.upload_file(str(local), self.bucket, self._k(key))

    def put_bytes(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._k(key), Body=data)

    def get_file(self, key: str, local: Path) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        from botocore.exceptions import ClientError

        tmp = local.with_name(f".{local.name}.part")
        try:
            self.client.download_file(self.bucket, self._k(key), str(tmp))
        except ClientError as err:
            tmp.unlink(missing_ok=True)
            if err.response["Error"]["Code"] in ("NoSuchKey", "404", "NotFound"):
                raise FileNotFoundError(f"s3://{self.bucket}/{self._k(key)}") from err
            raise
        os.replace(tmp, local)

    def get_bytes(self, key: str) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._k(key))["Body"].read()
        except ClientError as err:
            if err.response["Error"]["Code"] in ("NoSuchKey", "404"):
                return None
            raise

    def size(self, key: str) -> int | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.head_object(Bucket=self.bucket, Key=self._k(key))["ContentLength"]
        except ClientError as err:
            if err.response["Error"]["Code"] in ("NoSuchKey", "404", "NotFound"):
                self._check_bucket()
                return None
            raise

    def _check_bucket(self) -> None:
        """A HEAD 404 does not say whether the key or the bucket is missing: ask once, so a typo'd
        bucket is an error and not an empty store whose steps all start from scratch."""
        if self._bucket_seen:
            return
        from botocore.exceptions import ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as err:
            if err.response["Error"]["Code"] in ("NoSuchBucket", "404", "NotFound"):
                raise ArtifactError(f"s3://{self.bucket}: no such bucket at "
                                    f"{self.endpoint_url or 'the default AWS endpoint'}; create it or fix "
                                    "the store URI") from None
            raise
        self._bucket_seen = True

    def list(self, prefix: str) -> list[str]:
        out: list[str] = []
        strip = len(self.prefix) + 1 if self.prefix else 0
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                          Prefix=self._k(prefix)):
            out += [o["Key"][strip:] for o in page.get("Contents", [])]
        return sorted(out)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._k(key))

    def local_path(self, key: str) -> Path | None:
        return None

    def stat(self, key: str) -> dict[str, Any] | None:
        """Size and ETag (quotes stripped) from HEAD, or None if the object is absent."""
        from botocore.exceptions import ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._k(key))
        except ClientError as err:
            if err.response["Error"]["Code"] in ("NoSuchKey", "404", "NotFound"):
                self._check_bucket()
                return None
            raise
        return {"size": head["ContentLength"], "etag": head["ETag"].strip('"')}

    def put_file_whole(self, key: str, local: Path) -> None:
        """Upload in one PUT (up to S3's 5 GB limit), so the ETag is the file's md5: a multipart
        upload's ETag (`<md5 of md5s>-<parts>`) would differ from the md5 a file store computes,
        and the same bytes would look like a new dataset version."""
        from boto3.s3.transfer import TransferConfig

        single = TransferConfig(multipart_threshold=SINGLE_PUT_MAX_BYTES)
        self.client.upload_file(str(local), self.bucket, self._k(key), Config=single)

    def sha256(self, key: str) -> str | None:
        """sha256 hex of the object as the bucket serves it now (streamed through, not cached), or None if absent."""
        from botocore.exceptions import ClientError

        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._k(key))["Body"]
        except ClientError as err:
            if err.response["Error"]["Code"] in ("NoSuchKey", "404", "NotFound"):
                return None
            raise
        with body:
            return sha256_file(body)

    def create_bytes(self, key: str, data: bytes) -> bool:
        """PUT with `If-None-Match: *`: S3 (and moto 5.2.5, checked) answer 412 when the key exists."""
        from botocore.exceptions import ClientError

        try:
            self.client.put_object(Bucket=self.bucket, Key=self._k(key), Body=data, IfNoneMatch="*")
            return True
        except ClientError as err:
            if err.response["Error"]["Code"] in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                return False
            raise

    def swap_bytes(self, key: str, data: bytes | None, expect: bytes) -> bool:
        """Replace or delete `key` only if its ETag is still the md5 of `expect` (`If-Match`, honoured
        by S3 and moto for PUT and DELETE)."""
        from botocore.exceptions import ClientError

        etag = f'"{hashlib.md5(expect, usedforsecurity=False).hexdigest()}"'
        try:
            if data is None:
                self.client.delete_object(Bucket=self.bucket, Key=self._k(key), IfMatch=etag)
            else:
                self.client.put_object(Bucket=self.bucket, Key=self._k(key), Body=data, IfMatch=etag)
            return True
        except ClientError as err:
            if err.response["Error"]["Code"] in ("PreconditionFailed", "412", "NoSuchKey", "404",
                                                 "ConditionalRequestConflict"):
                return False
            raise

    def move_prefix(self, src: str, dst: str) -> bool:
        """Server-side copy of every object under `src` to `dst`, then delete the sources (S3 has no rename;
        callers hold the artifact's lease, so no one else writes `dst` meanwhile)."""
        keys = self.list(src)
        for k in keys:
            self.client.copy({"Bucket": self.bucket, "Key": self._k(k)}, self.bucket,
                             self._k(dst + k[len(src):]))
        for k in keys:
            self.delete(k)
        return bool(keys)


# --- manifests --------------------------------------------------------------------------------------

@dataclass
class Manifest:
    kind: str
    id: str
    step: str
    inputs: dict[str, str] = field(default_factory=dict)
    config_hash: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    files: list[dict[str, Any]] = field(default_factory=list)
    created: str = ""
    code_version: str = ""

    def checksum(self) -> str:
        """sha256 of the canonical JSON of every field: what `manifest_sha256` holds."""
        return hashlib.sha256(canonical_json(self.__dict__).encode()).hexdigest()

    def to_json(self) -> str:
        """The stored form, with `manifest_sha256` over the rest, so an edited manifest is caught."""
        return json.dumps({**self.__dict__, "manifest_sha256": self.checksum()}, indent=2, sort_keys=True,
                          default=str)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse a manifest; unknown keys are ignored (newer writers), missing required ones raise."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ArtifactError(f"manifest is not valid JSON: {err}") from None
        if not isinstance(data, dict):
            raise ArtifactError(f"manifest must be a JSON object, got {type(data).__name__}")
        values: dict[str, Any] = {}
        for name, f in cls.__dataclass_fields__.items():
            if name in data:
                values[name] = data[name]
            elif f.default is not MISSING:
                values[name] = f.default
            elif f.default_factory is not MISSING:
                values[name] = f.default_factory()
            else:
                raise ArtifactError(f"manifest has no {name!r} field (expected {sorted(cls.__dataclass_fields__)})")
        m = cls(**values)
        # A manifest from before manifests carried checksums is read as it is (its files are still checked
        # by size on reuse and by sha256 on read); quarantining it would recompute a store's every artifact.
        if "manifest_sha256" in data and data["manifest_sha256"] != m.checksum():
            raise ArtifactError("manifest_sha256 does not match the manifest's content (edited by hand?)")
        return m

    def file(self, path: str) -> dict[str, Any]:
        for f in self.files:
            if f["path"] == path:
                return f
        raise ArtifactError(f"artifact {self.kind}/{self.id} has no file {path!r}")

    @property
    def total_bytes(self) -> int:
        return sum(int(f["size"]) for f in self.files)


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
    and a later writer that takes the lease over resumes from them (`store.partial_files(...)`).
    `reused` is set when another writer committed the artifact while this one waited for the lease:
    callers return it instead of recomputing, and `commit()` hands it back.
    """

    def __init__(self, store: Store, manifest: Manifest, staging: Path, attempt: str, *,
                 lease: bytes | None = None, reused: Manifest | None = None):
        self.store, self.manifest, self.staging, self.attempt = store, manifest, staging, attempt
        self.reused, self._lease, self.lost = reused, lease, False
        self._uploaded: dict[str, dict[str, Any]] = {}
        if reused is None:
            self.reload()
        self._stop = threading.Event()
        if lease is not None:
            ttl = float(json.loads(lease)["ttl"])
            threading.Thread(target=_heartbeat, args=(weakref.ref(self), self._stop, ttl / 4),
                             daemon=True, name=f"lease-{manifest.id}").start()
            weakref.finalize(self, self._stop.set)

    def reload(self) -> None:
        """Pick up the upload records of the attempt, including those other ranks of the job wrote."""
        for rec in self.store.partial_files(self.manifest.kind, self.manifest.id, self.attempt):
            self._uploaded[rec["path"]] = rec

    @property
    def key(self) -> str:
        """The attempt's staging prefix in the store (never the artifact's final folder)."""
        return f"{self.store.staging_key(self.manifest.kind, self.manifest.id)}/{self.attempt}"

    def renew(self) -> bool:
        """Refresh the lease's heartbeat; False (and `lost`) if another writer took it over."""
        if self._lease is None:
            return True
        new = json.dumps({**json.loads(self._lease), "heartbeat": time.time()}).encode()
        if self.store.backend.swap_bytes(self.store.lease_key(self.manifest.kind, self.manifest.id), new, self._lease):
            self._lease = new
            return True
        self.lost = True
        return False

    def _check_lease(self) -> None:
        if self.lost:
            raise ArtifactError(f"{self.store.artifact_uri(self.manifest.kind, self.manifest.id)}: this writer's "
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
        self.store.backend.put_file(f"{self.key}/{rel}", local)
        landed = self.store.backend.size(f"{self.key}/{rel}")
        if landed != size:
            raise ArtifactError(f"upload of {self.key}/{rel}: {landed} bytes landed, expected {size}")
        rec = {"path": rel, "size": size, "sha256": digest, **(extra or {})}
        # A sidecar makes the upload visible to a resumed run before the manifest exists.
        self.store.backend.put_bytes(f"{self.key}/{PARTIAL}/{rel}.json", json.dumps(rec).encode())
        self._uploaded[rel] = rec
        if delete_local and self.store.backend.local_path(f"{self.key}/{rel}") != local.resolve():
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
        backend, final = self.store.backend, self.store.key(kind, art_id)
        if self.store.exists(kind, art_id):          # another writer finished first: reuse, drop ours
            self.discard()
            return self.store.manifest(kind, art_id)
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
                if self.store.exists(kind, art_id):
                    self.discard()
                    return self.store.manifest(kind, art_id)
                self.store.quarantine(kind, art_id, "an unfinished folder without a valid manifest")
        else:
            backend.move_prefix(f"{self.key}/", f"{final}/")
            if not backend.create_bytes(f"{final}/{MANIFEST}", m.to_json().encode()):
                self.discard()
                return self.store.manifest(kind, art_id)
        self.discard()
        return self.store.manifest(kind, art_id)

    def discard(self) -> None:
        """Drop this attempt's staging (store and local) and release the lease."""
        backend = self.store.backend
        for k in backend.list(f"{self.key}/"):
            backend.delete(k)
        local = backend.local_path(self.key)
        if local is not None:
            shutil.rmtree(local, ignore_errors=True)
        if self.staging != local:
            shutil.rmtree(self.staging, ignore_errors=True)
        self._stop.set()
        if self._lease is not None and not self.lost:
            backend.swap_bytes(self.store.lease_key(self.manifest.kind, self.manifest.id), None, self._lease)
            self._lease = None
        _remove_empty_dirs(backend.local_path(self.store.staging_key(self.manifest.kind, self.manifest.id)))


class Store:
    """Artifacts and aliases over a file or S3 backend, plus a local cache for remote reads."""

    def __init__(self, uri: str, backend: Backend, cache_dir: Path):
        self.uri, self.backend, self.cache_dir = uri, backend, cache_dir

    # ids and keys
    @staticmethod
    def key(kind: str, art_id: str) -> str:
        check_ref(kind, art_id)
        return f"artifacts/{kind}/{art_id}"

    @staticmethod
    def staging_key(kind: str, art_id: str) -> str:
        check_ref(kind, art_id)
        return f"staging/{kind}/{art_id}"

    def lease_key(self, kind: str, art_id: str) -> str:
        return f"{self.staging_key(kind, art_id)}/{LEASE}"

    def artifact_uri(self, kind: str, art_id: str) -> str:
        return f"{self.uri.rstrip('/')}/{self.key(kind, art_id)}"

    # reading
    def exists(self, kind: str, art_id: str) -> bool:
        """True for a committed artifact whose manifest checks out and whose files have their sizes (the
        reuse check of every step). A broken one is quarantined, so the step that asked recomputes it;
        reading its files still verifies their sha256."""
        if self.backend.size(f"{self.key(kind, art_id)}/{MANIFEST}") is None:
            return False
        try:
            m = self.manifest(kind, art_id)
            for rec in m.files:
                size = self.backend.size(f"{self.key(kind, art_id)}/{rec['path']}")
                if size != rec["size"]:
                    raise ArtifactError(f"{self.artifact_uri(kind, art_id)}/{rec['path']}: size {size} != "
                                        f"manifest {rec['size']}")
        except ArtifactError as err:
            self.quarantine(kind, art_id, str(err))
            return False
        return True

    def quarantine(self, kind: str, art_id: str, reason: str) -> str:
        """Move a broken artifact folder aside to `quarantine/<kind>/<id>/<time>/` (kept for inspection,
        out of every reader's way) and log one line; returns where it went."""
        dst = f"quarantine/{kind}/{art_id}/{dt.datetime.now(dt.UTC).strftime('%Y%m%dT%H%M%S%fZ')}"
        if self.backend.local_path(dst) is not None:
            self.backend.move_prefix(self.key(kind, art_id), dst)
        else:
            self.backend.move_prefix(f"{self.key(kind, art_id)}/", f"{dst}/")
        log.warning("store: quarantined %s to %s: %s; the step that makes it will recompute it",
                    self.artifact_uri(kind, art_id), self.object_uri(dst), reason.replace("\n", " "))
        return dst

    def manifest(self, kind: str, art_id: str) -> Manifest:
        where = f"{self.artifact_uri(kind, art_id)}/{MANIFEST}"
        raw = self.backend.get_bytes(f"{self.key(kind, art_id)}/{MANIFEST}")
        if raw is None:
            raise ArtifactError(f"no artifact {kind}/{art_id} in {self.uri} (no manifest: missing "
                                "or not finished; re-run the step that makes it)")
        try:
            m = Manifest.from_json(raw.decode())
        except (ArtifactError, UnicodeDecodeError) as err:
            raise ArtifactError(f"{where}: {err} (corrupt; re-run the step that makes it: it quarantines "
                                "this artifact and rebuilds it)") from None
        if (m.kind, m.id) != (kind, art_id):
            raise ArtifactError(f"{where}: holds {m.kind}/{m.id}, not {kind}/{art_id} (moved by hand?); re-run "
                                "the step that makes it")
        return m

    def list(self, kind: str) -> list[str]:
        keys = (k.split("/") for k in self.backend.list(f"artifacts/{kind}/"))
        return sorted({parts[2] for parts in keys if len(parts) == 4 and parts[3] == MANIFEST})

    def partial_files(self, kind: str, art_id: str, attempt: str | None = None) -> list[dict[str, Any]]:
        """Files uploaded by an unfinished attempt at this artifact (default: the one its lease names)."""
        if attempt is None:
            raw = self.backend.get_bytes(self.lease_key(kind, art_id))
            if raw is None:
                return []
            attempt = json.loads(raw)["attempt"]
        base = f"{self.staging_key(kind, art_id)}/{attempt}"
        out = []
        for k in self.backend.list(f"{base}/{PARTIAL}/"):
            raw = self.backend.get_bytes(k)
            if raw:
                rec = json.loads(raw)
                if self.backend.size(f"{base}/{rec['path']}") == rec["size"]:
                    out.append(rec)
        return out

    def fetch_file(self, kind: str, art_id: str, rel: str, manifest: Manifest | None = None,
                   *, verify: bool = True) -> Path:
        """A verified local path to one file of an artifact (downloaded to the cache if remote)."""
        m = manifest or self.manifest(kind, art_id)
        rec = m.file(rel)
        key = f"{self.key(kind, art_id)}/{rel}"
        local = self.backend.local_path(key)
        if local is not None:
            self._check_file(local, rec, f"{self.artifact_uri(kind, art_id)}/{rel}", verify)
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
        self._check_file(local, rec, f"{self.artifact_uri(kind, art_id)}/{rel}", verify)
        return local

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
        from steps.config import config_dict, section_hash

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
        return ArtifactWriter(self, m, staging, attempt, lease=lease, reused=reused)

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
        self.backend.put_bytes(f"aliases/{name}.json", json.dumps(rec, indent=2).encode())
        return rec

    def get_alias(self, name: str) -> dict[str, Any] | None:
        raw = self.backend.get_bytes(f"aliases/{name}.json")
        return json.loads(raw) if raw else None

    def restore_alias(self, name: str, record: dict[str, Any] | None) -> None:
        """Put back an alias record exactly as `get_alias` returned it (None: the alias did not exist)."""
        if record is None:
            self.backend.delete(f"aliases/{name}.json")
        else:
            self.backend.put_bytes(f"aliases/{name}.json", json.dumps(record, indent=2).encode())

    # plain objects: uploaded inputs such as `datasets/<name>/<file>`, versioned by ETag, no manifest
    def object_uri(self, key: str) -> str:
        return f"{self.uri.rstrip('/')}/{key}"

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



def store_uri_for(explicit: str | None, configured: str) -> str:
    """The store a run uses: an explicit URI, else $EAGLENEST_STORE (set by workers and containers), else
    the config's `store`. One rule for every CLI, flow and worker."""
    return explicit or os.environ.get("EAGLENEST_STORE") or configured


def default_cache_dir(store_key: str) -> Path:
    """`<tmp>/eaglenest-cache/<store>`: scratch (extraction rounds, serve logs, downloads) of one store.

    Keyed by the store, so two stores on one machine (`make demo` in two clones, the tests beside a
    demo) never meet in each other's scratch; EAGLENEST_CACHE (or `cache_dir`) overrides it."""
    digest = hashlib.sha256(store_key.encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / "eaglenest-cache" / digest


def open_store(uri: str | None = None, *, cache_dir: str | Path | None = None,
               endpoint_url: str | None = None) -> Store:
    """`file://path` (relative or absolute) or `s3://bucket/prefix`; env EAGLENEST_STORE as default."""
    uri = uri or os.environ.get("EAGLENEST_STORE") or "file://out/store"
    explicit_cache = cache_dir or os.environ.get("EAGLENEST_CACHE")
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        # file://out/store parses as host "out" + path "/store": a relative folder. file://localhost/x
        # is the RFC 8089 spelling of the absolute file:///x.
        netloc = "" if parsed.netloc == "localhost" else parsed.netloc
        root_text = netloc + parsed.path
        if not root_text:
            raise ValueError(f"store URI {uri!r}: file:// needs a folder (file://out/store or file:///abs/path)")
        root = Path(root_text)
        root.mkdir(parents=True, exist_ok=True)
        resolved = f"file://{root.resolve()}"
        return Store(resolved, FileBackend(root), Path(explicit_cache or default_cache_dir(resolved)))
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"store URI {uri!r}: s3:// needs a bucket (s3://bucket/prefix)")
        endpoint = endpoint_url or os.environ.get("EAGLENEST_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")
        return Store(uri.rstrip("/"), S3Backend(parsed.netloc, parsed.path, endpoint),
                     Path(explicit_cache or default_cache_dir(f"{endpoint or ''}|{uri.rstrip('/')}")))
    raise ValueError(f"store URI {uri!r}: expected file://PATH or s3://BUCKET/PREFIX")


class LocalCache:
    """A bounded LRU of local copies of remote files (training reads shards through it)."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self._entries: OrderedDict[Path, int] = OrderedDict()
        self.peak_bytes = 0

    @property
    def used_bytes(self) -> int:
        return sum(self._entries.values())

    def admit(self, path: Path, size: int, *, owned: bool) -> None:
        """Record a file now held locally; evict least recently used owned copies to fit."""
        if path in self._entries:
            self._entries.move_to_end(path)
            return
        while self._entries and self.used_bytes + size > self.budget:
            old, _ = self._entries.popitem(last=False)
            old.unlink(missing_ok=True)
        if owned:
            self._entries[path] = size
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def iter_paths(self) -> Iterator[Path]:
        return iter(self._entries)
