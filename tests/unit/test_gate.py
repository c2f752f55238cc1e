"""The gate's decision rules (steps/gate.py) and the run report it feeds (flows/ui.py)."""

from __future__ import annotations

from steps.config import GateConfig
from steps.gate import benchmark_sets, decide, fix_for, regressions

GATE = GateConfig(min_tau=1.5, min_speedup=1.0, max_regression=0.02, zero_acceptance_tau=1.1)


def report(tau: float, spec_tps: dict[str, float], base_tps: dict[str, float]) -> dict:
    return {"results": {"0.0": {
        "baseline": {"batches": {bs: {"tokens_per_s": v} for bs, v in base_tps.items()}},
        "speculative": {"batches": {bs: {"tokens_per_s": v} for bs, v in spec_tps.items()},
                        "acceptance": {"tau": tau}}}}}


def test_sets_are_tau_and_speedup_per_temperature_and_batch():
    sets = benchmark_sets(report(2.5, {"1": 30.0, "4": 80.0}, {"1": 20.0, "4": 100.0}))
    assert sets == {"T=0.0 bs=1": {"tau": 2.5, "speedup": 1.5}, "T=0.0 bs=4": {"tau": 2.5, "speedup": 0.8}}


def test_first_drafter_is_promoted_when_it_clears_the_floors():
    verdict, reasons = decide(GATE, {"tau": 2.0, "speedup": 1.3}, {}, None)
    assert verdict == "promote", reasons


def test_floors_reject_with_the_numbers():
    verdict, reasons = decide(GATE, {"tau": 1.4, "speedup": 0.9}, {}, None)
    assert verdict == "reject"
    assert any("1.400 < gate.min_tau 1.5" in r for r in reasons)
    assert any("speedup 0.900 < gate.min_speedup 1.0" in r for r in reasons)


def test_zero_acceptance_is_its_own_verdict():
    # τ = 1.0 is "every draft rejected" (only the bonus token); the gate then runs the doctor
    assert decide(GATE, {"tau": 1.0, "speedup": 0.6}, {}, None)[0] == "zero-acceptance"
    assert decide(GATE, {"tau": 1.1, "speedup": 0.6}, {}, None)[0] == "zero-acceptance"


def test_a_set_losing_more_than_two_percent_blocks_promotion():
    champion = {"T=0.0 bs=1": {"tau": 2.0, "speedup": 1.50}, "T=0.0 bs=4": {"tau": 2.0, "speedup": 1.20}}
    within = {"T=0.0 bs=1": {"tau": 1.99, "speedup": 1.48}, "T=0.0 bs=4": {"tau": 2.1, "speedup": 1.19}}
    assert regressions(within, champion, 0.02) == []
    worse = {**within, "T=0.0 bs=4": {"tau": 2.1, "speedup": 1.15}}
    found = regressions(worse, champion, 0.02)
    assert len(found) == 1 and "T=0.0 bs=4: speedup 1.150" in found[0]
    verdict, reasons = decide(GATE, {"tau": 2.0, "speedup": 1.48}, worse, champion)
    assert verdict == "reject" and reasons == found
    missing = regressions({"T=0.0 bs=1": within["T=0.0 bs=1"]}, champion, 0.02)
    assert missing == ["T=0.0 bs=4: measured for the champion, missing for the candidate"]


def test_known_fix_applies_only_to_a_server_this_run_launched():
    f1 = [{"id": "F2", "status": "pass", "evidence": "", "fix": ""},
          {"id": "F1", "status": "fail", "evidence": "EAGLE", "fix": "restart with --speculative-algorithm EAGLE3"}]
    ours = fix_for(f1, spec_url=None)
    assert ours["row"] == "F1" and ours["applicable"] and ours["action"] == "relaunch"
    theirs = fix_for(f1, spec_url="http://127.0.0.1:9")
    assert theirs["row"] == "F1" and not theirs["applicable"]
    assert "http://127.0.0.1:9" in theirs["how"] and "EAGLE3" in theirs["how"]
    # a training fault has no serving fix
    assert fix_for([{"id": "F9", "status": "fail", "evidence": "", "fix": "retrain"}], None) is None


def test_run_report_names_the_lineage_the_verdict_and_the_doctor_rows():
    from flows.ui import artifact_key, run_report

    records = {"target": {"kind": "target", "id": "t1", "uri": "file:///s/artifacts/target/t1", "seconds": 1.0,
                          "metrics": {}},
               "serve": {"kind": "serve", "id": "s1", "uri": "file:///s/artifacts/serve/s1", "seconds": 70.0,
                         "metrics": {"attempts": 2},
                         "meta": {"attempts": [{"cuda_graph": True, "outcome": "timeout", "seconds": 60},
                                               {"cuda_graph": False, "outcome": "healthy", "seconds": 9}]}}}
    decision = {"verdict": "zero-acceptance", "reasons": ["live τ 1.000 ≤ 1.1"],
                "fix": {"row": "F1", "applicable": False, "how": "restart it with EAGLE3"},
                "diagnosis": [{"id": "F1", "status": "fail", "evidence": "server runs EAGLE | x", "fix": "EAGLE3"}]}
    md = run_report("tiny", records, dataset="s3://b/datasets/d/x.jsonl", decision=decision, production=None,
                    plot_png=b"\x89PNG", outcome="refused (zero-acceptance)")
    assert "`target/t1`" in md and "s3://b/datasets/d/x.jsonl" in md
    assert "**zero-acceptance**" in md and "| F1 | FAIL | server runs EAGLE \\| x |" in md
    assert "not applicable here" in md
    assert "| True | timeout | 60 |" in md and "| False | healthy | 9 |" in md
    assert "data:image/png;base64," in md
    assert artifact_key("report", "Llama-3.1 8B") == "eagle3-report-llama-3-1-8b"
