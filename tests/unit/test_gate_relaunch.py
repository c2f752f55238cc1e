"""The gate's relaunch (flows/pipeline.py `serve_benchmark_gate`) with the real steps behind it: serve, benchmark
and gate through `steps.registry.call_step` on the bigram world (tests/builders.py), the reference server their
engine. A launcher in front of the reference server starts chosen launches with the wrong algorithm (EAGLE for
the EAGLE-3 draft, F1 for real: the draft's fc is skipped and live τ drops) while the command every check reads
stays the derived one, the way a server image that ignores a flag would. Here the benchmark's launch is the wrong
one: serve's smoke test passed on its own launch, so only the gate can catch it, and its relaunch must undo it.

The recorder double of the same branch (every verdict, a server not ours): tests/unit/test_pipeline_gate.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from prefect.logging import disable_run_logger

from flows.pipeline import serve_benchmark_gate
from steps.lib.serving import start as serving
from steps.registry import call_step
from tests.builders import bigram_world, free_port

#: the reference server, started with EAGLE instead of EAGLE3 on the launches named in argv[2] (1-based, among
#: the speculative ones); every launch's served algorithm appended to argv[1], one JSON line each
WRONG_ALGORITHM_LAUNCHER = '''
import json, os, sys
log, wrong = sys.argv[1], {int(n) for n in sys.argv[2].split(",") if n}
argv = sys.argv[3:]
spec = "--speculative-algorithm" in argv
n = 1 + sum(1 for line in open(log) if json.loads(line)["spec"]) if os.path.exists(log) else 1
if spec and n in wrong:
    argv[argv.index("--speculative-algorithm") + 1] = "EAGLE"
with open(log, "a") as f:
    f.write(json.dumps({"spec": spec, "algorithm": argv[argv.index("--speculative-algorithm") + 1] if spec else None})
            + "\\n")
os.execv(sys.executable, [sys.executable, "-m", "steps.lib.reference.server", *argv])
'''


def world(root: Path, **sections: Any) -> dict[str, Any]:
    """The bigram world, measured cheaply: two held-out prompts, one batch size, short answers."""
    return bigram_world(root, free_port(), verify={"num_prompts": 2, "max_new_tokens": 16},
                        benchmark={"batch_sizes": [1], "num_code_prompts": 0, "max_new_tokens": 16,
                                   "stream_prompts": 1}, **sections)


def launches_wrong(monkeypatch, tmp_path: Path, wrong: list[int]) -> Path:
    """Put the wrong-algorithm launcher in front of the reference server; the file its launches are logged to."""
    script, log = tmp_path / "launcher.py", tmp_path / "launches.jsonl"
    script.write_text(WRONG_ALGORITHM_LAUNCHER)
    monkeypatch.setitem(serving.LAUNCHERS, "reference",
                        (sys.executable, str(script), str(log), ",".join(map(str, wrong))))
    return log


def pipeline(w: dict[str, Any], cfg: Any) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """serve → benchmark → gate as the pipeline runs them, each call a real step on the world's store."""
    done: dict[str, dict[str, Any]] = {}

    def step(name: str, key: str | None = None, options: dict[str, Any] | None = None, **inputs: str) -> str:
        done[key or name] = call_step(name, cfg, w["store"], inputs, options)
        return done[key or name]["id"]

    with disable_run_logger():
        decision = serve_benchmark_gate(step, done, export=w["export_id"], target=w["target_id"],
                                        spec_url=None, baseline_url=None)
    return decision, done


def served(log: Path) -> list[str]:
    return [json.loads(line)["algorithm"] for line in log.read_text().splitlines() if json.loads(line)["spec"]]


def first_gate(done: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return done["gate"]["meta"]


def test_zero_acceptance_behind_a_server_started_with_eagle_is_relaunched_and_the_retry_promotes(monkeypatch,
                                                                                                 tmp_path):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # This world's EAGLE server still accepts some drafts on the pinned prompts (τ 2.5 against EAGLE3's 3.6: the
    # answers reach the bigram's fixed points, where any draft is right), so the gate's zero-acceptance line is
    # raised between the two: the launch is judged as the zero acceptance SGLang serves for F1. (At 1.1, serve's
    # smoke test would refuse such a server at start, before the benchmark.)
    w = world(tmp_path / "w", gate={"min_tau": 1.5, "min_speedup": 0.0, "zero_acceptance_tau": 3.0})
    log = launches_wrong(monkeypatch, tmp_path, wrong=[2])
    decision, done = pipeline(w, w["cfg"])
    # serve's launch, the benchmark's (wrong), then the relaunch: serve-retry's and benchmark-retry's
    assert served(log) == ["EAGLE3", "EAGLE", "EAGLE3", "EAGLE3"], log.read_text()
    assert list(done) == ["serve", "benchmark", "gate", "serve-retry", "benchmark-retry", "gate-retry"]
    zero = first_gate(done)
    assert zero["verdict"] == "zero-acceptance" and zero["candidate"]["tau"] <= 3.0, zero["reasons"]
    f1 = [f for f in zero["diagnosis"] if f["id"] == "F1" and f["status"] == "fail"]
    assert f1 and "EAGLE" in f1[0]["evidence"], zero["diagnosis"]
    assert zero["fix"] == {"row": "F1", "applicable": True, "action": "relaunch",
                           "how": "relaunch with the derived command (--speculative-algorithm EAGLE3)"}
    assert done["benchmark-retry"]["id"] != done["benchmark"]["id"]        # measured again, not reused
    assert decision["verdict"] == "promote" and decision["retried_for"] == zero["fix"], decision
    assert decision["candidate"]["benchmark"] == done["benchmark-retry"]["id"] and decision["candidate"]["tau"] > 3.0


def test_production_behind_a_server_started_with_eagle_is_relaunched_and_holds_again(monkeypatch, tmp_path):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    w = world(tmp_path / "w", gate={"min_tau": 1.5, "min_speedup": 0.0})
    store = w["store"]
    recorded = call_step("benchmark", w["cfg"], store, {"export": w["export_id"], "target": w["target_id"]})
    store.set_alias("production", "export", w["export_id"], meta={"benchmark": recorded["id"],
                                                                  "tau": recorded["metrics"]["tau"]})
    before = store.get_alias("production")
    # a new server setting: production is measured again (a new benchmark id), behind EAGLE on that launch
    cfg = w["cfg"].model_copy(update={"serve": w["cfg"].serve.model_copy(update={"cuda_graph_max_bs": 16})})
    log = launches_wrong(monkeypatch, tmp_path, wrong=[2])
    decision, done = pipeline(w, cfg)
    assert served(log) == ["EAGLE3", "EAGLE", "EAGLE3", "EAGLE3"], log.read_text()
    degraded = first_gate(done)
    assert degraded["verdict"] == "degraded", degraded["reasons"]
    assert any(r.startswith("T=0.0 bs=1: tau ") and "< champion" in r for r in degraded["reasons"]), degraded
    assert "F1" in {f["id"] for f in degraded["diagnosis"] if f["status"] == "fail"}, degraded["diagnosis"]
    assert degraded["fix"]["row"] == "F1" and degraded["fix"]["applicable"] is True
    # relaunched from the derived command, production holds its recorded numbers again; the alias is the
    # orchestrator's to move (flows/pipeline.py `finish`), and nothing here moved it
    assert decision["verdict"] == "current" and decision["retried_for"] == degraded["fix"], decision
    assert decision["candidate"]["tau"] == recorded["metrics"]["tau"]
    assert store.get_alias("production") == before


def test_a_good_tau_behind_a_server_started_with_eagle_is_not_promoted_but_relaunched(monkeypatch, tmp_path):
    """At the default zero-acceptance line, EAGLE's τ 2.5 here would pass every floor: the gate reads the
    algorithm the measured server reported (F1) before promoting, rejects, and the relaunch promotes."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    w = world(tmp_path / "w", gate={"min_tau": 1.5, "min_speedup": 0.0})
    log = launches_wrong(monkeypatch, tmp_path, wrong=[2])
    decision, done = pipeline(w, w["cfg"])
    assert served(log) == ["EAGLE3", "EAGLE", "EAGLE3", "EAGLE3"], log.read_text()
    rejected = first_gate(done)
    assert rejected["verdict"] == "reject" and rejected["candidate"]["tau"] > 1.5, rejected
    assert rejected["reasons"][0].startswith("measured server: EAGLE-3 draft served with --speculative-algorithm EAGLE")
    assert rejected["fix"] == {"row": "F1", "applicable": True, "action": "relaunch",
                               "how": "relaunch with the derived command (--speculative-algorithm EAGLE3)"}
    assert decision["verdict"] == "promote" and decision["retried_for"] == rejected["fix"], decision
