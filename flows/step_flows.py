"""One Prefect flow per step: a thin wrapper that calls `steps.<name>.run()` with artifact ids.

Each flow is also a deployment (`deploy/prefect.yaml`: `<step>/local`, `<step>/docker`, `<step>/k8s`), so
on a cluster every step runs in its own container on the pool of its hardware class, and the
orchestrator (`flows/pipeline.py`) starts it with `run_deployment`. The flow returns the step's
**record** — artifact kind, id, URI, wall seconds, metrics, meta — never a tensor: the data stays in
the store, and the record is persisted so the parent (another process) can read it.

Long steps report progress through `steps/progress.py`; here it becomes a progress artifact.
"""

from __future__ import annotations

import importlib
import time
from typing import Any

from prefect import flow, get_run_logger

from flows.ui import ProgressArtifacts
from steps import progress
from steps.config import find_config, load_config
from steps.store import open_store, store_uri_for

#: step → (module, the artifact ids its run() takes, in order; options it accepts as keyword arguments)
STEPS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "target": ("steps.target", (), ()),
    "datagen": ("steps.datagen", ("target",), ()),
    "extract": ("steps.extract", ("target", "dataset"), ()),
    "mapping": ("steps.mapping", ("dataset", "target"), ()),
    "train": ("steps.train", ("target", "hidden", "vocab"), ()),
    "export": ("steps.export", ("draft", "target"), ()),
    "verify": ("steps.verify", ("export", "target"), ()),
    "serve": ("steps.serve", ("export", "target"), ("env",)),
    "benchmark": ("steps.benchmark", ("export", "target"), ("baseline_url", "spec_url", "attempt")),
    "gate": ("steps.gate", ("export", "target", "benchmark"), ("spec_url",)),
}
#: where each step runs on a cluster (DESIGN.md: one image per hardware class).
HARDWARE = {"target": "cpu", "mapping": "cpu", "export": "cpu",
            "datagen": "gpu", "extract": "gpu", "train": "gpu", "verify": "gpu",
            "serve": "serve", "benchmark": "serve", "gate": "serve"}


def run_step(step: str, config: str, overrides: list[str] | None, store_uri: str | None,
             inputs: dict[str, str], options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load the config, open the store, call `steps.<step>.run(cfg, store, *inputs, **options)`."""
    module_name, input_names, option_names = STEPS[step]
    missing = [n for n in input_names if n not in inputs]
    if missing:
        raise ValueError(f"step {step!r} needs artifact ids {list(input_names)}; missing {missing}")
    unknown = sorted(set(options or {}) - set(option_names))
    if unknown:
        raise ValueError(f"step {step!r} takes options {list(option_names)}; got unknown {unknown}")
    cfg = load_config(find_config(config), overrides)
    store = open_store(store_uri_for(store_uri, cfg.store))
    module = importlib.import_module(module_name)
    start = time.perf_counter()
    manifest = module.run(cfg, store, *(inputs[n] for n in input_names),
                          **{k: v for k, v in (options or {}).items() if v is not None})
    return {"step": step, "kind": manifest.kind, "id": manifest.id,
            "uri": store.artifact_uri(manifest.kind, manifest.id),
            "seconds": round(time.perf_counter() - start, 2), "metrics": manifest.metrics, "meta": manifest.meta}


def run_step_reporting(step: str, config: str, overrides: list[str] | None, store_uri: str | None,
                       inputs: dict[str, str], options: dict[str, Any] | None = None) -> dict[str, Any]:
    """`run_step` with its progress shown as Prefect progress artifacts and its result logged."""
    with progress.listening(ProgressArtifacts(step)):
        record = run_step(step, config, overrides, store_uri, inputs, options)
    get_run_logger().info("%s → %s (%.1f s)", step, record["uri"], record["seconds"])
    return record


def _step_flow(step: str):
    module_name = STEPS[step][0]

    @flow(name=step, description=f"eaglenest step `python -m {module_name}` ({HARDWARE[step]} pool)",
          persist_result=True,
          flow_run_name=f"{step}-{{config}}", log_prints=True)
    def step_flow(config: str = "configs/tiny.yaml", overrides: list[str] | None = None, store: str | None = None,
                  inputs: dict[str, str] | None = None, options: dict[str, Any] | None = None) -> dict[str, Any]:
        return run_step_reporting(step, config, overrides, store, inputs or {}, options)

    return step_flow


target_flow = _step_flow("target")
datagen_flow = _step_flow("datagen")
extract_flow = _step_flow("extract")
mapping_flow = _step_flow("mapping")
train_flow = _step_flow("train")
export_flow = _step_flow("export")
verify_flow = _step_flow("verify")
serve_flow = _step_flow("serve")
benchmark_flow = _step_flow("benchmark")
gate_flow = _step_flow("gate")
