"""End to end on configs/tiny.yaml through the demo entry point (a Prefect flow): the trained draft
must clearly beat an untrained one on held-out MT-bench prompts, and every artifact must verify."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from steps.store import open_store


@pytest.fixture(scope="module")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.mark.slow
def test_tiny_demo_trained_draft_beats_untrained(tmp_path_factory, prefect_server):
    from flows import demo

    out = tmp_path_factory.mktemp("demo")
    store_uri = f"file://{tmp_path_factory.mktemp('store')}"
    assert demo.main(["--config", "configs/tiny.yaml", "--out", str(out), "--store", store_uri]) == 0
    summary = json.loads((out / "summary.json").read_text())

    for field in ("acceptance_length", "acceptance_length_random_draft", "per_position_acceptance",
                  "num_steps", "target", "target_dir", "store", "steps", "export_dirs"):
        assert field in summary, field
    assert summary["num_steps"] == 4 and len(summary["per_position_acceptance"]) == 4
    assert set(summary["steps"]) == {"target", "datagen", "extract", "mapping", "train", "export", "verify"}
    # The control reuses every artifact up to training (content-addressed ids): only these differ.
    assert set(summary["control_steps"]) == {"train", "export", "verify"}

    tau, tau_untrained = summary["acceptance_length"], summary["acceptance_length_random_draft"]
    assert tau_untrained <= 1.2, tau_untrained
    assert tau >= tau_untrained + 0.4, (tau, tau_untrained)

    assert (Path(summary["target_dir"]) / "config.json").is_file()
    for engine in ("sglang", "vllm"):
        assert (Path(summary["export_dirs"][engine]) / "config.json").is_file()
    store = open_store(store_uri)
    for record in summary["steps"].values():
        kind, art_id = record["uri"].rstrip("/").split("/")[-2:]
        store.verify(kind, art_id)
