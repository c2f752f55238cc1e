"""The eagle3-pipeline flow: one task per step, one line per arrow of the DESIGN.md diagram.

    target ─► datagen ─► extract ─► mapping ─► train ─► export ─► verify

Each task calls a step's `run()` with artifact ids and returns a small record (artifact id, URI,
wall seconds, metrics); no tensors cross a task boundary. Steps are idempotent (content-addressed
artifact ids), so a re-run reuses every finished artifact.
"""

from __future__ import annotations

import importlib
import time
from typing import Any

from prefect import flow, get_run_logger, task

from steps.config import find_config, load_config
from steps.store import open_store

#: step name → (module, the artifact inputs its run() takes, in order)
STEPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "target": ("steps.target", ()),
    "datagen": ("steps.datagen", ("target",)),
    "extract": ("steps.extract", ("target", "dataset")),
    "mapping": ("steps.mapping", ("dataset", "target")),
    "train": ("steps.train", ("target", "hidden", "vocab")),
    "export": ("steps.export", ("draft", "target")),
    "verify": ("steps.verify", ("export", "target")),
}


def run_step(step: str, config: str, overrides: list[str] | None, store_uri: str | None,
             inputs: dict[str, str]) -> dict[str, Any]:
    """Load the config, open the store and call `steps.<step>.run(cfg, store, *inputs)`."""
    module_name, input_names = STEPS[step]
    cfg = load_config(find_config(config), overrides)
    store = open_store(store_uri or cfg.store)
    module = importlib.import_module(module_name)
    start = time.perf_counter()
    manifest = module.run(cfg, store, *(inputs[name] for name in input_names))
    return {"step": step, "kind": manifest.kind, "id": manifest.id,
            "uri": store.artifact_uri(manifest.kind, manifest.id),
            "seconds": round(time.perf_counter() - start, 2), "metrics": manifest.metrics}


@task(name="step", task_run_name="{step}", retries=0)
def step_task(step: str, config: str, overrides: list[str] | None, store_uri: str | None,
              inputs: dict[str, str]) -> dict[str, Any]:
    record = run_step(step, config, overrides, store_uri, inputs)
    get_run_logger().info("%s → %s (%.1f s)", step, record["uri"], record["seconds"])
    return record


@flow(name="eagle3-pipeline", log_prints=True)
def eagle3_pipeline(config: str = "configs/tiny.yaml", overrides: list[str] | None = None,
                    store: str | None = None) -> dict[str, dict[str, Any]]:
    """Run the chain in-process; returns each step's record keyed by step name."""
    done: dict[str, dict[str, Any]] = {}

    def step(name: str, **inputs: str) -> str:
        done[name] = step_task(name, config, overrides, store, inputs)
        return done[name]["id"]

    target = step("target")
    dataset = step("datagen", target=target)
    hidden = step("extract", target=target, dataset=dataset)
    vocab = step("mapping", dataset=dataset, target=target)
    draft = step("train", target=target, hidden=hidden, vocab=vocab)
    export = step("export", draft=draft, target=target)
    step("verify", export=export, target=target)
    return done
