"""The artifact store: content-addressed artifacts with manifests, aliases and lineage.

Layout under the store root (a local folder for `file://`, a bucket prefix for `s3://`):

    artifacts/<kind>/<id>/<data files>     written first
    artifacts/<kind>/<id>/manifest.json    written last: no manifest, no artifact
    aliases/<name>.json                    {"kind", "id", "previous", "updated"}

An artifact id is derived from what produced it (kind, config section, input ids), so the same
inputs give the same id and finished work is reused. Readers verify every file's size and sha256
against the manifest before use. Promotion moves aliases; nothing is overwritten by it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol
from urllib.parse import urlparse

CODE_VERSION = "0.1.0"
#: bumped when a change makes earlier artifacts of the same config wrong to reuse.
ID_SCHEMA = 1
MANIFEST = "manifest.json"
#: per-artifact folder of upload records that make early uploads visible to a resumed writer.
PARTIAL = ".partial"
#: S3's limit for one PUT; objects put whole up to this size get their md5 as ETag.
SINGLE_PUT_MAX_BYTES = 5 * 1024**3


class ArtifactError(RuntimeError):
    """An artifact is missing, incomplete or does not match its manifest."""


def sha256_file(src: str | Path | BinaryIO) -> str:
    """sha256 hex of a file, given its path or an open binary stream (read through in chunks, never whole)."""
    if not isinstance(src, (str, Path)):
        return hashlib.file_digest(src, "sha256").hexdigest()
    with open(src, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=2, sort_keys=True, default=str)

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
        return cls(**values)

    def file(self, path: str) -> dict[str, Any]:
        for f in self.files:
            if f["path"] == path:
                return f
        raise ArtifactError(f"artifact {self.kind}/{self.id} has no file {path!r}")

    @property
    def total_bytes(self) -> int:
        return sum(int(f["size"]) for f in self.files)


class ArtifactWriter:
    """Stages files for one artifact; `commit()` uploads what is left and writes the manifest last.

    Files can be committed early with `upload(path)` (extraction uploads each shard as soon as it
    is written, then deletes the local copy): they are recorded with size and sha256 and are
    visible to a resumed run through `store.partial_files(...)`.
    """

    def __init__(self, store: Store, manifest: Manifest, staging: Path):
        self.store, self.manifest, self.staging = store, manifest, staging
        self._uploaded: dict[str, dict[str, Any]] = {}
        for rec in store.partial_files(manifest.kind, manifest.id):
            self._uploaded[rec["path"]] = rec

    @property
    def key(self) -> str:
        return self.store.key(self.manifest.kind, self.manifest.id)

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
        """Upload remaining staged files, then write the manifest (last)."""
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
        self.store.backend.put_bytes(f"{self.key}/{MANIFEST}", m.to_json().encode())
        for rel in list(self._uploaded):
            self.store.backend.delete(f"{self.key}/{PARTIAL}/{rel}.json")
        _remove_empty_dirs(self.store.backend.local_path(f"{self.key}/{PARTIAL}"))
        return m


class Store:
    """Artifacts and aliases over a file or S3 backend, plus a local cache for remote reads."""

    def __init__(self, uri: str, backend: Backend, cache_dir: Path):
        self.uri, self.backend, self.cache_dir = uri, backend, cache_dir

    # ids and keys
    @staticmethod
    def key(kind: str, art_id: str) -> str:
        return f"artifacts/{kind}/{art_id}"

    def artifact_uri(self, kind: str, art_id: str) -> str:
        return f"{self.uri.rstrip('/')}/{self.key(kind, art_id)}"

    # reading
    def exists(self, kind: str, art_id: str) -> bool:
        return self.backend.size(f"{self.key(kind, art_id)}/{MANIFEST}") is not None

    def manifest(self, kind: str, art_id: str) -> Manifest:
        raw = self.backend.get_bytes(f"{self.key(kind, art_id)}/{MANIFEST}")
        if raw is None:
            raise ArtifactError(f"no artifact {kind}/{art_id} in {self.uri} (no manifest: missing "
                                "or not finished; re-run the step that makes it)")
        try:
            return Manifest.from_json(raw.decode())
        except (ArtifactError, UnicodeDecodeError) as err:
            raise ArtifactError(f"{self.artifact_uri(kind, art_id)}/{MANIFEST}: {err} (corrupt; re-run the "
                                "step that makes it)") from None

    def list(self, kind: str) -> list[str]:
        keys = (k.split("/") for k in self.backend.list(f"artifacts/{kind}/"))
        return sorted({parts[2] for parts in keys if len(parts) == 4 and parts[3] == MANIFEST})

    def partial_files(self, kind: str, art_id: str) -> list[dict[str, Any]]:
        """Files uploaded by an unfinished run of this artifact (for resume)."""
        prefix = f"{self.key(kind, art_id)}/{PARTIAL}/"
        out = []
        for k in self.backend.list(prefix):
            raw = self.backend.get_bytes(k)
            if raw:
                rec = json.loads(raw)
                if self.backend.size(f"{self.key(kind, art_id)}/{rec['path']}") == rec["size"]:
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
              config: Any = None, staging: Path | None = None) -> ArtifactWriter:
        """Start (or resume) writing an artifact.

        Files are staged in `staging` when given (extraction stages shards in a scratch folder so
        its disk budget is measured the same way for every backend), else beside the store
        (file://) or in the cache (s3://).
        """
        from steps.config import config_dict, section_hash

        cfg = config_dict(config) if config is not None else {}
        m = Manifest(kind=kind, id=art_id, step=step, inputs=dict(inputs or {}),
                     config_hash=section_hash(cfg) if cfg else "", config=cfg)
        if staging is None:
            local = self.backend.local_path(self.key(kind, art_id))
            staging = local if local is not None else self.cache_dir / "staging" / kind / art_id
        staging.mkdir(parents=True, exist_ok=True)
        return ArtifactWriter(self, m, staging)

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
