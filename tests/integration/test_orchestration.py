"""The pipeline as users run it: `prefect deployment run 'eagle3-pipeline/tiny' --watch` against a real
`prefect server start` and a process worker (the `prefect_stack` fixture), every step its own deployment run.

The session's plain run (`tiny_pipeline_run`, tests/conftest.py) builds the tiny chain and sets `production`;
each test that needs them requests it, so any test here passes alone and in any order:
0. a typo'd parameter fails the run before any step, its one line (file, field, fix) as the state message;
1. that run exits 0 and `production` points at the drafter it built; `--watch` ends with τ, speedup and the
   draft's location; its report and metrics table exist; a challenger the gate rejects ends `Rejected`
   (a Completed state: exit 0, no traceback) and leaves production alone;
2. zero acceptance forced by a server started with the EAGLE flag: the gate records τ ≤ 1.1 and F1, the
   run fails in a state named `ZeroAcceptance` with no traceback, `production` stays, and the report names F1;
3. a later run answers the steps already stored in the parent (no child run for them, but datagen's); a run
   that failed at the benchmark, retried, re-runs only the benchmark and what follows (earlier steps show as Cached).

A CUDA-graph hang at server start (F6) is waited out live once in the suite, on the serve step itself
(tests/unit/test_reference_server.py: both attempts in the serve artifact and in the run report's table).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from uuid import UUID

import pytest

from steps.lib.config import find_config, load_config
from steps.lib.serving import start as serving
from steps.lib.serving.launch import launch
from steps.lib.store import open_store
from tests.builders import free_port
from tests.conftest import DEPLOYMENT, RUN_TIMEOUT_S, prefect, run_pipeline

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


# --- helpers ----------------------------------------------------------------------------------------------

def client(stack):
    from prefect.client.orchestration import SyncPrefectClient
    return SyncPrefectClient(stack.api_url)


def task_states(stack, flow_run_id: UUID) -> dict[str, list[str]]:
    """task run name → its state names, oldest first (a retried run adds a second entry per task)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with client(stack) as c:
        runs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    out: dict[str, list[str]] = {}
    for tr in sorted(runs, key=lambda r: r.created):
        out.setdefault(tr.name, []).append(tr.state.name if tr.state else "?")
    return out


def child_runs(stack, flow_run_id: UUID) -> dict[str, list[str]]:
    """step flow name → state names of the child runs this pipeline run started."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    with client(stack) as c:
        runs = c.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))
        flows = {r.flow_id: c.read_flow(r.flow_id).name for r in runs}
    out: dict[str, list[str]] = {}
    for r in sorted(runs, key=lambda r: r.created):
        out.setdefault(flows[r.flow_id], []).append(r.state.name if r.state else "?")
    return out


def wait_final(stack, flow_run_id: UUID, timeout_s: float = RUN_TIMEOUT_S) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with client(stack) as c:
            state = c.read_flow_run(flow_run_id).state
        if state and state.is_final():
            return state.type.value
        time.sleep(3)
    raise TimeoutError(f"flow run {flow_run_id} not final after {timeout_s} s")


def report_markdown(stack, flow_run_id: UUID) -> str:
    """The run report that pipeline run published (its own version of the keyed artifact: other runs, in any
    order, add newer ones)."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with client(stack) as c:
        found = c.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["eagle3-tiny-00-report"]),
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    assert found, f"no eagle3-tiny-00-report artifact of flow run {flow_run_id}"
    return str(found[-1].data)


def progress_artifacts(stack, flow_run_id: UUID) -> dict[str, float]:
    """bar name → the furthest any progress artifact of this pipeline run's child runs got (percent)."""
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterType,
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
    )

    with client(stack) as c:
        children = c.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))
        arts = c.read_artifacts(artifact_filter=ArtifactFilter(
            type=ArtifactFilterType(any_=["progress"]),
            flow_run_id=ArtifactFilterFlowRunId(any_=[r.id for r in children])))
    best: dict[str, float] = {}
    for a in arts:
        assert a.key and re.fullmatch(r"eagle3-tiny-\d\d-[a-z]+-progress", a.key), (a.key, a.description)
        name = a.key.split("-")[3]      # titled by step, in pipeline order
        best[name] = max(best.get(name, 0.0), float(a.data))
    return best


def gate_decisions(stack, spec_url: str) -> list[dict]:
    """The gate's recorded decisions for the benchmarks of the server at `spec_url` (verdict, τ, reasons)."""
    store = open_store(stack.store_uri)
    found = [store.manifest("gate", g) for g in store.list("gate")]
    return [{"verdict": m.meta["verdict"], "tau": m.meta["candidate"]["tau"], "reasons": m.meta["reasons"],
             "diagnosis": [f"{f['id']} {f['status']}: {f['evidence']}" for f in m.meta["diagnosis"]
                           if f["status"] == "fail"]}
            for m in found if m.config.get("spec_url") == spec_url]


def start_reference_server(stack, port: int, algorithm: str):
    """The production export served by the reference engine with a hand-typed algorithm flag."""
    from steps.lib.artifacts import export_dir, target_dir

    store = open_store(stack.store_uri)
    cfg = load_config(find_config("tiny"))
    production = store.get_alias("production")
    assert production, "no production alias: request the tiny_pipeline_run fixture"
    export_id = production["id"]
    target_id = store.manifest("export", export_id).inputs["target"]
    cmd = serving.build_sglang_command(cfg, target_path=target_dir(store, target_id),
                                     draft_dir=export_dir(store, export_id, "sglang"), port=port,
                                     disable_cuda_graph=False, launcher=serving.LAUNCHERS["reference"])
    cmd[cmd.index("--speculative-algorithm") + 1] = algorithm
    return launch(cmd, log_path=Path(stack.dir) / f"ref-{port}.log", health_url=f"http://127.0.0.1:{port}/health",
                  timeout_s=300, env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})


# --- the tests --------------------------------------------------------------------------------------------

def test_a_typo_in_a_parameter_fails_the_run_in_one_line_before_any_step(prefect_stack):
    code, run_id, out = run_pipeline(prefect_stack, 'overrides=["train.lrr=3e-4"]')
    assert code != 0
    assert "Traceback" not in out and "unexpected exception" not in out, out[-3000:]
    with client(prefect_stack) as c:
        state = c.read_flow_run(run_id).state
    assert state.type.value == "FAILED", state
    # the CLI's line: the file, the field, the fix
    assert state.message.startswith("parameter overrides: ") and "tiny.yaml" in state.message, state.message
    assert "train.lrr: unknown field" in state.message and "-p overrides=" in state.message, state.message
    assert state.message in out
    assert child_runs(prefect_stack, run_id) == {} and task_states(prefect_stack, run_id) == {}


def test_deployment_run_promotes_the_new_drafter(prefect_stack, tiny_pipeline_run):
    code, run_id, out = tiny_pipeline_run
    assert code == 0, out[-4000:]
    store = open_store(prefect_stack.store_uri)
    production = store.get_alias("production")
    # the run's own export: a challenger run (other tests, any order) stores another one but never promotes it
    promoted = re.search(r"draft: (?:file://)?\S+/artifacts/export/([0-9a-f]{16})/sglang", out)
    assert promoted and production["id"] == promoted[1], out[-3000:]
    assert production["meta"]["flow_run_id"] == str(run_id) and promoted[1] in store.list("export")
    assert production["meta"]["tau"] > 1.1
    # where the user looks: `--watch` ends with the verdict, τ, speedup and the draft's locations
    export_dir = store.artifact_uri("export", production["id"]).removeprefix("file://")
    tail = out[out.index("gate: promote"):] if "gate: promote" in out else out[-3000:]
    assert f"τ {production['meta']['tau']:.3f} live" in tail, tail
    assert f"draft: {export_dir}/sglang (SGLang), {export_dir}/vllm (vLLM)" in tail, tail
    assert "finished successfully in 'Promoted'" in tail, tail
    # the launch command in a script beside the export (a log line `--watch` does not wrap), said once
    script = re.search(r"serve it: sh (\S+)", tail)
    assert script and tail.count("serve it:") == 1, tail
    launch = Path(script[1]).read_text()
    assert f"--speculative-draft-model-path {export_dir}/sglang" in launch and "sglang.launch_server" in launch
    assert "--speculative-algorithm EAGLE3" in launch, launch
    # the run's header: verdict, τ, the draft and a link to the report, the report's first line its link
    with client(prefect_stack) as c:
        message = c.read_flow_run(run_id).state.message
    assert message.startswith(f"promote: live τ {production['meta']['tau']:.3f} ≥ "), message
    assert f"draft {export_dir}/sglang" in message and "/artifacts/artifact/" in message, message
    assert re.search(r"report: http://127\.0\.0\.1:\d+/artifacts/artifact/[0-9a-f-]{36}", out), tail
    children = child_runs(prefect_stack, run_id)
    assert set(children) >= {"target", "datagen", "extract", "mapping", "train", "export", "verify", "serve",
                             "benchmark", "gate"}, children
    assert all(states == ["Completed"] for states in children.values()), children
    report = report_markdown(prefect_stack, run_id)
    assert "**promote**" in report and production["id"] in report and "data:image/png;base64," in report
    # the long steps showed progress in the UI, and it reached 100 %
    progress = progress_artifacts(prefect_stack, run_id)
    for step in ("datagen", "extract", "train"):
        assert progress.get(step) == 100.0, progress


def test_a_challenger_the_gate_rejects_ends_rejected_not_failed(prefect_stack, tiny_pipeline_run):
    store = open_store(prefect_stack.store_uri)
    before = store.get_alias("production")
    # another draft (one more epoch) held to a floor no tiny draft reaches: a normal "no", not an error
    code, run_id, out = run_pipeline(prefect_stack, "mode=local", 'overrides=["train.epochs=5", "gate.min_tau=5"]')
    assert code == 0, out[-3000:]
    assert "finished successfully in 'Rejected'" in out, out[-3000:]
    assert re.search(r"gate: reject: live τ \d\.\d{3} < gate\.min_tau 5", out), out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "serve it:" not in out, out[-3000:]       # no launch line for a draft the gate refused
    assert store.get_alias("production") == before
    with client(prefect_stack) as c:
        state = c.read_flow_run(run_id).state
    assert (state.type.value, state.name) == ("COMPLETED", "Rejected") and "gate.min_tau 5" in state.message


def test_zero_acceptance_keeps_production_and_names_f1(prefect_stack, tiny_pipeline_run):
    store = open_store(prefect_stack.store_uri)
    before = store.get_alias("production")
    port = free_port()
    server = start_reference_server(prefect_stack, port, "EAGLE")
    spec_url = f"http://127.0.0.1:{port}"
    try:
        code, run_id, out = run_pipeline(prefect_stack, f"spec_url={spec_url}")
    finally:
        server.stop()
    # judged on what the gate recorded: the production export behind an EAGLE server serves τ ≈ 1.00
    # (SGLang skips fc and swaps in the target's head), the gate calls it zero acceptance and names F1
    decisions = gate_decisions(prefect_stack, spec_url)
    assert [d["verdict"] for d in decisions] == ["zero-acceptance"], (decisions, before)
    assert decisions[0]["tau"] <= 1.1, decisions
    assert any(d.startswith("F1 fail") for d in decisions[0]["diagnosis"]), decisions
    assert code != 0, (decisions, out[-2000:])
    assert store.get_alias("production") == before
    report = report_markdown(prefect_stack, run_id)
    assert "**zero-acceptance**" in report
    assert re.search(r"\| F1 \| FAIL \| [^|]*served with --speculative-algorithm EAGLE:", report), report[:3000]
    assert "not applicable here" in report      # a server this run did not start is not restarted by it
    assert wait_final(prefect_stack, run_id) == "FAILED"
    # an expected verdict: a state named after it, its lines once, no traceback
    with client(prefect_stack) as c:
        assert c.read_flow_run(run_id).state.name == "ZeroAcceptance"
    assert "Traceback" not in out and "unexpected exception" not in out, out[-3000:]
    children = child_runs(prefect_stack, run_id)
    assert children["gate"] == ["Completed"]   # the gate decided; the pipeline refused
    # the session's run stored target..verify for this config: answered in the parent, no child run each, but
    # datagen, whose id depends on the worker's device (flows/reuse.py): its child returns the stored dataset
    assert not {"target", "extract", "mapping", "train", "export", "verify"} & set(children), children
    assert children["datagen"] == ["Completed"], children


def test_a_cancelled_run_is_cancelled_down_the_tree_and_starts_no_rollback(prefect_stack):
    """`prefect flow-run cancel` while a step runs: the run, the step's own run and its task end `Cancelled`
    (Prefect acknowledges the cancel only while its SIGTERM handler is in place), never `Crashed`."""
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterParentFlowRunId

    with client(prefect_stack) as c:
        deployment = c.read_deployment_by_name(DEPLOYMENT)
        # reuse=false: every step a child run of its own, so there is one to be running when the cancel lands
        run = c.create_flow_run_from_deployment(deployment.id, parameters={"store": prefect_stack.store_uri,
                                                                            "reuse": False})
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline:
            children = c.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id])))
            if any(r.state and r.state.is_running() for r in children):
                break
            time.sleep(1)
    cancel = prefect(prefect_stack, "flow-run", "cancel", str(run.id), timeout=120)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    assert wait_final(prefect_stack, run.id) == "CANCELLED"
    children = child_runs(prefect_stack, run.id)
    assert children and all(states[-1] in ("Completed", "Cancelled") for states in children.values()), children
    assert "Cancelled" in {states[-1] for states in children.values()}, children
    tasks = task_states(prefect_stack, run.id)
    assert all(states[-1] in ("Completed", "Cached", "Cancelled") for states in tasks.values()), tasks
    with client(prefect_stack) as c:
        rollbacks = c.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["eaglenest-rollback"])))
    assert f"prefect.flow-run.{run.id}" not in [r.parameters.get("flow_run_id") for r in rollbacks]


def test_retry_after_a_benchmark_failure_reruns_only_what_failed(prefect_stack, tiny_pipeline_run):
    port = free_port()                      # nothing listens yet: the benchmark fails
    # reuse=false: every step a child run even though its artifact is stored, so the retry's children show
    code, run_id, out = run_pipeline(prefect_stack, f"spec_url=http://127.0.0.1:{port}", "reuse=false")
    assert code != 0, out[-3000:]
    assert child_runs(prefect_stack, run_id)["benchmark"] == ["Failed"]

    server = start_reference_server(prefect_stack, port, "EAGLE3")
    try:
        retry = prefect(prefect_stack, "flow-run", "retry", str(run_id), timeout=120)
        assert retry.returncode == 0, retry.stdout + retry.stderr
        final = wait_final(prefect_stack, run_id)
        with client(prefect_stack) as c:
            assert final == "COMPLETED", (c.read_flow_run(run_id).state.message, task_states(prefect_stack, run_id),
                                          child_runs(prefect_stack, run_id))
    finally:
        server.stop()
    tasks = task_states(prefect_stack, run_id)
    for step in ("target", "datagen", "extract", "mapping", "train", "export", "verify"):
        assert tasks[step][-1] == "Cached", (step, tasks)
    children = child_runs(prefect_stack, run_id)
    assert children["benchmark"] == ["Failed", "Completed"], children
    assert children["gate"] == ["Completed"] and children["datagen"] == ["Completed"], children

