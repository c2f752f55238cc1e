"""Store maintenance, what `eaglenest store verify` and `eaglenest store gc` run (flows/cli.py).

- `verify_all`: every committed artifact (or one kind, or one id) hashed in full against its manifest
  (`Store.verify`: size, then sha256 of the stored bytes): one record per artifact, nothing changed.
- `collect_garbage`: staging the commit protocol no longer needs. An artifact's staging folder holds its
  lease and its writers' attempts (`staging/<kind>/<id>/{lease.json,<attempt>/...}`); gc removes
  * everything under it once the artifact is committed (debris of writers that lost the race),
  * attempts that the lease does not name (no writer can resume them),
  * an expired lease (`lease_is_dead`: no heartbeat for longer than its TTL, or its process gone) together
    with its attempt: the resumable work of a dead writer is given up, so the next run recomputes it.
    gc takes the dead lease over first (the same compare-and-swap a resuming writer uses) and releases it
    after, so a writer starting meanwhile waits instead of resuming files that are being deleted.
  A live writer's lease and attempt are never touched.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from steps.lib.errors import ArtifactError
from steps.lib.store.ids import ARTIFACT_ID, SEGMENT
from steps.lib.store.keys import LEASE
from steps.lib.store.store import Store
from steps.lib.store.writer import LEASE_TTL_S, _remove_empty_dirs, lease_is_dead


def artifact_refs(store: Store, kind: str | None = None, art_id: str | None = None) -> list[tuple[str, str]]:
    """(kind, id) of every committed artifact, of one kind, or the one asked for (refused unless 16 hex)."""
    if art_id is not None and not ARTIFACT_ID.fullmatch(art_id):
        raise ArtifactError(f"--id {art_id!r} is not an artifact id (16 hex digits)")
    if kind is not None and not SEGMENT.fullmatch(kind):
        raise ArtifactError(f"--kind {kind!r} is not an artifact kind (target, dataset, hidden, vocab, draft, ...)")
    kinds = [kind] if kind else sorted({k.split("/")[1] for k in store.backend.list("artifacts/")
                                        if k.count("/") >= 3})
    refs = [(k, i) for k in kinds for i in store.list(k)]
    if art_id is not None:
        refs = [r for r in refs if r[1] == art_id]
        if not refs:
            raise ArtifactError(f"no committed artifact {kind or '*'}/{art_id} in {store.uri}")
    return refs


def verify_aliases(store: Store) -> list[dict[str, Any]]:
    """`{"alias", "kind", "id", "ok", "error"}` per alias: readable, and its target committed with every
    sha256 matching (a missing or corrupt target is named)."""
    out = []
    for key in sorted(store.backend.list("aliases/")):
        name = key.removeprefix("aliases/").removesuffix(".json")
        if "/" in name or not key.endswith(".json"):
            continue
        rec, error = None, store.alias_problem(name)
        if error is None:
            rec = store.get_alias(name) or {}
            try:
                store.verify(rec["kind"], rec["id"])
            except ArtifactError as err:
                error = f"alias {name!r} -> {rec['kind']}/{rec['id']}: {err}"
        out.append({"alias": name, "kind": (rec or {}).get("kind"), "id": (rec or {}).get("id"),
                    "ok": error is None, "error": error})
    return out


def verify_all(store: Store, kind: str | None = None, art_id: str | None = None) -> list[dict[str, Any]]:
    """`{"kind", "id", "ok", "files", "bytes", "error"}` per artifact, each file's sha256 checked."""
    out = []
    for k, i in artifact_refs(store, kind, art_id):
        try:
            m = store.verify(k, i)
            out.append({"kind": k, "id": i, "ok": True, "files": len(m.files), "bytes": m.total_bytes, "error": None})
        except ArtifactError as err:
            out.append({"kind": k, "id": i, "ok": False, "files": None, "bytes": None, "error": str(err)})
    return out


def _staging_groups(store: Store) -> dict[tuple[str, str], list[str]]:
    """(kind, id) → every key under `staging/<kind>/<id>/`."""
    groups: dict[tuple[str, str], list[str]] = {}
    for key in store.backend.list("staging/"):
        parts = key.split("/")
        if len(parts) >= 4:
            groups.setdefault((parts[1], parts[2]), []).append(key)
    return groups


def _hold_dead_lease(store: Store, key: str, raw: bytes) -> bytes | None:
    """Take a dead lease over for gc (compare-and-swap, as a resuming writer does): the bytes gc now holds, or
    None when a writer took it first."""
    mine = json.dumps({"owner": "gc", "host": socket.gethostname(), "pid": os.getpid(), "heartbeat": time.time(),
                       "ttl": LEASE_TTL_S, "attempt": "gc"}).encode()
    return mine if store.backend.swap_bytes(key, mine, raw) else None


def collect_garbage(store: Store, *, dry_run: bool = False) -> dict[str, Any]:
    """Remove the staging nobody can use (see the module docstring); `{"removed": [{"key", "why", "bytes"}],
    "kept": [keys], "bytes", "dry_run"}`. `dry_run` only reports."""
    removed: list[dict[str, Any]] = []
    kept: list[str] = []
    for (kind, art_id), keys in sorted(_staging_groups(store).items()):
        base = f"staging/{kind}/{art_id}"
        lease_key = f"{base}/{LEASE}"
        raw = store.backend.get_bytes(lease_key)
        lease = json.loads(raw) if raw else None
        held: bytes | None = None          # the lease gc holds while it deletes a dead writer's attempt
        if store.backend.size(f"{store.key(kind, art_id)}/manifest.json") is not None:
            why, keep = "the artifact is committed", None
        elif lease is not None and not lease_is_dead(lease):
            why, keep = "no live lease names this attempt", lease["attempt"]
        elif lease is not None and raw is not None:
            why, keep = f"expired lease (pid {lease.get('pid')} on {lease.get('host')}, no heartbeat)", None
            if not dry_run:
                held = _hold_dead_lease(store, lease_key, raw)
                if held is None:            # a writer took it over just now: live again
                    kept += keys
                    continue
        else:
            why, keep = "no lease names this attempt", None
        for key in keys:
            rel = key[len(base) + 1:]
            if keep is not None and (rel == LEASE or rel.startswith(f"{keep}/")):
                kept.append(key)
                continue
            size = store.backend.size(key) or 0
            removed.append({"key": key, "why": why, "bytes": size})
            if not dry_run and key != lease_key:
                store.backend.delete(key)
        if not dry_run:
            if held is not None:
                store.backend.swap_bytes(lease_key, None, held)       # release: the lease goes last
            elif keep is None and raw is not None:
                store.backend.delete(lease_key)
            _remove_empty_dirs(store.backend.local_path(base))
    return {"removed": removed, "kept": kept, "bytes": sum(r["bytes"] for r in removed), "dry_run": dry_run}


__all__ = ["artifact_refs", "collect_garbage", "verify_aliases", "verify_all"]
