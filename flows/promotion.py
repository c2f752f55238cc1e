"""Promotion and rollback of the `production` alias.

Promotion runs inside a Prefect transaction: `promote` moves `production` to the new export and
keeps the old one as `previous`; `confirm_production` re-reads the alias and verifies every file of
the export it points at. If anything in the transaction fails, `promote`'s rollback hook puts both
aliases back exactly as they were.

A transaction only covers a process that raises. For a run that crashes, or fails after the
transaction, the `eaglenest-rollback` flow is the safety net. `promote` tags its flow run `MOVED_TAG`
before it moves the alias, and the automation starts the rollback only for a failed or crashed
`eagle3-pipeline` run with that tag: a run refused for a typo, cancelled, or failed by a verdict moved
nothing and starts nothing. The rollback itself moves `production` back to `previous` only if that run
is the one that moved it (the alias records the flow run id).
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import get_run_context
from prefect.transactions import Transaction, get_transaction, transaction

from flows.parameters import described
from steps.lib.config import ConfigError, find_config, load_config
from steps.lib.runtime.redaction import redact_text
from steps.lib.store import ArtifactError, open_store, store_uri_for

#: the tag of a flow run that moved `production` (deploy/prefect.yaml: the rollback trigger matches it)
MOVED_TAG = "moved-production"


def tag_run(flow_run_id: str | None, tag: str) -> None:
    """Add `tag` to the flow run (its later state changes carry it: the automation's filter)."""
    if flow_run_id is None:
        return
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(UUID(flow_run_id))
        if tag not in run.tags:
            client.update_flow_run(run.id, tags=[*run.tags, tag])


@task(name="promote", persist_result=True, cache_policy=NO_CACHE)
def promote(store_uri: str, export_id: str, meta: dict[str, Any]) -> dict[str, Any]:
    """production → export_id; previous → the old production record, verbatim. The run is tagged first, so a
    crash right after the move is one the automation rolls back."""
    tag_run(meta.get("flow_run_id"), MOVED_TAG)
    store = open_store(store_uri)
    before = {"production": store.get_alias("production"), "previous": store.get_alias("previous")}
    txn = get_transaction()
    if txn is not None:
        txn.set("store", store_uri)
        txn.set("before", before)
    if before["production"]:
        store.restore_alias("previous", before["production"])
    return store.set_alias("production", "export", export_id, meta=meta)


@promote.on_rollback
def _restore_aliases(txn: Transaction) -> None:
    store = open_store(txn.get("store"))
    for name, record in txn.get("before").items():
        store.restore_alias(name, record)
    print(f"rolled back: production → {(txn.get('before')['production'] or {}).get('id')}")


@task(name="confirm-production", persist_result=True, cache_policy=NO_CACHE)
def confirm_production(store_uri: str, export_id: str) -> str:
    """The alias reads back as written and every file of the export it names verifies as the store holds it:
    size and sha256 against the manifest (`Store.verify`; S3 objects are streamed through the hash)."""
    store = open_store(store_uri)
    alias = store.get_alias("production")
    if not alias or alias["id"] != export_id:
        raise ArtifactError(f"production alias reads {alias and alias['id']}, expected {export_id}")
    store.verify("export", export_id)
    return export_id


def promote_in_transaction(store_uri: str, export_id: str, meta: dict[str, Any]) -> dict[str, Any]:
    with transaction():
        record = promote(store_uri, export_id, meta)
        confirm_production(store_uri, export_id)
    return record


# --- the safety net ---------------------------------------------------------------------------------------

def _flow_run_uuid(resource_id: str) -> UUID:
    return UUID(resource_id.removeprefix("prefect.flow-run."))


@flow(name="eaglenest-rollback", log_prints=True)
@described
def rollback_flow(flow_run_id: str, reason: str = "") -> dict[str, Any]:
    """Put `production` back on `previous` if the failed run (or its parent pipeline) moved it."""
    from prefect.client.orchestration import get_client

    logger = get_run_logger()
    with get_client(sync_client=True) as client:
        failed = client.read_flow_run(_flow_run_uuid(flow_run_id))
        runs = [failed]
        if failed.parent_task_run_id:   # a benchmark child: its pipeline is the run that may have promoted
            parent = client.read_task_run(failed.parent_task_run_id)
            runs.append(client.read_flow_run(parent.flow_run_id))
    pipeline = next((r for r in runs if "config" in r.parameters), failed)
    params = pipeline.parameters
    try:
        cfg = load_config(find_config(params.get("config", "tiny")), params.get("overrides"))
    except ConfigError as err:     # a run refused before any step: it moved nothing
        action = f"nothing to roll back: the run's config does not load ({' '.join(str(err).split())})"
        logger.info("%s (failed run %s: %s)", action, failed.name, reason)
        return {"failed_run": str(failed.id), "action": action}
    store = open_store(store_uri_for(params.get("store"), cfg.store))
    production, previous = store.get_alias("production"), store.get_alias("previous")
    moved_by = (production or {}).get("meta", {}).get("flow_run_id")
    if production and moved_by in {str(r.id) for r in runs}:
        store.restore_alias("production", previous)
        action = f"production moved back from export {production['id']} to {(previous or {}).get('id')}"
    else:
        action = f"nothing to roll back: production ({(production or {}).get('id')}) was not moved by this run"
    logger.info("%s (failed run %s: %s)", action, failed.name, reason)
    report = f"# Rollback after `{failed.name}`\n\nreason: {reason or 'n/a'}\n\n{action}\n"
    create_markdown_artifact(redact_text(report), description="eaglenest safety-net rollback")
    return {"failed_run": str(failed.id), "action": action}


def current_flow_run_id() -> str | None:
    ctx = get_run_context()
    fr = getattr(ctx, "flow_run", None)
    return str(fr.id) if fr else None
