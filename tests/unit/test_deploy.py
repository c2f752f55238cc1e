"""deploy/prefect.yaml and deploy/pools/*.json against the Orchestration contract (docs/ARCHITECTURE.md).

No server here: the file is read as `prefect deploy` reads it (YAML anchors resolved), entrypoints are
imported, triggers are parsed by Prefect's own trigger models. tests/integration/test_stack.py registers
the same file against a real server and renders the GPU job templates.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PREFECT_FILE = REPO / "deploy" / "prefect.yaml"
POOLS_DIR = REPO / "deploy" / "pools"
#: the one table of steps (steps/registry.py): prefect.yaml must follow it
from steps.registry import STEPS as REGISTRY  # noqa: E402

STEPS = tuple(REGISTRY)
CLASS_OF = {name: s.hardware for name, s in REGISTRY.items()}


@pytest.fixture(scope="module")
def deployments() -> dict[str, dict[str, Any]]:
    """`flow/deployment` → its config, the flow name taken from the imported entrypoint."""
    doc = yaml.safe_load(PREFECT_FILE.read_text())
    out: dict[str, dict[str, Any]] = {}
    for dep in doc["deployments"]:
        module_path, fn = dep["entrypoint"].split(":")
        module = importlib.import_module(module_path.removesuffix(".py").replace("/", "."))
        flow_name = getattr(module, fn).name
        key = f"{flow_name}/{dep['name']}"
        assert key not in out, f"{PREFECT_FILE}: {key} is defined twice"
        out[key] = dep
    return out


def template(pool: str) -> dict[str, Any]:
    return json.loads((POOLS_DIR / f"{pool}.json").read_text())


def test_every_step_has_a_local_docker_and_k8s_deployment_on_the_pool_of_its_class(deployments):
    for step in STEPS:
        cls = CLASS_OF[step]
        pools = {kind: deployments[f"{step}/{step}-{kind}"]["work_pool"]["name"] for kind in ("local", "docker", "k8s")}
        assert pools == {"local": "local", "docker": f"{cls}-docker", "k8s": f"{cls}-k8s"}, step
        for kind in ("local", "docker", "k8s"):
            dep = deployments[f"{step}/{step}-{kind}"]
            assert dep["entrypoint"] == f"flows/step_flows.py:{step}_flow", f"{step}/{kind}"
            assert dep["tags"] == ["eaglenest", cls], f"{step}/{kind}"


def test_the_step_deployments_are_exactly_the_registry_steps(deployments):
    """A registry row without its three deployments (or a deployment left behind by a removed step) fails."""
    import flows.step_flows as step_flows

    step_entrypoints = {d["entrypoint"].split(":")[1] for d in deployments.values()
                        if d["entrypoint"].startswith("flows/step_flows.py:")}
    assert step_entrypoints == {f"{s}_flow" for s in STEPS}
    assert {name for name in vars(step_flows) if name.endswith("_flow") and not name.startswith("_")} \
        == step_entrypoints


def test_the_contract_deployments_exist_with_their_parameters(deployments):
    tiny = deployments["eagle3-pipeline/tiny"]
    assert tiny["parameters"] == {"config": "configs/tiny.yaml", "mode": "deployments", "pool": "local"}
    assert deployments["eagle3-pipeline/smollm2"]["parameters"]["config"] == "configs/smollm2-135m.yaml"
    assert deployments["eagle3-pipeline/tiny-docker"]["parameters"]["pool"] == "docker"
    assert deployments["eagle3-pipeline/tiny-docker"]["work_pool"]["name"] == "cpu-docker"
    assert deployments["eagle3-pipeline/tiny-k8s"]["parameters"]["pool"] == "k8s"
    assert deployments["eagle3-pipeline/tiny-k8s"]["work_pool"]["name"] == "cpu-k8s"
    for kind, pool in (("local", "local"), ("docker", "cpu-docker")):
        assert deployments[f"eaglenest-rollback/rollback-{kind}"]["entrypoint"] == "flows/promotion.py:rollback_flow"
        assert deployments[f"dataset-sensor/sensor-{kind}"]["entrypoint"] == "flows/dataset_trigger.py:dataset_sensor"
        assert deployments[f"dataset-sensor/sensor-{kind}"]["work_pool"]["name"] == pool


def test_deployments_are_named_by_what_they_run_and_each_set_names_existing_ones(deployments):
    """No two deployments share a name (the UI lists names; `prefect deploy -n` selects by them), and the sets
    `stack up` / `stack register --deployments` deploy name deployments that exist, on that infrastructure."""
    from flows.prefect_setup import DEPLOYMENT_SETS, INFRASTRUCTURE

    names = [key.split("/")[1] for key in deployments]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    by_name = {key.split("/")[1]: dep for key, dep in deployments.items()}
    for kind, members in DEPLOYMENT_SETS.items():
        assert set(members) <= set(by_name), set(members) - set(by_name)
        assert {by_name[n]["work_pool"]["name"] for n in members} <= set(INFRASTRUCTURE[kind]), kind
    assert set(by_name) == {n for members in DEPLOYMENT_SETS.values() for n in members}


def test_every_pool_has_a_template_the_stack_creates(deployments):
    from flows.prefect_setup import POOLS

    used = {d["work_pool"]["name"] for d in deployments.values()}
    assert used == set(POOLS), f"pools used by {PREFECT_FILE} vs flows.prefect_setup.POOLS"
    assert {p.stem for p in POOLS_DIR.glob("*.json")} == set(POOLS)
    for pool, (pool_type, _) in POOLS.items():
        variables = template(pool)["variables"]["properties"]
        marker = {"process": "working_dir", "docker": "container_create_kwargs", "kubernetes": "namespace"}[pool_type]
        assert marker in variables, f"deploy/pools/{pool}.json is not a {pool_type} template"


def test_container_deployments_run_in_the_image_of_their_class(deployments):
    images = dict(line.split("=", 1) for line in (REPO / "containers" / "images.env").read_text().splitlines()
                  if line and not line.startswith("#"))
    for key, dep in deployments.items():
        pool = dep["work_pool"]["name"]
        if pool == "local":
            continue
        cls = pool.split("-")[0]
        expected = images[f"EAGLENEST_{cls.upper()}_IMAGE"]
        assert dep["work_pool"]["job_variables"]["image"] == expected, key
        assert template(pool)["variables"]["properties"]["image"]["default"] == expected, pool
        assert dep["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": "/opt/eaglenest"}}]


def test_gpu_docker_deployments_request_gpus_shared_memory_and_scratch(deployments):
    for key, dep in deployments.items():
        pool = dep["work_pool"]["name"]
        if pool not in ("gpu-docker", "serve-docker"):
            continue
        jv = dep["work_pool"]["job_variables"]
        # a deployment's container_create_kwargs replaces the pool's: it must carry the GPU request itself
        kwargs = jv["container_create_kwargs"]
        assert kwargs["device_requests"] == [{"driver": "nvidia", "count": -1, "capabilities": [["gpu"]]}], key
        assert kwargs["shm_size"], key
        assert "/scratch/eaglenest:/scratch" in jv["volumes"], key
        assert template(pool)["variables"]["properties"]["container_create_kwargs"]["default"] == kwargs, pool


def test_gpu_k8s_templates_limit_nvidia_gpus_with_node_selector_tolerations_and_scratch():
    for pool in ("gpu-k8s", "serve-k8s"):
        tmpl = template(pool)
        spec = tmpl["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
        container = spec["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpu_count }}"
        assert spec["nodeSelector"] == "{{ node_selector }}" and spec["tolerations"] == "{{ tolerations }}"
        assert {"name": "scratch", "mountPath": "/scratch"} in container["volumeMounts"]
        props = tmpl["variables"]["properties"]
        assert props["gpu_count"]["type"] == "integer" and props["gpu_count"]["default"] >= 1
        assert props["tolerations"]["default"][0]["key"] == "nvidia.com/gpu"
    cpu = template("cpu-k8s")["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in cpu["containers"][0]["resources"]["limits"]


def test_each_gpu_and_serve_deployment_runs_one_job_at_a_time(deployments):
    for key, dep in deployments.items():
        step = key.split("/")[0]
        if CLASS_OF.get(step) in ("gpu", "serve"):
            assert dep.get("concurrency_limit") == {"limit": 1, "collision_strategy": "ENQUEUE"}, key


@pytest.mark.parametrize("deployment, pipeline, config", [("tiny", "tiny", "configs/tiny.yaml"),
                                                          ("smollm2", "smollm2", "configs/smollm2-135m.yaml"),
                                                          ("tiny-docker", "tiny", "configs/tiny.yaml")])
def test_each_pipeline_starts_on_the_uploads_for_it_debounced_per_dataset(deployments, deployment, pipeline, config):
    from prefect.events import DeploymentEventTrigger

    from flows.dataset_trigger import PIPELINE_CONFIGS, PIPELINES

    (raw,) = deployments[f"eagle3-pipeline/{deployment}"]["triggers"]
    trigger = DeploymentEventTrigger.model_validate({k: v for k, v in raw.items() if k != "type"})
    assert trigger.expect == {"eaglenest.dataset.uploaded"}
    assert pipeline in PIPELINES and trigger.match.root["eaglenest.pipeline"] == pipeline
    assert trigger.description, "the automation says what it does (the UI shows it)"
    assert trigger.for_each == {"prefect.resource.id"}
    assert trigger.threshold == 1 and trigger.within.total_seconds() >= 30
    assert trigger.parameters["dataset"] == "{{ event.payload.uri }}"
    assert trigger.parameters["mode"] == "deployments" and trigger.parameters["config"] == config
    assert PIPELINE_CONFIGS[pipeline] == config     # what `dataset upload` sizes the file against


def state_change(state_name: str, *, flow: str = "eagle3-pipeline", tags: tuple[str, ...] = ()):
    """The event Prefect's server emits when a flow run enters a state: the run as resource, its flow and each
    of its tags as related resources (prefect/server/models/events.py)."""
    import datetime as dt
    from uuid import uuid4

    from prefect.server.events.schemas.events import ReceivedEvent

    related = [{"prefect.resource.id": f"prefect.flow.{uuid4()}", "prefect.resource.role": "flow",
                "prefect.resource.name": flow}]
    related += [{"prefect.resource.id": f"prefect.tag.{tag}", "prefect.resource.role": "tag"}
                for tag in ("eaglenest", "pipeline", *tags)]
    return ReceivedEvent(occurred=dt.datetime.now(dt.UTC), event=f"prefect.flow-run.{state_name}", id=uuid4(),
                         resource={"prefect.resource.id": f"prefect.flow-run.{uuid4()}",
                                   "prefect.resource.name": "metal-raven"}, related=related)


def test_the_rollback_trigger_fires_only_for_a_failed_or_crashed_run_that_moved_production(deployments):
    """Judged by the server's own trigger model on the events its state changes emit: a run tagged
    moved-production (flows/promotion.py tags it before it moves the alias) that fails or crashes starts the
    rollback; a typo'd run (plain Failed, no tag), a cancelled run, a verdict's own state (ZeroAcceptance) or
    another flow never does."""
    from prefect.server.events.schemas.automations import EventTrigger

    from flows.promotion import MOVED_TAG

    (raw,) = deployments["eaglenest-rollback/rollback-local"]["triggers"]
    trigger = EventTrigger.model_validate({k: v for k, v in raw.items() if k in EventTrigger.model_fields})
    assert trigger.covers(state_change("Failed", tags=(MOVED_TAG,)))
    assert trigger.covers(state_change("Crashed", tags=(MOVED_TAG,)))
    for event in (state_change("Failed"), state_change("Crashed"), state_change("Cancelled", tags=(MOVED_TAG,)),
                  state_change("ZeroAcceptance"), state_change("Completed", tags=(MOVED_TAG,)),
                  state_change("Failed", flow="benchmark", tags=(MOVED_TAG,))):
        assert not trigger.covers(event), event.event
    assert raw["parameters"] == {"flow_run_id": "{{ event.resource.id }}", "reason": "{{ event.event }}"}


def test_the_sensor_is_not_scheduled_by_default_and_never_queues_polls(deployments):
    """Uploads announce themselves; a sensor every 2 minutes queued 30 runs behind one busy worker."""
    sensor = deployments["dataset-sensor/sensor-local"]
    (schedule,) = sensor["schedules"]
    assert schedule["active"] is False and schedule["interval"] >= 300
    assert sensor["concurrency_limit"] == {"limit": 1, "collision_strategy": "CANCEL_NEW"}
