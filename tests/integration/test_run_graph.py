"""The run graph a user opens in the Prefect UI draws each step once (issue 26, item 8).

Each step is a task of the pipeline run whose work is a child flow run. Prefect's own subflow call and
`run_deployment` each add a stand-in task run for the child, so the graph (`/flow_runs/{id}/graph-v2`, what
the UI draws) showed every step twice: the step's task and the stand-in carrying its flow run. The pipeline
files each child under the step's own task run instead (`flows.pipeline.run_subflow` on the local pool,
`run_deployment_under` on a cluster pool); both are checked here against the session's real stack.
"""

from __future__ import annotations

from uuid import UUID

import httpx
import pytest

from steps.registry import STEPS

pytestmark = pytest.mark.slow


def graph_nodes(api_url: str, flow_run_id: UUID) -> list[dict]:
    response = httpx.get(f"{api_url}/flow_runs/{flow_run_id}/graph-v2", timeout=30)
    response.raise_for_status()
    return [node for _, node in response.json()["nodes"]]


def step_of(node: dict) -> str | None:
    """The step a graph node draws: a task run is labelled by its step (`datagen`), a flow run `<flow> / <run>`."""
    label = node["label"].split(" / ")[0]
    return label if label in STEPS else None


def test_the_run_graph_draws_each_step_once_as_its_own_flow_run(prefect_stack, tiny_pipeline_run):
    code, run_id, out = tiny_pipeline_run
    assert code == 0, out[-3000:]
    nodes = graph_nodes(prefect_stack.api_url, run_id)
    drawn = [step_of(n) for n in nodes]
    labels = "\n".join(f"{n['kind']} {n['label']}" for n in nodes)
    assert sorted(s for s in drawn if s) == sorted(STEPS), labels
    # beside the steps only the promotion's transaction (tasks named `promote-…`, `confirm-production-…`):
    # no stand-in task
    others = sorted(n["label"].rsplit("-", 1)[0] for n in nodes if step_of(n) is None)
    assert others == ["confirm-production", "promote"], labels
    # a step that ran is its child flow run, opened from the graph; the graph's order is the pipeline's
    ran = [n for n in nodes if n["kind"] == "flow-run"]
    assert ran and all(n["state_type"] == "COMPLETED" for n in ran), nodes
    by_start = [step_of(n) for n in sorted(nodes, key=lambda n: n["start_time"]) if step_of(n)]
    assert by_start == list(STEPS), by_start


def test_a_deployment_child_is_filed_under_the_task_that_started_it(prefect_stack):
    """A cluster pool's step runs as a deployment run (`<step>/<step>-<pool>`): run_deployment_under starts it
    with the calling task as its parent and waits for its end. Here the stack's `gate-local` deployment, given a
    config that does not exist, fails in one line before its step starts (no compute)."""
    from prefect import flow, task
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.context import TaskRunContext
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.pipeline import run_deployment_under

    @task
    def start_child() -> tuple[UUID, UUID]:
        parent = TaskRunContext.get().task_run.id
        child = run_deployment_under("gate/gate-local", {"config": "configs/no-such.yaml"}, parent, poll_s=0.5)
        assert child.state.is_final() and child.state.is_failed(), child.state
        assert "no-such.yaml" in child.state.message, child.state.message
        return parent, child.id

    @flow
    def caller() -> tuple[UUID, UUID]:
        return start_child()

    with temporary_settings({PREFECT_API_URL: prefect_stack.api_url}):
        parent, child_id = caller()
    with SyncPrefectClient(prefect_stack.api_url) as client:
        assert client.read_flow_run(child_id).parent_task_run_id == parent
