"""A step run from a flow as its own process (flows/step_process.py): the same record as the step's CLI,
its log lines forwarded, its progress turned back into updates, and a failure that names why."""

from __future__ import annotations

import sys

import pytest

from flows.step_process import StepProcessFailed, discard_spare, extra_env, run_step_process, step_argv, step_env
from steps.lib.runtime import progress
from tests.builders import MAPPING_DATASET, MAPPING_TARGET, mapping_world

T0, D0 = MAPPING_TARGET, MAPPING_DATASET


@pytest.fixture
def world(tmp_path):
    """A store holding a target and a dataset (mapping's inputs) and a config for them."""
    return mapping_world(tmp_path)


def test_a_step_process_returns_the_record_the_step_wrote(world):
    logged: list[str] = []
    record = run_step_process("mapping", world["config"], [], world["store"].uri, {"dataset": D0, "target": T0},
                              log=logged.append, on_progress=lambda u: None)
    store = world["store"]
    assert record["step"] == "mapping" and record["kind"] == "vocab" and store.exists("vocab", record["id"])
    assert record["uri"] == store.artifact_uri("vocab", record["id"])
    assert record["metrics"] == store.manifest("vocab", record["id"]).metrics
    assert record["metrics"]["distinct_tokens"] == 2 and record["seconds"] >= 0
    assert not any(line.startswith(progress.PREFIX) for line in logged)


def test_a_step_process_that_fails_raises_with_its_error_line(world):
    missing = "ab" * 8
    with pytest.raises(StepProcessFailed) as err:
        run_step_process("mapping", world["config"], [], world["store"].uri, {"dataset": missing, "target": T0},
                         log=lambda line: None, on_progress=lambda u: None)
    assert "exited 2 without a record" in str(err.value)
    assert "eaglenest mapping: " in str(err.value) and missing in str(err.value)


def test_inputs_and_options_become_flags_and_serves_env_goes_to_the_process(world):
    argv = step_argv("benchmark", "c.yaml", ["train.epochs=2"], "file:///s", {"export": "e" * 16, "target": T0},
                     {"spec_url": "http://h:1", "baseline_url": None, "attempt": 2})
    assert argv[:3] == [sys.executable, "-m", "steps.benchmark"]
    assert " ".join(argv[3:]) == (f"--config c.yaml --json --store file:///s --set train.epochs=2 --export {'e' * 16} "
                                  f"--target {T0} --spec-url http://h:1 --attempt 2")
    serve = step_argv("serve", "c.yaml", [], None, {"export": "e" * 16, "target": T0}, {"env": {"A": "1"}})
    assert "--env" not in serve and "--store" not in serve
    assert extra_env({"env": {"SGLANG_X": 3}}) == {"SGLANG_X": "3"} and extra_env({}) == {}
    assert step_env()[progress.LINES_ENV] == "1"


def test_the_next_step_process_is_started_ahead_and_the_last_step_leaves_none(world):
    import flows.step_process as sp

    discard_spare()
    run_step_process("mapping", world["config"], [], world["store"].uri, {"dataset": D0, "target": T0},
                     log=lambda line: None, on_progress=lambda u: None)
    spare = sp._spare
    assert spare is not None and spare.poll() is None          # importing torch for the next step already
    with pytest.raises(StepProcessFailed):                    # the gate runs in that spare, and starts none
        run_step_process("gate", world["config"], [], world["store"].uri,
                         {"export": "ab" * 8, "target": T0, "benchmark": "cd" * 8},
                         log=lambda line: None, on_progress=lambda u: None)
    assert spare.poll() is not None and sp._spare is None
    assert sp.LAST_STEP == "gate"


def test_prefects_own_sigterm_handler_is_left_in_place_so_a_cancel_is_a_cancel():
    """Prefect acknowledges a cancel only while its SIGTERM handler is installed (else the run and its step end
    Crashed): with any handler there, the step process forwards SIGHUP only and stops its child when the handler
    raises; with none, it forwards SIGTERM too."""
    import signal

    from flows.step_process import signals_to_forward

    def raising(signum, frame):
        raise RuntimeError("TerminationSignal")

    before = signal.signal(signal.SIGTERM, raising)
    try:
        assert signals_to_forward() == (signal.SIGHUP,)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        assert signals_to_forward() == (signal.SIGTERM, signal.SIGHUP)
    finally:
        signal.signal(signal.SIGTERM, before)
