"""Storage backends: the `Backend` protocol and its two implementations, a local folder (`FileBackend`)
and an S3 bucket prefix (`S3Backend`). Keys are `/`-separated paths under the store root."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from steps.lib.errors import ArtifactError
from steps.lib.files import files_under, temp_name, write_atomic
from steps.lib.store.ids import sha256_file

#: S3's limit for one PUT; objects put whole up to this size get their md5 as ETag.
SINGLE_PUT_MAX_BYTES = 5 * 1024**3
#: reads of one object whose body was cut off mid-stream before giving up.
READ_ATTEMPTS = 4


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
    def set_aside(self, key: str, expect: bytes, aside: str) -> bool: ...
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
        tmp = temp_name(dst)
        try:
            shutil.copyfile(local, tmp)
            os.replace(tmp, dst)
        except BaseException:
            tmp.unlink(missing_ok=True)        # a full disk mid-copy leaves no debris behind
            raise

    def put_bytes(self, key: str, data: bytes) -> None:
        write_atomic(self._p(key), data)

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
        return [str(p.relative_to(self.root)) for p in files_under(self._p(prefix)) if not p.name.startswith(".")]

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

    @contextmanager
    def _if_holding(self, key: str, expect: bytes) -> Iterator[Path | None]:
        """`key`'s path under its flock while it still holds `expect`, else None: the compare of the
        compare-and-swap that `swap_bytes` and `set_aside` share, so a lease is taken over by one writer only."""
        dst = self._p(key)
        if not dst.parent.is_dir():
            yield None
            return
        with open(dst.with_name(f".{dst.name}.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield dst if dst.is_file() and dst.read_bytes() == expect else None

    def swap_bytes(self, key: str, data: bytes | None, expect: bytes) -> bool:
        """Replace (or, with data None, delete) `key` only if it still holds `expect`."""
        with self._if_holding(key, expect) as dst:
            if dst is None:
                return False
            if data is None:
                dst.unlink()
            else:
                self.put_bytes(key, data)
            return True

    def set_aside(self, key: str, expect: bytes, aside: str) -> bool:
        """Rename `key` to `aside` only if it still holds `expect`: a compare-and-swap that writes no
        data, for a full disk (a rename needs no free blocks)."""
        with self._if_holding(key, expect) as dst:
            if dst is None:
                return False
            os.replace(dst, self._p(aside))
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

    def _read_object(self, key: str, consume: Any) -> Any:
        """`consume(body)` of the object, or None if absent. botocore retries a failed request but not a
        body cut off mid-read (a dropped connection, a proxy's truncated answer): read again, a few times."""
        from botocore.exceptions import ClientError, ConnectionClosedError, ReadTimeoutError, ResponseStreamingError

        for attempt in range(1, READ_ATTEMPTS + 1):
            try:
                body = self.client.get_object(Bucket=self.bucket, Key=self._k(key))["Body"]
                with body:
                    return consume(body)
            except ClientError as err:
                if err.response["Error"]["Code"] in ("NoSuchKey", "404", "NotFound"):
                    return None
                raise
            except (ResponseStreamingError, ConnectionClosedError, ReadTimeoutError):
                if attempt == READ_ATTEMPTS:
                    raise
        return None

    def get_bytes(self, key: str) -> bytes | None:
        return self._read_object(key, lambda body: body.read())

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
        return self._read_object(key, sha256_file)

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
