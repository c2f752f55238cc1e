"""Artifact ids and hashing: content addresses, the plain-name rule for kinds and ids, canonical JSON,
file checksums and the code version recorded in every manifest."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import subprocess
from pathlib import Path
from typing import Any, BinaryIO

CODE_VERSION = "0.1.0"
#: bumped when a change makes earlier artifacts of the same config wrong to reuse.
ID_SCHEMA = 1
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
