"""The orchestrator's branch after the gate (flows/pipeline.py `serve_benchmark_gate`): which verdicts get
one relaunch of serve + benchmark, and which leave the server alone.

The steps are replaced by a recorder that answers each call with the record a real step would return
(the gate's decision in `meta`), so the branching itself is what runs here; the real steps behind it
run in tests/unit/test_gate_relaunch.py (the relaunch after F1) and tests/integration/test_orchestration.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from prefect.logging import disable_run_logger

from flows.pipeline import serve_benchmark_gate

F1 = {"id": "F1", "status": "fail", "evidence": "server runs --speculative-algorithm EAGLE",
      "fix": "restart with --speculative-algorithm EAGLE3"}
RELAUNCH = {"row": "F1", "applicable": True, "action": "relaunch", "how": "relaunch with the derived command"}


class Steps:
    """Records every step call; the gate answers with the scripted verdicts, one per call."""

    def __init__(self, verdicts: list[dict[str, Any]]):
        self.verdicts, self.calls = list(verdicts), []

    def __call__(self, name: str, key: str | None = None, options: dict[str, Any] | None = None,
                 **inputs: str) -> str:
        label = key or name
        self.calls.append((label, options or {}))
        meta = self.verdicts.pop(0) if name == "gate" else {}
        self.done[label] = {"id": f"{label}-id", "meta": meta}
        return f"{label}-id"


def run(verdicts: list[dict[str, Any]], spec_url: str | None = None) -> tuple[dict[str, Any], Steps]:
    steps, done = Steps(verdicts), {}
    steps.done = done
    with disable_run_logger():
        decision = serve_benchmark_gate(steps, done, export="e", target="t", spec_url=spec_url, baseline_url=None)
    return decision, steps


@pytest.mark.parametrize("verdict", ["zero-acceptance", "degraded"])
def test_a_fault_a_relaunch_fixes_gets_one_more_serve_and_benchmark(verdict):
    first = {"verdict": verdict, "reasons": ["live τ 1.000"], "fix": RELAUNCH, "diagnosis": [F1]}
    second = {"verdict": "promote", "reasons": ["live τ 1.400 ≥ 1.2"], "fix": None, "diagnosis": []}
    decision, steps = run([first, second])
    assert [label for label, _ in steps.calls] == ["serve", "benchmark", "gate", "serve-retry", "benchmark-retry",
                                                   "gate-retry"]
    assert dict(steps.calls)["benchmark-retry"]["attempt"] == 2     # a new benchmark id: measured again
    assert decision["verdict"] == "promote" and decision["retried_for"] == RELAUNCH


def test_a_server_this_run_did_not_start_is_never_relaunched():
    theirs = {**RELAUNCH, "applicable": False, "action": None}
    first = {"verdict": "zero-acceptance", "reasons": ["live τ 1.000"], "fix": theirs, "diagnosis": [F1]}
    decision, steps = run([first], spec_url="http://127.0.0.1:9")
    assert [label for label, _ in steps.calls] == ["benchmark", "gate"]        # no serve at all
    assert decision["verdict"] == "zero-acceptance" and "retried_for" not in decision


@pytest.mark.parametrize("verdict", ["reject", "promote", "current"])
def test_verdicts_about_the_draft_are_not_retried(verdict):
    decision, steps = run([{"verdict": verdict, "reasons": [], "fix": None, "diagnosis": []}])
    assert [label for label, _ in steps.calls] == ["serve", "benchmark", "gate"]
    assert decision["verdict"] == verdict


def test_a_second_failure_after_the_relaunch_is_final():
    first = {"verdict": "zero-acceptance", "reasons": ["live τ 1.000"], "fix": RELAUNCH, "diagnosis": [F1]}
    decision, steps = run([first, first])
    assert sum(label.startswith("serve") for label, _ in steps.calls) == 2      # one relaunch, not a loop
    assert decision["verdict"] == "zero-acceptance" and decision["retried_for"] == RELAUNCH
