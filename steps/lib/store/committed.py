"""Committed artifacts as a backend holds them: the manifest read back and checked, the reuse check, the
quarantine of a broken folder, and the upload records of an unfinished attempt. Functions of (backend, store
root), so that `Store` and `ArtifactWriter` both build on them and neither calls the other back."""

from __future__ import annotations

import datetime as dt
import json
import logging
from typing import Any

from steps.lib.errors import ArtifactError
from steps.lib.store.backends import Backend
from steps.lib.store.keys import PARTIAL, artifact_key, attempt_key, lease_key, uri_of
from steps.lib.store.manifest import MANIFEST, Manifest

log = logging.getLogger("eaglenest.store")


def read_manifest(backend: Backend, root: str, kind: str, art_id: str) -> Manifest:
    """The manifest of a committed artifact, checked to name itself; ArtifactError with the fix otherwise."""
    key = artifact_key(kind, art_id)
    where = uri_of(root, f"{key}/{MANIFEST}")
    raw = backend.get_bytes(f"{key}/{MANIFEST}")
    if raw is None:
        raise ArtifactError(f"no artifact {kind}/{art_id} in {root} (no manifest: missing "
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


def is_committed(backend: Backend, root: str, kind: str, art_id: str) -> bool:
    """True for a committed artifact whose manifest checks out and whose files have their sizes (the
    reuse check of every step). A broken one is quarantined, so the step that asked recomputes it;
    reading its files still verifies their sha256."""
    key = artifact_key(kind, art_id)
    if backend.size(f"{key}/{MANIFEST}") is None:
        return False
    try:
        m = read_manifest(backend, root, kind, art_id)
        for rec in m.files:
            size = backend.size(f"{key}/{rec['path']}")
            if size != rec["size"]:
                raise ArtifactError(f"{uri_of(root, key)}/{rec['path']}: size {size} != manifest {rec['size']}")
    except ArtifactError as err:
        quarantine(backend, root, kind, art_id, str(err))
        return False
    return True


def quarantine(backend: Backend, root: str, kind: str, art_id: str, reason: str) -> str:
    """Move a broken artifact folder aside to `quarantine/<kind>/<id>/<time>/` (kept for inspection,
    out of every reader's way) and log one line; returns where it went."""
    key = artifact_key(kind, art_id)
    dst = f"quarantine/{kind}/{art_id}/{dt.datetime.now(dt.UTC).strftime('%Y%m%dT%H%M%S%fZ')}"
    if backend.local_path(dst) is not None:
        backend.move_prefix(key, dst)
    else:
        backend.move_prefix(f"{key}/", f"{dst}/")
    log.warning("store: quarantined %s to %s: %s; the step that makes it will recompute it",
                uri_of(root, key), uri_of(root, dst), reason.replace("\n", " "))
    return dst


def partial_files(backend: Backend, kind: str, art_id: str, attempt: str | None = None) -> list[dict[str, Any]]:
    """Files uploaded by an unfinished attempt at this artifact (default: the one its lease names)."""
    if attempt is None:
        raw = backend.get_bytes(lease_key(kind, art_id))
        if raw is None:
            return []
        attempt = json.loads(raw)["attempt"]
    base = attempt_key(kind, art_id, attempt)
    out = []
    for k in backend.list(f"{base}/{PARTIAL}/"):
        raw = backend.get_bytes(k)
        if raw:
            rec = json.loads(raw)
            if backend.size(f"{base}/{rec['path']}") == rec["size"]:
                out.append(rec)
    return out
