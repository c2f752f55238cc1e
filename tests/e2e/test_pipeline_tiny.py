"""End to end on configs/tiny.yaml through the demo entry point (a Prefect flow): the trained draft
must clearly beat an untrained one on held-out MT-bench prompts, and every artifact must verify.

It runs against the session's one Prefect stack and store, after the orchestration tests (tests/conftest.py
orders e2e last): the tiny pipeline's artifacts are content-addressed, so the trained chain the session's
deployment run (`tiny_pipeline_run`) built is reused here and only the untrained control is computed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from steps.lib.store import open_store

#: How far the trained tiny draft must beat the untrained one (τ 1.00 everywhere). Measured τ of the trained
#: draft (benchmarks/tiny_tau_spread.py, benchmarks/README.md): 1.39-1.80 over seeds 0-3 (1.67 at the config's
#: seed 0; 1 or 2 threads give identical numbers) on one 2-core machine; seed 0 gave 1.53 and 1.34 on two
#: others (the CPU's kernels change greedy datagen, hence the training data). A gain of 0.2 sits below every
#: measurement with room to spare, and far above what a broken draft reaches (the EAGLE flag: 1.03-1.05).
MIN_GAIN = 0.2


@pytest.mark.slow
def test_tiny_demo_trained_draft_beats_untrained(tmp_path_factory, prefect_stack):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows import demo

    out = tmp_path_factory.mktemp("demo")
    store_uri = prefect_stack.store_uri
    with temporary_settings(updates={PREFECT_API_URL: prefect_stack.api_url}):
        assert demo.main(["--config", "configs/tiny.yaml", "--out", str(out), "--store", store_uri]) == 0
    summary = json.loads((out / "summary.json").read_text())

    for field in ("acceptance_length", "acceptance_length_random_draft", "acceptance_length_in_distribution",
                  "per_position_acceptance", "num_steps", "target", "target_dir", "store", "steps", "export_dirs"):
        assert field in summary, field
    assert summary["num_steps"] == 4 and len(summary["per_position_acceptance"]) == 4
    assert set(summary["steps"]) == {"target", "datagen", "extract", "mapping", "train", "export", "verify"}
    # The control reuses every artifact up to training (content-addressed ids): only these differ.
    assert set(summary["control_steps"]) == {"train", "export", "verify"}

    tau, tau_untrained = summary["acceptance_length"], summary["acceptance_length_random_draft"]
    assert tau_untrained <= 1.1, tau_untrained
    assert tau >= tau_untrained + MIN_GAIN, (tau, tau_untrained, summary["per_position_acceptance"])

    assert (Path(summary["target_dir"]) / "config.json").is_file()
    for engine in ("sglang", "vllm"):
        assert (Path(summary["export_dirs"][engine]) / "config.json").is_file()
    store = open_store(store_uri)
    for record in [*summary["steps"].values(), *summary["control_steps"].values()]:
        kind, art_id = record["uri"].rstrip("/").split("/")[-2:]
        store.verify(kind, art_id)


@pytest.mark.slow
def test_eaglenest_pipeline_from_the_shell_reuses_the_stored_chain(prefect_stack, tiny_pipeline_run):
    """`eaglenest pipeline` (the in-process flow a user runs from a shell) on the store the session's deployment
    run filled (`tiny_pipeline_run`, requested here so this test passes alone):
    every step through verify is answered from its content-addressed artifact, the run completes, and the
    records name artifacts that verify. Every step but datagen from the call index; datagen's id depends on
    the device its worker decodes on (flows/reuse.py), so its step runs and returns the stored dataset."""
    import subprocess
    import sys

    from steps.lib.store.ids import utc_now
    from tests.conftest import REPO

    started = utc_now()
    run = subprocess.run([sys.executable, "-m", "flows.cli", "pipeline", "--config", "configs/tiny.yaml",
                          "--store", prefect_stack.store_uri, "--through", "verify", "--json"],
                         cwd=REPO, env=prefect_stack.env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    out = json.loads(run.stdout[run.stdout.index('{\n  "state"'):])     # after any log lines
    assert out["state"] == "Completed"
    assert list(out["records"]) == ["target", "datagen", "extract", "mapping", "train", "export", "verify"]
    store = open_store(prefect_stack.store_uri)
    for name, record in out["records"].items():
        kind, art_id = record["uri"].rstrip("/").split("/")[-2:]
        assert (kind, art_id) == (record["kind"], record["id"]), name
        if name == "datagen":       # its step ran and made nothing: the dataset is the session run's
            assert store.manifest(kind, art_id).created < started, (name, record)
        else:
            assert record.get("reused") is True and record["seconds"] == 0.0, (name, record)   # answered, not run
        store.verify(kind, art_id)
    assert out["records"]["verify"]["metrics"]["tau"] >= 1.0 + MIN_GAIN     # the trained draft, not a control
