"""Artifact ids and hashing: content addresses, the plain-name rule for kinds and ids, canonical JSON,
file checksums and the code version recorded in every manifest."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

from steps.lib.errors import ArtifactError

CODE_VERSION = "0.1.0"
#: bumped when a change makes earlier artifacts of the same config wrong to reuse.
ID_SCHEMA = 1
#: what a kind or an id may look like: one path segment, never `.`, `..`, `/` or absolute. Step ids are
#: `artifact_id()`'s 16 hex; the wider set admits hand-named test fixtures, not paths.
SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
ARTIFACT_ID = re.compile(r"[0-9a-f]{16}")


def sha256_file(src: str | Path | BinaryIO) -> str:
    """sha256 hex of a file, given its path or an open binary stream (read through in chunks, never whole)."""
    if not isinstance(src, (str, Path)):
        return hashlib.file_digest(src, "sha256").hexdigest()
    with open(src, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _content_cache() -> Path:
    """The one file of remembered hashes, shared by every store on the machine (a model directory is no
    store's): `$EAGLENEST_CACHE/sha256-cache.jsonl`, else under the temp folder."""
    root = os.environ.get("EAGLENEST_CACHE") or Path(tempfile.gettempdir()) / "eaglenest-cache"
    return Path(root) / "sha256-cache.jsonl"


def content_sha256(path: str | Path) -> str:
    """sha256 of a file outside the store (an `hf_dir` model's weights, a local dataset file), remembered
    by (path, size, mtime_ns): a 16 GB model is read once, and every later id costs one `stat`. Writing
    the file changes its mtime, so a changed file is hashed again."""
    p = Path(path).resolve()
    st = p.stat()
    key = [str(p), st.st_size, st.st_mtime_ns]
    cache = _content_cache()
    try:
        for line in cache.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("key") == key:
                return str(rec["sha256"])
    except (OSError, ValueError, AttributeError):
        pass  # no cache yet, or a torn line from a killed writer: hash again
    digest = sha256_file(p)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        with open(cache, "a") as f:     # one short line per O_APPEND write: concurrent writers do not tear it
            f.write(json.dumps({"key": key, "sha256": digest}) + "\n")
    except OSError:
        pass  # a read-only cache only costs the next run a re-hash
    return digest


def check_ref(kind: str, art_id: str) -> None:
    """Refuse a kind or id that is not one plain path segment, so nothing outside the store is read."""
    for what, value in (("kind", kind), ("id", art_id)):
        if not isinstance(value, str) or not SEGMENT.fullmatch(value):
            raise ArtifactError(f"artifact {what} {value!r} is not a plain name (ids are 16 hex digits, e.g. "
                                f"{artifact_id('x', {})}); '..', '/' and absolute paths are refused")


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
