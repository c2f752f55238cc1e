"""Where things live under a store root: pure functions of (kind, id), shared by `Store`, its writer and
maintenance, so none of them asks another for a key.

    artifacts/<kind>/<id>/...          a committed artifact (`artifact_key`)
    staging/<kind>/<id>/lease.json     its writer's lease (`lease_key`)
    staging/<kind>/<id>/<attempt>/     one writer's files (`attempt_key`), with `.partial/` upload records
    aliases/<name>.json                an alias (`alias_key`)
"""

from __future__ import annotations

from steps.lib.store.ids import check_ref

#: per-attempt folder of upload records that make early uploads visible to a resumed writer.
PARTIAL = ".partial"
LEASE = "lease.json"


def artifact_key(kind: str, art_id: str) -> str:
    check_ref(kind, art_id)
    return f"artifacts/{kind}/{art_id}"


def staging_key(kind: str, art_id: str) -> str:
    check_ref(kind, art_id)
    return f"staging/{kind}/{art_id}"


def lease_key(kind: str, art_id: str) -> str:
    return f"{staging_key(kind, art_id)}/{LEASE}"


def attempt_key(kind: str, art_id: str, attempt: str) -> str:
    return f"{staging_key(kind, art_id)}/{attempt}"


def alias_key(name: str) -> str:
    return f"aliases/{name}.json"


def uri_of(root: str, key: str) -> str:
    """The URI of `key` under the store at `root` (`file:///s` + `artifacts/x/y` → `file:///s/artifacts/x/y`)."""
    return f"{root.rstrip('/')}/{key}"
