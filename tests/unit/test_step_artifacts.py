"""Every step run has its own small artifacts in the Prefect UI (flows/ui.py, flows/step_flows.py): its
metrics table, the benchmark's plot, train's loss / τ_sim curves, and progress artifacts keyed by step
with a bar, an ETA and the loss. A real (temporary) Prefect server; the artifacts are read back from it."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.testing.utilities import prefect_test_harness

from flows import ui
from flows.step_flows import target_flow  # type: ignore[attr-defined]  # generated from the registry
from steps.lib.runtime import progress

RECORD = {"step": "train", "kind": "draft", "id": "d0d0d0d0d0d0d0d0", "uri": "file:///s/artifacts/draft/d0",
          "seconds": 12.5, "metrics": {"final_loss": 2.3456789, "steps": 3, "acc": [0.5, 0.2]}, "meta": {}}
LOG = [{"step": 0, "loss": 5.0}, {"step": 1, "loss": 4.0, "tau_sim": 1.2}, {"step": 2, "loss": 3.0, "tau_sim": 1.4}]
PNG = b"\x89PNG\r\n\x1a\nnot-really-a-plot"


@pytest.fixture(scope="module")
def server():
    with prefect_test_harness(server_startup_timeout=600):
        yield


def artifacts() -> dict[str, Any]:
    with get_client(sync_client=True) as client:
        return {a.key: a for a in client.read_artifacts() if a.key}


def test_a_step_run_publishes_its_metrics_plot_and_curves_and_a_keyed_progress_bar(server):
    logged: list[str] = []

    @flow
    def a_step() -> list[str]:
        listener = ui.ProgressArtifacts("train", "tiny", log=logged.append)
        with progress.listening(listener):
            with progress.bar(total=4, desc="train", unit="step", disable=True) as bar:
                for _ in range(4):
                    bar.update(1)
                    bar.set_postfix(loss="2.346")
        return ui.step_artifacts("train", RECORD, "tiny", plot_png=PNG, train_log=LOG)

    keys = a_step()
    found = artifacts()
    assert keys == ["eagle3-tiny-05-train-metrics", "eagle3-tiny-05-train-plot", "eagle3-tiny-05-train-curves"]
    assert set(keys) <= set(found)
    table = found["eagle3-tiny-05-train-metrics"]
    data = str(table.data)
    assert "final_loss" in data and "2.346" in data and "2.3457" not in data, data
    assert "acc" not in str(table.data), "lists stay in the manifest; the table shows scalars"
    assert base64.b64encode(PNG).decode() in found["eagle3-tiny-05-train-plot"].data
    curves = found["eagle3-tiny-05-train-curves"].data
    assert "loss: 5.000 → 3.000" in curves and "τ_sim (simulated acceptance length): 1.200 → 1.400" in curves
    assert curves.count("data:image/svg+xml;base64,") == 2
    bar = found["eagle3-tiny-05-train-progress"]
    assert bar.type == "progress" and float(bar.data) == 100.0
    assert "ETA" in bar.description and "loss 2.346" in bar.description and "█" in bar.description
    assert logged and logged[-1].startswith("train: 4/4 step (100%)"), logged


def test_a_real_step_flow_names_its_metrics_artifact_after_the_step_and_config(server, tmp_path):
    record = target_flow(config="configs/tiny.yaml", store=f"file://{tmp_path}/store")
    found = artifacts()
    assert record["kind"] == "target"
    table = found["eagle3-tiny-01-target-metrics"]
    assert record["id"] in table.description and "seconds" in str(table.data)


def test_training_curves_skip_a_series_the_log_does_not_have():
    md = ui.training_curves([{"step": 0, "loss": 2.0}, {"step": 1, "loss": 1.0}], "d")
    assert "loss: 2.000 → 1.000" in md and "τ_sim" not in md
    svg = ui.line_chart([(0, 2.0), (1, 1.0)])
    assert svg.startswith("<svg") and "polyline" in svg
