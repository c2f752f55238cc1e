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

import errno
import json
import logging
import os
import socket
import time
from typing import Any

from steps.lib.errors import ArtifactError
from steps.lib.files import files_under
from steps.lib.store.ids import ARTIFACT_ID, SEGMENT
from steps.lib.store.keys import LEASE
from steps.lib.store.store import Store
from steps.lib.store.writer import LEASE_TTL_S, _pid_gone, _remove_empty_dirs, lease_is_dead

log = logging.getLogger("eaglenest.store")


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


def _plan(store: Store, kind: str, art_id: str) -> tuple[str, str | None, bytes | None, bool]:
    """(why, the attempt to keep or None, the lease's bytes, whether gc must take a dead lease first)."""
    raw = store.backend.get_bytes(f"staging/{kind}/{art_id}/{LEASE}")
    lease = json.loads(raw) if raw else None
    if store.backend.size(f"{store.key(kind, art_id)}/manifest.json") is not None:
        return "the artifact is committed", None, raw, False
    if lease is not None and not lease_is_dead(lease):
        return "no live lease names this attempt", lease["attempt"], raw, False
    if lease is not None and raw is not None:
        return f"expired lease (pid {lease.get('pid')} on {lease.get('host')}, no heartbeat)", None, raw, True
    return "no lease names this attempt", None, raw, False


def _dot_debris(store: Store, base: str, live: bool) -> list[str]:
    """The dot-files under a local staging folder that `Backend.list` hides: temp files of a dead writer
    (`.<name>.tmp-<pid>`, by its pid) and, with no live writer, every lock and temp file."""
    top = store.backend.local_path(base)
    if top is None or not top.is_dir():
        return []
    out = []
    for path in (p for p in files_under(top) if p.name.startswith(".")):
        pid = path.name.rsplit(".tmp-", 1)[1] if ".tmp-" in path.name else ""
        if not live or (pid.isdigit() and _pid_gone(int(pid))):
            out.append(str(path.relative_to(store.backend.local_path(""))))
    return out


def _set_dead_lease_aside(store: Store, key: str, raw: bytes, err: OSError) -> str | None:
    """A full disk cannot take a new lease's bytes: on a local store, rename the dead lease aside instead
    (compare-and-swap, no data written); a writer starting meanwhile finds no lease and starts afresh, never
    resuming the files gc deletes. None (the group is kept, and logged) when that is not possible."""
    aside = f"{key.rsplit('/', 1)[0]}/.{LEASE}.gc-{os.getpid()}"
    if err.errno == errno.ENOSPC and hasattr(store.backend, "set_aside"):
        try:
            if store.backend.set_aside(key, raw, aside):
                return aside
        except OSError as again:
            err = again
    log.warning("store gc: kept %s: could not take its dead lease (%s)", key, err)
    return None


def collect_garbage(store: Store, *, dry_run: bool = False) -> dict[str, Any]:
    """Remove the staging nobody can use (see the module docstring); `{"removed": [{"key", "why", "bytes"}],
    "kept": [keys], "bytes", "dry_run"}`. `dry_run` only reports.

    On a full disk: what needs no write goes first (a committed artifact's debris, attempts no lease
    names), so taking a dead writer's lease, the one write gc makes, finds the space it freed; a lease it
    still cannot take is kept and named, never a failure of gc itself."""
    removed: list[dict[str, Any]] = []
    kept: list[str] = []
    plans = {group: _plan(store, *group) for group in _staging_groups(store)}
    live = {g for g, plan in plans.items() if plan[1] is not None}
    found = {r["key"] for r in _remove_dot_debris(store, live, dry_run=True)}   # before gc adds its own locks
    for (kind, art_id), keys in sorted(_staging_groups(store).items(), key=lambda g: (plans[g[0]][3], g[0])):
        why, keep, raw, take = plans[(kind, art_id)]
        base = f"staging/{kind}/{art_id}"
        lease_key = f"{base}/{LEASE}"
        held: bytes | None = None          # the lease gc holds while it deletes a dead writer's attempt
        aside = None                       # where a dead lease was renamed to, when there was no room to rewrite it
        if take and not dry_run:
            try:
                held = _hold_dead_lease(store, lease_key, raw or b"")
            except OSError as err:
                aside = _set_dead_lease_aside(store, lease_key, raw or b"", err)
            if held is None and aside is None:      # a writer took it over just now (live again), or no room
                kept += keys
                continue
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
            elif aside is not None:
                store.backend.delete(aside)
            elif keep is None and raw is not None:
                store.backend.delete(lease_key)
    removed += [r for r in _remove_dot_debris(store, live, dry_run) if r["key"] in found]   # not gc's own locks
    return {"removed": removed, "kept": kept, "bytes": sum(r["bytes"] for r in removed), "dry_run": dry_run}


def _remove_dot_debris(store: Store, live: set[tuple[str, str]], dry_run: bool) -> list[dict[str, Any]]:
    """Every staging folder's hidden debris (including folders that hold nothing else, which no listing
    shows), then the folders left empty; a live writer's own lock and temp files are kept."""
    top = store.backend.local_path("staging")
    if top is None or not top.is_dir():
        return []
    out = []
    for base_dir in sorted(p for p in top.glob("*/*") if p.is_dir()):
        kind, art_id = base_dir.parent.name, base_dir.name
        for key in _dot_debris(store, f"staging/{kind}/{art_id}", (kind, art_id) in live):
            path = store.backend.local_path(key)
            size = path.stat().st_size if path is not None and path.exists() else 0
            out.append({"key": key, "why": "a temp or lock file no writer holds", "bytes": size})
            if not dry_run and path is not None:
                path.unlink(missing_ok=True)
        if not dry_run:
            _remove_empty_dirs(base_dir)
    if not dry_run:
        for kind_dir in (p for p in top.iterdir() if p.is_dir()):
            if not any(kind_dir.iterdir()):
                kind_dir.rmdir()
    return out


__all__ = ["artifact_refs", "collect_garbage", "verify_aliases", "verify_all"]
