"""The step flows (flows/step_flows.py) as subflows of the pipeline: each is told apart from the others."""

from __future__ import annotations

from prefect.tasks import Task

from flows.step_flows import flow_of
from steps.registry import STEPS


def test_each_step_flow_has_its_own_function_so_a_retried_pipeline_finds_its_own_subflows():
    # Prefect looks a subflow's earlier run up by the key of a task made from the flow's function (name and
    # code); one key for all ten made a retried pipeline's benchmark subflow return target's record
    keys = {step: Task(name=step, fn=flow_of(step).fn).task_key for step in STEPS}
    assert len(set(keys.values())) == len(STEPS), keys
    assert all(key.startswith(f"{step}_flow-") for step, key in keys.items()), keys
