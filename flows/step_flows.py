"""One Prefect flow per step: a thin wrapper that calls `steps.<name>.run()` with artifact ids.

Each flow is also a deployment (`deploy/prefect.yaml`: `<step>/local`, `<step>/docker`, `<step>/k8s`), so
on a cluster every step runs in its own container on the pool of its hardware class, and the
orchestrator (`flows/pipeline.py`) starts it with `run_deployment`. The flow returns the step's
**record** — artifact kind, id, URI, wall seconds, metrics, meta — never a tensor: the data stays in
the store, and the record is persisted so the parent (another process) can read it.

Long steps report progress through `steps/lib/runtime/progress.py`; here it becomes a progress artifact.

On the local pool the pipeline calls these flows as subflows (no deployment run, no worker, no second
Prefect process) with `isolated=True`: the step then runs as `python -m steps.<step>` in a child process
(`flows/step_process.py`), so the orchestrator never imports torch and each step's memory is freed when it
ends. A deployment run (a container, a process worker) runs the step in its own flow process.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Failed, State

from flows.parameters import BadParameter, Refused, check_config, check_store, described, install_quiet_outcomes
from flows.step_process import run_step_process
from flows.ui import ProgressArtifacts, step_artifacts
from steps.lib.artifacts import DRAFT_LOG_FILE
from steps.lib.config import find_config
from steps.lib.runtime import progress
from steps.lib.runtime.redaction import install_log_redaction
from steps.registry import DEFAULT_CONFIG, STEPS, call_step, open_config


def run_step_reporting(step: str, config: str, overrides: list[str] | None, store_uri: str | None,
                       inputs: dict[str, str], options: dict[str, Any] | None = None, *,
                       isolated: bool = False) -> dict[str, Any]:
    """`run_step` with its progress shown as Prefect progress artifacts (and log lines), its result logged
    and published as the step run's own artifacts; every log line (the step's and Prefect's, sent to the API)
    without URL credentials. `isolated`: the step runs in a child process (`flows/step_process.py`)."""
    for name in ("", "prefect"):
        install_log_redaction(logging.getLogger(name))
    logger = get_run_logger()
    cfg, store = open_config(config, overrides, store_uri)
    logger.info("%s: started (%s)", step, ", ".join(f"{k} {v}" for k, v in inputs.items()) or "no inputs")
    listener = ProgressArtifacts(step, cfg.name, log=logger.info)
    if isolated:
        record = run_step_process(step, str(find_config(config).resolve()), overrides, store.uri, inputs, options,
                                  log=logger.info, on_progress=listener)
    else:
        with progress.listening(listener):
            record = call_step(step, cfg, store, inputs, options)
    logger.info("%s → %s (%.1f s)", step, record["uri"], record["seconds"])
    try:
        step_artifacts(step, record, cfg.name, plot_png=_file_bytes(store, record, PLOTS.get(step)),
                       train_log=_train_log(store, record) if step == "train" else None)
    except Exception as err:  # noqa: BLE001 — the artifact is stored; a UI hiccup must not fail the step
        logger.warning("%s: could not publish its artifacts: %s", step, err)
    return record


#: step → the image its artifact holds, shown on the step's run
PLOTS = {"benchmark": "benchmark.png"}


def _file_bytes(store: Any, record: dict[str, Any], rel: str | None) -> bytes | None:
    if rel is None or rel not in {f["path"] for f in store.manifest(record["kind"], record["id"]).files}:
        return None
    return store.fetch_file(record["kind"], record["id"], rel).read_bytes()


def _train_log(store: Any, record: dict[str, Any]) -> list[dict[str, Any]] | None:
    raw = _file_bytes(store, record, DRAFT_LOG_FILE)
    return [json.loads(line) for line in raw.decode().splitlines() if line.strip()] if raw else None


def _step_flow(step: str):
    @described
    def step_flow(config: str = DEFAULT_CONFIG, overrides: list[str] | None = None, store: str | None = None,
                  inputs: dict[str, str] | None = None, options: dict[str, Any] | None = None,
                  isolated: bool = False) -> dict[str, Any] | State:
        """One step as its own flow run: its record (kind, id, URI, seconds, metrics, meta)."""
        try:
            check_store(store, check_config(config, overrides))
        except BadParameter as err:   # one line as the run's message, before the step starts
            get_run_logger().error("%s", err)
            return Failed(message=str(err), data=Refused(str(err)))
        return run_step_reporting(step, config, overrides, store, inputs or {}, options, isolated=isolated)

    # one function name per step: Prefect keys a subflow's run in its parent by the function's name and code,
    # so ten flows sharing one would find each other's runs (a retried pipeline got target's record back as
    # its benchmark's)
    step_flow.__name__ = step_flow.__qualname__ = f"{step}_flow"
    return flow(name=step, description=f"eaglenest step `eaglenest {step}`: {STEPS[step].help} "
                                       f"({STEPS[step].hardware} pool)",
                persist_result=True, flow_run_name=f"{step}-{{config}}", log_prints=True)(step_flow)


def flow_of(step: str) -> Any:
    """The flow of `step` (`<step>_flow` below)."""
    return globals()[f"{step}_flow"]


install_quiet_outcomes()

# The Prefect entrypoints `flows/step_flows.py:<step>_flow` (deploy/prefect.yaml): Prefect runs this file and
# looks the name up, so generating them from the registry is enough; tests/unit/test_deploy.py checks that
# prefect.yaml names exactly these.
for _step in STEPS:
    globals()[f"{_step}_flow"] = _step_flow(_step)
