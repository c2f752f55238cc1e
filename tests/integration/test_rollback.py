"""Promotion rolls back, two ways, against the real stack (`prefect_stack`):

1. in-process: a failure inside the promotion transaction (the promoted export does not verify)
   runs `promote`'s rollback hook, which puts `production` and `previous` back exactly;
2. the safety net: a failed `eagle3-pipeline` run that had moved `production` (tagged moved-production) makes
   the server's automation start `eaglenest-rollback/rollback-local` on the worker, which moves `production`
   back; a failed run that moved nothing (a typo'd parameter) starts no rollback.

`rollback_flow`'s other branches, run as a flow against the same server (no automation to wait for):
a failed `benchmark` child run rolls back what its parent pipeline promoted (the parent found through the
child's parent task run), a failed run that did not move `production` leaves it alone, and so does one whose
config does not load (refused before any step).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from steps.lib.store import ArtifactError, open_store

pytestmark = pytest.mark.slow


def make_export(store, art_id: str, text: str = "weights") -> None:
    writer = store.begin("export", art_id, step="export")
    writer.path("sglang/config.json").write_text(text)
    writer.commit()


@pytest.fixture()
def store(tmp_path):
    s = open_store(f"file://{tmp_path / 'store'}")
    for art_id in ("a000000000000001", "b000000000000002"):
        make_export(s, art_id)
    s.set_alias("production", "export", "a000000000000001", meta={"tau": 2.0})
    return s


@pytest.fixture()
def api(prefect_stack):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_stack.api_url}):
        yield prefect_stack


def test_a_failure_inside_the_transaction_restores_both_aliases(api, store):
    from prefect import flow

    from flows.promotion import promote_in_transaction

    before = store.get_alias("production")
    # the export to promote is damaged after it was written, one byte flipped so the size still matches:
    # only confirm_production's sha256 check can catch it
    damaged = Path(store.uri.removeprefix("file://"), "artifacts/export/b000000000000002/sglang/config.json")
    data = bytearray(damaged.read_bytes())
    data[0] ^= 0x01
    damaged.write_bytes(bytes(data))
    assert damaged.stat().st_size == store.manifest("export", "b000000000000002").file("sglang/config.json")["size"]

    @flow
    def promote_damaged() -> None:
        promote_in_transaction(store.uri, "b000000000000002", {"tau": 2.5})

    with pytest.raises(ArtifactError):
        promote_damaged()
    assert store.get_alias("production") == before
    assert store.get_alias("previous") is None


def failed_pipeline_run(client, store, *, moved: bool, message: str):
    """An eagle3-pipeline run that ended Failed; `moved`: it had promoted export b first (tagged and recorded as
    `promote` does it)."""
    from prefect.states import Failed, Running

    from flows.pipeline import eagle3_pipeline
    from flows.promotion import MOVED_TAG, tag_run

    run = client.create_flow_run(eagle3_pipeline, parameters={"config": "configs/tiny.yaml", "store": store.uri})
    if moved:
        tag_run(str(run.id), MOVED_TAG)
        store.restore_alias("previous", store.get_alias("production"))
        store.set_alias("production", "export", "b000000000000002", meta={"flow_run_id": str(run.id)})
    client.set_flow_run_state(run.id, Running(), force=True)
    client.set_flow_run_state(run.id, Failed(message=message), force=True)
    return run


def rollback_targets(client) -> list[str]:
    """The `flow_run_id` parameter of every eaglenest-rollback run the automation started."""
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["eaglenest-rollback"])))
    return [r.parameters["flow_run_id"] for r in runs]


def test_the_automation_rolls_back_after_a_pipeline_run_that_moved_production_only(api, store):
    from prefect.client.orchestration import SyncPrefectClient

    with SyncPrefectClient(api.api_url) as client:
        # a run refused for a typo moved nothing: its Failed state starts no rollback ...
        typo = failed_pipeline_run(client, store, moved=False, message="parameter config: tiniy.yaml: not found")
        # ... the one that promoted and then died does
        run = failed_pipeline_run(client, store, moved=True, message="crashed after promotion")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and store.get_alias("production")["id"] != "a000000000000001":
            time.sleep(3)
        assert store.get_alias("production")["id"] == "a000000000000001"
        assert store.get_alias("production")["meta"] == {"tau": 2.0}
        # the triggers service reads events in order: the typo's Failed was judged before the promoted run's
        targets = rollback_targets(client)
    assert f"prefect.flow-run.{run.id}" in targets and f"prefect.flow-run.{typo.id}" not in targets, targets


def pipeline_run(client, store, *, moved: bool):
    """An eagle3-pipeline run that died; `moved`: it had promoted export b (the alias names the run).

    Left Running, never set Failed: a Failed state would also start the automation (the test above), which
    would race the direct `rollback_flow` call these tests make. `rollback_flow` reads no state.
    """
    from prefect.states import Running

    from flows.pipeline import eagle3_pipeline

    run = client.create_flow_run(eagle3_pipeline, parameters={"config": "configs/tiny.yaml", "store": store.uri})
    if moved:
        store.restore_alias("previous", store.get_alias("production"))
        store.set_alias("production", "export", "b000000000000002", meta={"flow_run_id": str(run.id)})
    client.set_flow_run_state(run.id, Running(), force=True)
    return run


def test_a_failed_benchmark_child_rolls_back_what_its_pipeline_promoted(api, store):
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.states import Running

    from flows.pipeline import step_task
    from flows.promotion import rollback_flow
    from flows.step_flows import flow_of

    with SyncPrefectClient(api.api_url) as client:
        pipeline = pipeline_run(client, store, moved=True)
        parent = client.create_task_run(step_task, pipeline.id, dynamic_key="benchmark")
        # a benchmark child's parameters carry no pipeline flow run id: only its parent task run leads back
        child = client.create_flow_run(flow_of("benchmark"), parent_task_run_id=parent.id,
                                       parameters={"config": "configs/tiny.yaml", "store": store.uri})
        client.set_flow_run_state(child.id, Running(), force=True)
    result = rollback_flow(f"prefect.flow-run.{child.id}", reason="benchmark died")
    assert result["action"] == "production moved back from export b000000000000002 to a000000000000001"
    assert store.get_alias("production")["id"] == "a000000000000001"
    assert store.get_alias("production")["meta"] == {"tau": 2.0}


def test_a_failed_run_that_did_not_move_production_leaves_it_alone(api, store):
    from prefect.client.orchestration import SyncPrefectClient

    from flows.promotion import rollback_flow

    with SyncPrefectClient(api.api_url) as client:
        promoted = pipeline_run(client, store, moved=True)        # another run moved production ...
        other = pipeline_run(client, store, moved=False)         # ... this one failed before promoting
    before = store.get_alias("production")
    assert before["meta"]["flow_run_id"] == str(promoted.id)
    result = rollback_flow(f"prefect.flow-run.{other.id}", reason="failed before the gate")
    assert result["action"] == ("nothing to roll back: production (b000000000000002) was not moved by this run")
    assert store.get_alias("production") == before



def test_a_failed_run_whose_config_does_not_load_has_nothing_to_roll_back(api, store):
    """A run refused before any step (its config does not load): no store to read, nothing it could have moved."""
    from prefect.client.orchestration import SyncPrefectClient

    from flows.pipeline import eagle3_pipeline
    from flows.promotion import rollback_flow

    with SyncPrefectClient(api.api_url) as client:
        pipeline_run(client, store, moved=True)                  # production was moved, by another run
        refused = client.create_flow_run(eagle3_pipeline, parameters={"config": "configs/tiniy.yaml",
                                                                      "store": store.uri})
    before = store.get_alias("production")
    result = rollback_flow(f"prefect.flow-run.{refused.id}", reason="parameter config: tiniy.yaml: not found")
    assert result["action"].startswith("nothing to roll back: the run's config does not load ("), result
    assert "tiniy.yaml" in result["action"] and "\n" not in result["action"], result
    assert store.get_alias("production") == before
