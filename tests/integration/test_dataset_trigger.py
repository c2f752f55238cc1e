"""New datasets start runs, against a real `prefect server start` (the `prefect_stack` fixture, with the
deployments of deploy/prefect.yaml and their triggers):

1. `eaglenest dataset upload` starts exactly one run of `eagle3-pipeline/tiny` within 60 s, with the
   object's URI as its `dataset` parameter and named after the dataset; uploading the same file again,
   or another announcer sending the same event, starts none;
2. `--pipeline smollm2` (the prefix datasets/smollm2/) starts `eagle3-pipeline/smollm2`, not tiny;
3. an object copied into a store by other means (no event) is announced by one `dataset-sensor` run,
   exactly once: the server holds that event and one pipeline run follows; a second sensor run
   announces nothing.

"Starts none" is not a fixed sleep: after the duplicate, a *fence* event for another dataset is posted;
the trigger service handles events in order, so once the fence's run exists the duplicate was handled.

Counting is all these tests need of a triggered run, so each one is cancelled once counted (a whole
pipeline per test would cost minutes of a shared 2-core machine and prove nothing more here).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from flows.dataset_trigger import dataset_event, post_events

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DEPLOYMENT = "eagle3-pipeline/tiny"
#: the issue's promise: a run exists within 60 s of the upload command (its own start-up included).
START_DEADLINE_S = 60
#: the triggered run is renamed after its dataset when it starts on the worker (a fresh Python process)
NAMED_DEADLINE_S = 240
#: a CLI call is a fresh Python importing prefect: 5-10 s on a busy 2-core machine.
CLI_TIMEOUT_S = 180
ROWS = [{"prompt": "What does a speculative decoding drafter do?"},
        {"messages": [{"role": "user", "content": "Write a haiku about caches."}]}]


# --- helpers ------------------------------------------------------------------------------------------

def client(stack):
    from prefect.client.orchestration import SyncPrefectClient

    return SyncPrefectClient(stack.api_url)


def write_dataset(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def run_python(stack, *args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, *args], env=stack.env, cwd=REPO, capture_output=True, text=True,
                         timeout=CLI_TIMEOUT_S)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def upload(stack, path: Path, name: str) -> tuple[str, str]:
    """`eaglenest dataset upload PATH --name NAME --store <stack store>`; (object URI, output)."""
    out = run_python(stack, "-m", "flows.cli", "dataset", "upload", str(path), "--name", name,
                     "--store", stack.store_uri)
    match = re.search(r"^(\S+/datasets/\S+): ", out.stdout, re.M)
    assert match, out.stdout
    return match.group(1), out.stdout


def run_sensor(stack, store_uri: str) -> list[str]:
    """One dataset-sensor flow run (in a fresh process, reporting to the stack's server); the ids it sent."""
    code = ("import json, sys; from flows.dataset_trigger import dataset_sensor; "
            "print('SENT=' + json.dumps(dataset_sensor(store=sys.argv[1])))")
    out = run_python(stack, "-c", code, store_uri)
    return json.loads(re.search(r"^SENT=(.*)$", out.stdout, re.M).group(1))


def runs_for(stack, uri: str, deployment_name: str = DEPLOYMENT) -> list:
    """Runs of the deployment (eagle3-pipeline/tiny) whose `dataset` parameter is `uri`."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with client(stack) as c:
        deployment = c.read_deployment_by_name(deployment_name)
        runs = c.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])))
    return [r for r in runs if r.parameters.get("dataset") == uri]


def wait_for_runs(stack, uri: str, at_least: int, deadline: float, deployment_name: str = DEPLOYMENT) -> list:
    runs = runs_for(stack, uri, deployment_name)
    while len(runs) < at_least and time.monotonic() < deadline:
        time.sleep(0.5)
        runs = runs_for(stack, uri, deployment_name)
    return runs


def after_a_fence(stack, store_uri: str) -> None:
    """Post an event for a fresh dataset and wait for its run: every event posted before it has been handled
    by the trigger service by then (it consumes events in order). The fence's run is cancelled."""
    name = f"fence-{uuid.uuid4().hex[:8]}"
    uri = f"{store_uri}/datasets/{name}/fence.jsonl"
    post_events(stack.api_url, [dataset_event(uri, name, uuid.uuid4().hex, 1, store_uri)])
    runs = wait_for_runs(stack, uri, 1, time.monotonic() + START_DEADLINE_S)
    cancel(stack, runs)
    assert len(runs) == 1, f"the fence event started {len(runs)} runs within {START_DEADLINE_S} s"


def wait_for_name(stack, run_id, deadline: float) -> str:
    with client(stack) as c:
        name = c.read_flow_run(run_id).name
        while " on " not in name and time.monotonic() < deadline:
            time.sleep(1)
            name = c.read_flow_run(run_id).name
    return name


def cancel(stack, runs: list) -> None:
    """Stop triggered runs (and the step runs they started): counted, not needed further."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.states import Cancelled, Cancelling

    with client(stack) as c:
        for run in runs:
            children = c.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id])))
            for r in [run, *children]:
                state = c.read_flow_run(r.id).state
                if state is None or state.is_final():
                    continue
                # A run a worker holds is stopped through Cancelling (the worker kills its process);
                # one nobody picked up yet is simply Cancelled.
                new = Cancelled() if state.is_scheduled() else Cancelling()
                c.set_flow_run_state(r.id, new, force=True)


def stored_events(stack, event_id: str, deadline_s: float = 60.0) -> list[dict]:
    """The server's stored copies of one event. The server accepts an event at once but persists it in
    batches (the event persister flushes every few seconds, later on a busy machine): poll for it."""
    import httpx

    deadline = time.monotonic() + deadline_s
    while True:
        response = httpx.post(f"{stack.api_url}/events/filter", json={"filter": {"id": {"id": [event_id]}}},
                              timeout=30)
        response.raise_for_status()
        events = response.json()["events"]
        if events or time.monotonic() > deadline:
            return events
        time.sleep(1)


# --- tests --------------------------------------------------------------------------------------------

def test_an_upload_starts_one_run_within_60_s_and_the_same_upload_none(prefect_stack, tmp_path):
    name = f"trigger-{uuid.uuid4().hex[:8]}"
    path = write_dataset(tmp_path / "prompts.jsonl")
    started = time.monotonic()  # the user's clock starts when they type the command
    uri, first = upload(prefect_stack, path, name)
    assert ": uploaded;" in first and "eagle3-pipeline/tiny starts a run" in first
    runs = wait_for_runs(prefect_stack, uri, 1, started + START_DEADLINE_S)
    try:
        assert len(runs) == 1, f"no run of {DEPLOYMENT} with dataset={uri} within {START_DEADLINE_S} s"
        assert runs[0].parameters["store"] and runs[0].parameters["mode"] == "deployments"
        assert wait_for_name(prefect_stack, runs[0].id, time.monotonic() + NAMED_DEADLINE_S) \
            == f"{name}/prompts.jsonl on tiny", "a triggered run is named after its dataset"

        _, again = upload(prefect_stack, path, name)
        assert "same bytes, not sent again" in again and "no second one" in again
        # Another announcer of the same version (the MinIO adapter, which keeps no record) sends the
        # same event: same id, and still one run.
        version = re.search(r"version ([0-9a-f]{32})", first).group(1)
        post_events(prefect_stack.api_url, [dataset_event(uri, name, version, path.stat().st_size,
                                                          runs[0].parameters["store"])])
        after_a_fence(prefect_stack, runs[0].parameters["store"])
        runs = runs_for(prefect_stack, uri)
        assert len(runs) == 1, f"the same object version announced again started {len(runs)} runs"
    finally:
        cancel(prefect_stack, runs_for(prefect_stack, uri))


def test_an_upload_for_another_pipeline_starts_that_pipeline_only(prefect_stack, tmp_path):
    name = f"smol-{uuid.uuid4().hex[:8]}"
    path = write_dataset(tmp_path / "prompts.jsonl")
    out = run_python(prefect_stack, "-m", "flows.cli", "dataset", "upload", str(path), "--name", name,
                     "--pipeline", "smollm2", "--store", prefect_stack.store_uri)
    uri = f"{prefect_stack.store_uri}/datasets/smollm2/{name}/prompts.jsonl"
    assert f"{uri}: uploaded;" in out.stdout and "eagle3-pipeline/smollm2 starts a run" in out.stdout
    try:
        runs = wait_for_runs(prefect_stack, uri, 1, time.monotonic() + START_DEADLINE_S,
                             deployment_name="eagle3-pipeline/smollm2")
        assert len(runs) == 1 and runs[0].parameters["config"] == "configs/smollm2-135m.yaml"
        after_a_fence(prefect_stack, prefect_stack.store_uri)
        assert runs_for(prefect_stack, uri) == [], "an upload for smollm2 must not start the tiny pipeline"
    finally:
        cancel(prefect_stack, runs_for(prefect_stack, uri, "eagle3-pipeline/smollm2"))


def test_the_sensor_announces_a_copied_object_once(prefect_stack, tmp_path):
    # A store of its own: the stack's scheduled sensor polls the stack's store and must not answer first.
    store_dir = tmp_path / "sensor-store"
    name = f"sensor-{uuid.uuid4().hex[:8]}"
    copied = store_dir / "datasets" / name / "prompts.jsonl"
    copied.parent.mkdir(parents=True)
    shutil.copyfile(write_dataset(tmp_path / "prompts.jsonl"), copied)  # by other means: no event
    store_uri = f"file://{store_dir.resolve()}"
    uri = f"{store_uri}/datasets/{name}/prompts.jsonl"
    expected = dataset_event(uri, name, hashlib.md5(copied.read_bytes()).hexdigest(), copied.stat().st_size,
                             store_uri)

    assert run_sensor(prefect_stack, store_uri) == [expected["id"]]
    announced_at = time.monotonic()
    try:
        stored = stored_events(prefect_stack, expected["id"])
        assert len(stored) == 1 and stored[0]["payload"] == expected["payload"]
        runs = wait_for_runs(prefect_stack, uri, 1, announced_at + START_DEADLINE_S)
        assert len(runs) == 1, f"the sensor's event started {len(runs)} runs of {DEPLOYMENT}"

        assert run_sensor(prefect_stack, store_uri) == []
        after_a_fence(prefect_stack, store_uri)
        assert len(runs_for(prefect_stack, uri)) == 1
    finally:
        cancel(prefect_stack, runs_for(prefect_stack, uri))
