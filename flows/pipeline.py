"""The eagle3-pipeline flow: one task per step, one line per arrow of the DESIGN.md diagram.

    target ─► datagen ─► extract ─► mapping ─► train ─► export ─► verify ─► serve ─► benchmark ─► gate

`mode="local"` runs each step in this process; `mode="deployments"` gives each step its own flow run:
on a cluster (`pool` docker / k8s) the deployment `<step>/<step>-<pool>`, its own container on the pool
of its hardware class, started with `run_deployment`; on the local process pool a subflow of this run
whose step runs as its own `python -m steps.<step>` process (`flows/step_process.py`). Either way each
step call is a task with a persisted result and a cache policy scoped to this flow run, so retrying a
failed run re-runs only the failed step and those after it; the earlier ones show as Cached. Prefect
does not fail a parent when a child run fails: `step_task` raises for it.

After the benchmark the gate decides. Promote → move `production` inside a transaction
(`flows/promotion.py`); the run ends Completed, named `Promoted`. A challenger that is not better ends
`Rejected` (Completed: a normal outcome, the reasons in its message), production re-measured as it
recorded ends `Current`. Zero acceptance, or production re-measured below its own record (`degraded`)
→ the gate ran the doctor; a fault this run can fix (F1, F6 on a server it launched) gets one relaunch
of serve + benchmark; otherwise `production` stays where it was and the run ends Failed with the
diagnosis in its report (and the rollback automation looks at it). Either way the last log lines say
the verdict, τ, speedup and where the export is.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal
from uuid import UUID

from prefect import flow, get_run_logger, task
from prefect.cache_policies import INPUTS, RUN_ID, TASK_SOURCE
from prefect.client.schemas.objects import FlowRun
from prefect.context import TaskRunContext
from prefect.exceptions import TerminationSignal
from prefect.logging.handlers import APILogHandler
from prefect.states import Completed, Failed, Pending, State

from flows import ui
from flows.parameters import (
    BadParameter,
    Outcome,
    Refused,
    check_dataset,
    check_pipeline,
    described,
    install_quiet_outcomes,
)
from flows.promotion import current_flow_run_id, promote_in_transaction
from flows.reuse import remember, resolve
from flows.step_flows import flow_of, run_step_reporting
from flows.step_process import warm_up
from steps.lib.config import PipelineConfig, find_config, load_config
from steps.lib.store import open_store, store_uri_for
from steps.registry import skipped

install_quiet_outcomes()

__all__ = ["StepRunFailed", "eagle3_pipeline", "step_task"]


#: the process pool of one machine (deploy/prefect.yaml `local`): its steps run as subflows of the pipeline
LOCAL_POOL = "local"


class StepRunFailed(RuntimeError):
    """A step's own flow run (a deployment run or a subflow) ended in a state other than Completed."""


@task(name="step", task_run_name="{label}", persist_result=True, cache_policy=INPUTS + TASK_SOURCE + RUN_ID)
def step_task(label: str, step: str, config: str, overrides: list[str], store: str | None, inputs: dict[str, str],
              options: dict[str, Any], mode: str, pool: str, reuse: bool = True) -> dict[str, Any]:
    """Run one step in-process or as the deployment `<step>/<step>-<pool>`; its record either way. A call
    whose artifact is already stored is answered from the store's call index without a child run
    (`flows/reuse.py`; `reuse=False` or a second call under another label always runs).

    `label` names the call ("serve", "serve-retry"): part of the cache key, so a deliberate second
    call of a step in the same run is not served from the first one's cache.
    """
    cfg = load_config(find_config(config), overrides)
    st = open_store(store_uri_for(store, cfg.store))
    hit, key = resolve(st, step, cfg.model_dump(mode="json"), inputs, options) if label == step else (None, None)
    if hit is not None and reuse:
        get_run_logger().info("%s: reused %s (no %s run)", step, hit["uri"],
                              "step" if mode == "local" else "child")
        return hit
    record = _run_call(step, config, overrides, store, inputs, options, mode, pool)
    if key is not None:
        remember(st, key, record)
    return record


def _run_call(step: str, config: str, overrides: list[str], store: str | None, inputs: dict[str, str],
              options: dict[str, Any], mode: str, pool: str) -> dict[str, Any]:
    if mode == "local":
        return run_step_reporting(step, config, overrides, store, inputs, options)
    parameters = {"config": config, "overrides": overrides, "store": store, "inputs": inputs, "options": options}
    # the child run is filed under this step's own task run: Prefect's own subflow call and `run_deployment`
    # each add a stand-in task run for the child, and the run graph then drew every step twice
    parent = TaskRunContext.get().task_run.id
    if pool == LOCAL_POOL:
        # a subflow of this run (its own run in the UI graph) whose step is a child process: no worker
        # pick-up and no second Prefect start-up per step (benchmarks/README.md: that was most of the overhead)
        name = f"{step} (subflow)"
        child = outside_task(lambda: run_subflow(flow_of(step), {**parameters, "isolated": True}, parent))
    else:
        name = f"{step}/{step}-{pool}"   # deploy/prefect.yaml: `<step>-<local|docker|k8s>` under each step flow
        child = run_deployment_under(name, parameters, parent)
    child_state = child.state
    if not child_state or not child_state.is_completed():
        state = child_state.type.value if child_state else "unknown"
        raise StepRunFailed(f"{name}: flow run {child.name} ended {state}: "
                            f"{child_state.message if child_state else ''}")
    return child_state.result()


def run_subflow(step_flow: Any, parameters: dict[str, Any], parent_task_run_id: UUID) -> FlowRun:
    """Run `step_flow` here as a child of the task run `parent_task_run_id`; its flow run, final state set."""
    from prefect.client.orchestration import get_client
    from prefect.context import TagsContext
    from prefect.flow_engine import run_flow

    with get_client(sync_client=True) as client:
        recorded(client, parent_task_run_id)
        child = client.create_flow_run(flow=step_flow, parameters=step_flow.serialize_parameters(parameters),
                                       state=Pending(), parent_task_run_id=parent_task_run_id,
                                       tags=TagsContext.get().current_tags)
        state = run_flow(step_flow, flow_run=child, parameters=parameters, return_type="state")
        child = client.read_flow_run(child.id)
    child.state = state         # the engine's own state object: its result is read without another lookup
    return child


def recorded(client: Any, task_run_id: UUID, timeout_s: float = 60.0) -> None:
    """Wait until the server has recorded the task run `task_run_id`: Prefect 3 files a task run from the events
    it emits, a moment after the task starts, and a child naming a parent not yet in the database is refused
    (409, a foreign key)."""
    import time

    from prefect.exceptions import ObjectNotFound

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.read_task_run(task_run_id)
            return
        except ObjectNotFound:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def run_deployment_under(name: str, parameters: dict[str, Any], parent_task_run_id: UUID,
                         poll_s: float = 1.0) -> FlowRun:
    """Start the deployment `name` as a child of the task run `parent_task_run_id` and wait for its end, polling
    every `poll_s` (Prefect's default 5 s was up to 5 s lost per step); its flow run."""
    import time

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(name)
        recorded(client, parent_task_run_id)
        child = client.create_flow_run_from_deployment(deployment.id, parameters=parameters,
                                                       parent_task_run_id=parent_task_run_id)
        while not (child.state and child.state.is_final()):
            time.sleep(poll_s)
            child = client.read_flow_run(child.id)
    return child


@contextmanager
def cancelled_not_crashed() -> Iterator[None]:
    """A cancelled run's running step task ends `Cancelled`, like the run and the step's own run: Prefect
    3.9.1's task engine calls every TerminationSignal a crash (its flow engine tells a cancel apart), and a
    Crashed task counts as a failure on the dashboard. The run's own state (Cancelling) says it was a cancel."""
    try:
        yield
    except TerminationSignal:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
        from prefect.states import Cancelled

        run_id = current_flow_run_id()
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(UUID(run_id)).state if run_id else None
            if state is not None and (state.is_cancelling() or state.is_cancelled()):
                crashed = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(run_id)])))
                for task_run in crashed:
                    if task_run.state and task_run.state.is_crashed():
                        client.set_task_run_state(task_run.id, Cancelled(message="the run was cancelled"), force=True)
        raise


def outside_task(call: Callable[[], Any]) -> Any:
    """`call()` without this task's run context: a subflow started inside a task still sees the task's
    context, so Prefect would file the step's logs under the parent's task run instead of the step's run."""
    context = contextvars.copy_context()
    context.run(TaskRunContext.__var__.set, None)
    return context.run(call)


def run_name() -> str:
    """A triggered run is named after its dataset (`support-chats/prompts.jsonl on tiny`); any other keeps
    the name Prefect gave it."""
    from prefect.runtime import flow_run

    params = flow_run.parameters
    dataset, config = params.get("dataset"), str(params.get("config") or "")
    if not dataset:
        return flow_run.name
    name = "/".join(dataset.rstrip("/").split("/")[-2:])
    return f"{name} on {config.rsplit('/', 1)[-1].removesuffix('.yaml')}"


def dataset_overrides(dataset: str | None) -> list[str]:
    """An uploaded dataset file replaces the config's prompt sources."""
    return [] if not dataset else [f'dataset.sources=[{{kind: file, path: "{dataset}"}}]']


@flow(name="eagle3-pipeline", log_prints=True, persist_result=True, flow_run_name=run_name)
@described
def eagle3_pipeline(config: str = "configs/tiny.yaml", overrides: list[str] | None = None, store: str | None = None,
                    mode: Literal["local", "deployments"] = "local", pool: str = "local", dataset: str | None = None,
                    spec_url: str | None = None, baseline_url: str | None = None,
                    through: Literal["verify", "gate"] = "gate",
                    reuse: bool = True) -> dict[str, dict[str, Any]] | State:
    """Train, export, verify, serve, benchmark and gate one EAGLE-3 drafter; returns each step's record
    (through the gate: as the data of a final state named after the verdict). Every parameter is checked
    before any step runs: one that does not hold ends the run Failed with one line naming it and the fix."""
    try:
        cfg, store_uri = check_pipeline(config=config, overrides=list(overrides or []), store=store, mode=mode,
                                        pool=pool, spec_url=spec_url, baseline_url=baseline_url, through=through)
        if dataset:
            cfg = check_dataset(dataset, config, list(overrides or []) + dataset_overrides(dataset))
    except BadParameter as err:
        return refused(err)
    overrides = list(overrides or []) + dataset_overrides(dataset)
    if mode == "deployments" and pool == LOCAL_POOL:
        warm_up()       # the first step's process imports torch while this run loads its config and store
    done: dict[str, dict[str, Any]] = {}

    def step(name: str, key: str | None = None, options: dict[str, Any] | None = None, **inputs: str) -> str:
        # a gate over a measurement answered from the store reads only the store (no server to examine):
        # decided in this process rather than in a child run of its own
        stored = any(r["id"] == inputs.get("benchmark") and r.get("reused") for r in done.values())
        call_mode = "local" if name == "gate" and stored else mode
        with cancelled_not_crashed():
            record = step_task(key or name, name, config, overrides, store_uri, inputs, options or {}, call_mode,
                               pool, reuse)
        done[key or name] = record
        return record["id"]

    target = step("target")
    dataset_id = step("datagen", target=target)
    # online (train.hidden_states): no extract, no hidden artifact; train runs the target over the dataset
    hidden = dataset_id if skipped("extract", cfg) else step("extract", target=target, dataset=dataset_id)
    vocab = step("mapping", dataset=dataset_id, target=target)
    draft = step("train", target=target, hidden=hidden, vocab=vocab)
    export = step("export", draft=draft, target=target)
    step("verify", export=export, target=target)
    if through == "verify":
        return done

    decision = serve_benchmark_gate(step, done, export=export, target=target, spec_url=spec_url,
                                    baseline_url=baseline_url)
    return finish(cfg, config, store_uri, done, decision, dataset)


def refused(err: BadParameter) -> State:
    """The run's end when a parameter does not hold: Failed, its message the one line (no traceback)."""
    get_run_logger().error("%s", err)
    return Failed(message=str(err), data=Refused(str(err)))


def serve_benchmark_gate(step: Any, done: dict[str, dict[str, Any]], *, export: str, target: str,
                         spec_url: str | None, baseline_url: str | None) -> dict[str, Any]:
    """serve → benchmark → gate, with one relaunch when the gate names a fault a relaunch fixes."""
    urls = {"spec_url": spec_url, "baseline_url": baseline_url}
    if spec_url is None:          # a server someone else runs is not ours to start
        step("serve", export=export, target=target)
    bench = step("benchmark", options=urls, export=export, target=target)
    step("gate", options={"spec_url": spec_url}, export=export, target=target, benchmark=bench)
    decision = done["gate"]["meta"]
    fix = decision.get("fix")
    if fix and fix["applicable"]:    # a fix exists only where the gate diagnosed the verdict
        get_run_logger().warning("%s, %s: %s; retrying serve + benchmark once", decision["verdict"], fix["row"],
                                 fix["how"])
        step("serve", key="serve-retry", export=export, target=target)
        bench = step("benchmark", key="benchmark-retry", options={**urls, "attempt": 2}, export=export, target=target)
        step("gate", key="gate-retry", options={"spec_url": spec_url}, export=export, target=target, benchmark=bench)
        decision = {**done["gate-retry"]["meta"], "retried_for": fix}
    return decision


def launch_command(cfg: PipelineConfig, config: str, store: Any, export_id: str, target_id: str) -> str:
    """The exact SGLang launch command for the export (paths local to a file:// store); for a remote store,
    the command that prints it where the export is fetched (`eaglenest serve` resolves the target)."""
    if not store.uri.startswith("file://"):
        return f"eaglenest serve --config {config} --store {store.uri} --draft {export_id} --print-command"
    from steps.lib.artifacts import export_dir, target_dir
    from steps.lib.serving.start import build_sglang_command

    return ui.shell_lines(build_sglang_command(cfg, target_path=target_dir(store, target_id),
                                               draft_dir=export_dir(store, export_id, "sglang")))


def write_launch(store: Any, export_id: str, command: str) -> str:
    """The SGLang launch command as a script beside the export's artifacts (`<store>/launch/<id>-sglang.sh`,
    a file store's): a log line names it, short enough that `--watch` does not wrap it. Its local path."""
    import tempfile
    from pathlib import Path

    key = f"{LAUNCH_PREFIX}/{export_id}-sglang.sh"
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "launch.sh"
        script.write_text(f"#!/bin/sh\n# SGLang serving export {export_id} (eaglenest; flags derived from the export)\n"
                          f"exec {command}\n")
        store.put_object(key, script)
    return store.object_uri(key).removeprefix("file://")


#: where `write_launch` puts launch scripts under the store root (beside artifacts/, aliases/, calls/)
LAUNCH_PREFIX = "launch"


#: the run's final state per gate verdict, named after it. A verdict about the draft is a normal outcome a
#: Prefect user reads at a glance (Completed); one about serving (zero acceptance, production degraded) fails
#: the run. Neither moved `production`, so neither starts the rollback automation (it acts on runs tagged
#: `flows.promotion.MOVED_TAG` only).
STATE_NAMES = {"promote": "Promoted", "current": "Current", "reject": "Rejected",
               "zero-acceptance": "ZeroAcceptance", "degraded": "Degraded"}
COMPLETED_VERDICTS = ("promote", "current", "reject")
OUTCOMES = {"promote": "promoted", "current": "already in production, and it still holds",
            "reject": "rejected: production stays",
            "degraded": "production no longer holds its recorded numbers behind this server",
            "zero-acceptance": "zero acceptance: production stays"}


def finish(cfg: PipelineConfig, config: str, store_uri: str, done: dict[str, dict[str, Any]], decision: dict[str, Any],
           dataset: str | None) -> State:
    """Promote (transaction) or not, publish the table and the report, log the result; the run's final state."""
    config_name, store = cfg.name, open_store(store_uri)
    verdict = decision["verdict"]
    if verdict == "promote":
        candidate = decision["candidate"]
        promote_in_transaction(store_uri, candidate["export"],
                               {"benchmark": candidate["benchmark"], "tau": candidate["tau"],
                                "speedup": candidate["speedup"], "flow_run_id": current_flow_run_id(),
                                "config": config_name})
    bench = next(r for k, r in reversed(done.items()) if k.startswith("benchmark"))
    plot = store.fetch_file("benchmark", bench["id"], "benchmark.png").read_bytes()
    # a launch line only for a draft the gate let through: a refused one is not for serving
    launch = launch_command(cfg, config, store, done["export"]["id"], done["target"]["id"]) \
        if verdict in ("promote", "current") else None
    launch_file = write_launch(store, done["export"]["id"], launch) if launch and store.uri.startswith("file://") \
        else None
    result = ui.run_result(done, decision, export_uri=store.artifact_uri("export", done["export"]["id"]),
                           launch=launch, launch_file=launch_file)
    report = ui.run_report(config_name, done, dataset=dataset, decision=decision,
                           production=store.get_alias("production"), plot_png=plot,
                           outcome=OUTCOMES.get(verdict, verdict), result=result)
    ui.metrics_table(done, config_name)
    result["report"] = ui.publish_report(config_name, report)
    logger = get_run_logger()
    for line in ui.result_lines(result):   # the last lines of the log: what `prefect deployment run --watch` ends with
        logger.info(line)
    # ship them before the final state: `--watch` stops listening a few seconds after a terminal state
    APILogHandler().flush()
    message = ui.state_message(result)     # the run's header in the UI: verdict, τ, the draft, the report
    if verdict in COMPLETED_VERDICTS:
        return Completed(name=STATE_NAMES[verdict], message=message, data=done)
    # a Failed state's data must be an exception (Prefect raises it for whoever reads the result): an Outcome,
    # which logs no traceback; the step records stay in the store and the report
    return Failed(name=STATE_NAMES.get(verdict, "Failed"), message=message, data=Outcome(message))
