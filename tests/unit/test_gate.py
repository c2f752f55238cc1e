"""The gate's decision rules (steps/gate.py) and the run report it feeds (flows/ui.py)."""

from __future__ import annotations

import pytest

from steps.gate import benchmark_sets, decide, fix_for, regressions
from steps.lib.config import GateConfig

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


def test_the_zero_acceptance_reason_is_worded_for_the_measured_tau():
    assert decide(GATE, {"tau": 1.0, "speedup": 0.6}, {}, None)[1] == ["live τ 1.000 ≤ 1.1: every draft token rejected"]
    (reason,) = decide(GATE, {"tau": 1.077, "speedup": 0.6}, {}, None)[1]
    assert reason == "live τ 1.077 ≤ 1.1: almost every draft token rejected (0.077 accepted per verify step)"


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
    assert artifact_key("report", "Llama-3.1 8B") == "eagle3-llama-3-1-8b-00-report"
    # sorted by key, a pipeline's artifacts read in the order its steps run, the report first
    keys = [artifact_key("metrics", "tiny", s) for s in ("benchmark", "target", "gate", "datagen")]
    assert sorted([*keys, artifact_key("report", "tiny")]) == [
        "eagle3-tiny-00-report", "eagle3-tiny-01-target-metrics", "eagle3-tiny-02-datagen-metrics",
        "eagle3-tiny-09-benchmark-metrics", "eagle3-tiny-10-gate-metrics"]


def test_production_re_measured_below_its_own_record_is_degraded_not_current():
    # production recorded τ 1.338 when promoted; behind a new server the same export measures 1.176:
    # above the zero-acceptance line, below its record − 2% and below min_tau → degraded, with the numbers
    gate = GateConfig(min_tau=1.2, min_speedup=0.2, max_regression=0.02, zero_acceptance_tau=1.1)
    recorded = {"T=0.0 bs=1": {"tau": 1.338, "speedup": 0.40}}
    live = {"T=0.0 bs=1": {"tau": 1.176, "speedup": 0.45}}
    verdict, reasons = decide(gate, {"tau": 1.176, "speedup": 0.45}, live, recorded, is_champion=True)
    assert verdict == "degraded"
    assert "live τ 1.176 < gate.min_tau 1.2" in reasons
    assert "T=0.0 bs=1: tau 1.176 < champion 1.338 - 2%" in reasons
    # above min_tau but 5% under its own record: still degraded (this config's floor alone would pass it)
    lower_floor = GateConfig(min_tau=1.1, min_speedup=0.2, max_regression=0.02, zero_acceptance_tau=1.0)
    live = {"T=0.0 bs=1": {"tau": 1.27, "speedup": 0.45}}
    verdict, reasons = decide(lower_floor, {"tau": 1.27, "speedup": 0.45}, live, recorded, is_champion=True)
    assert verdict == "degraded" and reasons == ["T=0.0 bs=1: tau 1.270 < champion 1.338 - 2%"]


def test_production_that_still_holds_is_current_even_when_its_speedup_wobbles():
    gate = GateConfig(min_tau=1.2, min_speedup=0.2, max_regression=0.02, zero_acceptance_tau=1.1)
    recorded = {"T=0.0 bs=1": {"tau": 1.338, "speedup": 0.40}}
    # tokens/s on a shared machine moves more than 2%; τ of greedy decoding does not
    noisy = {"T=0.0 bs=1": {"tau": 1.338, "speedup": 0.33}}
    verdict, reasons = decide(gate, {"tau": 1.338, "speedup": 0.33}, noisy, recorded, is_champion=True)
    assert verdict == "current", reasons
    # a challenger with the same numbers is held to the champion's speedup as well
    assert decide(gate, {"tau": 1.338, "speedup": 0.33}, noisy, recorded)[0] == "reject"
    # below the speedup floor, production is degraded too
    slow = {"T=0.0 bs=1": {"tau": 1.338, "speedup": 0.1}}
    verdict, reasons = decide(gate, {"tau": 1.338, "speedup": 0.1}, slow, recorded, is_champion=True)
    assert verdict == "degraded" and reasons == ["speedup 0.100 < gate.min_speedup 0.2"]
    # zero acceptance stays its own verdict for production as well
    assert decide(gate, {"tau": 1.0, "speedup": 0.3}, {}, recorded, is_champion=True)[0] == "zero-acceptance"


# --- the step: steps.gate.run / main on a store, with real exports and the doctor --------------------------

def put_benchmark(store, bench_id: str, export_id: str, *, tau: float | None, algorithm: str = "EAGLE3",
                  spec_tps: float = 30.0, base_tps: float = 20.0) -> str:
    """A `benchmark` artifact as steps.benchmark writes it (benchmark.json), one set T=0.0 bs=1."""
    import json

    acceptance = {} if tau is None else {"tau": tau}
    report = {"inputs": {"export": export_id}, "servers": {
                  "baseline": {"speculative_algorithm": None},
                  "speculative": {"speculative_algorithm": algorithm, "speculative_num_steps": 3,
                                  "disable_cuda_graph": False}},
              "serve_artifacts": {},
              "results": {"0.0": {"baseline": {"batches": {"1": {"tokens_per_s": base_tps}}},
                                  "speculative": {"batches": {"1": {"tokens_per_s": spec_tps}},
                                                  "acceptance": acceptance}}},
              "metrics": {**({} if tau is None else {"tau": tau}), "speedup": spec_tps / base_tps}}
    writer = store.begin("benchmark", bench_id, step="benchmark", inputs={"export": export_id})
    writer.path("benchmark.json").write_text(json.dumps(report))
    writer.commit(metrics=report["metrics"])
    return bench_id


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from tests.builders import bigram_world, free_port

    return bigram_world(tmp_path_factory.mktemp("gate"), free_port(),
                        gate={"min_tau": 1.5, "min_speedup": 1.0})


def test_the_step_promotes_records_the_decision_and_exits_0(world, tmp_path, capsys):
    import json

    from steps import gate
    from tests.builders import cli_record, record_of

    store = world["store"]
    bench = put_benchmark(store, "bf00000000000001", world["export_id"], tau=2.4)
    m = gate.run(world["cfg"], store, world["export_id"], world["target_id"], bench)
    assert m.metrics == {"verdict": "promote", "tau": 2.4, "speedup": 1.5}
    decision = json.loads(store.fetch_file("gate", m.id, "decision.json").read_text())
    assert decision["candidate"]["sets"] == {"T=0.0 bs=1": {"tau": 2.4, "speedup": 1.5}}
    assert decision["champion"] is None and decision["diagnosis"] == []
    # the CLI: the same decision (the id is content-addressed: reused), exit 0 for promote
    (tmp_path / "c.yaml").write_text(world["cfg"].model_dump_json())
    code, record = cli_record(capsys, gate.main, "--config", str(tmp_path / "c.yaml"), "--store", store.uri,
                              "--export", world["export_id"], "--target", world["target_id"], "--benchmark", bench)
    assert code == 0 and record == record_of(store, m)


def test_production_behind_an_eagle_server_is_degraded_and_the_doctor_names_f1(world):
    from steps import gate

    store = world["store"]
    recorded = put_benchmark(store, "b-recorded", world["export_id"], tau=2.4)
    store.set_alias("production", "export", world["export_id"], meta={"benchmark": recorded, "tau": 2.4})
    try:
        live = put_benchmark(store, "b-live", world["export_id"], tau=1.8, algorithm="EAGLE")
        m = gate.run(world["cfg"], store, world["export_id"], world["target_id"], live)
        assert m.metrics["verdict"] == "degraded", m.meta["reasons"]
        assert "T=0.0 bs=1: tau 1.800 < champion 2.400 - 2%" in m.meta["reasons"]
        failed = {f["id"] for f in m.meta["diagnosis"] if f["status"] == "fail"}
        assert "F1" in failed, m.meta["diagnosis"]
        assert m.meta["fix"]["row"] == "F1" and m.meta["fix"]["applicable"] is True   # our server: relaunch
        # the same measurement again: still holds its verdict (content-addressed, not re-decided)
        assert gate.run(world["cfg"], store, world["export_id"], world["target_id"], live).id == m.id
        # production measured as it recorded: current
        same = put_benchmark(store, "b-same", world["export_id"], tau=2.4)
        assert gate.run(world["cfg"], store, world["export_id"], world["target_id"], same).metrics["verdict"] \
            == "current"
    finally:
        store.restore_alias("production", None)


def test_a_benchmark_without_tau_is_zero_acceptance_diagnosed_not_promoted(world, tmp_path, capsys):
    from steps import gate
    from tests.builders import cli_record, record_of

    store = world["store"]
    bench = put_benchmark(store, "b0000000000000a0", world["export_id"], tau=None, algorithm="")
    m = gate.run(world["cfg"], store, world["export_id"], world["target_id"], bench, spec_url="http://127.0.0.1:9")
    assert m.metrics["verdict"] == "zero-acceptance" and "no live τ" in m.meta["reasons"][0]
    assert "F1" in {f["id"] for f in m.meta["diagnosis"] if f["status"] == "fail"}, m.meta["diagnosis"]
    assert m.meta["fix"]["applicable"] is False                 # someone else's server: name it, don't touch it
    (tmp_path / "c.yaml").write_text(world["cfg"].model_dump_json())
    code, record = cli_record(capsys, gate.main, "--config", str(tmp_path / "c.yaml"), "--store", store.uri,
                              "--export", world["export_id"], "--target", world["target_id"], "--benchmark", bench,
                              "--spec-url", "http://127.0.0.1:9")
    assert code == 1 and record == record_of(store, m) and record["metrics"]["verdict"] == "zero-acceptance"


def test_the_result_lines_name_live_and_offline_numbers_and_the_draft():
    from flows.ui import result_lines, run_result, state_message

    records = {"verify": {"metrics": {"tau": 1.6721311, "speedup": 0.41}}}
    decision = {"verdict": "reject", "reasons": ["live τ 1.338 < gate.min_tau 5.0"],
                "candidate": {"tau": 1.3380952, "speedup": 0.38}, "diagnosis": [], "fix": None}
    result = run_result(records, decision, export_uri="file:///s/artifacts/export/e1")
    assert run_result(records, decision, export_uri="u", launch="python -m sglang.launch_server --x")["launch"] \
        == "python -m sglang.launch_server --x"
    assert result_lines(run_result(records, decision, export_uri="u", launch="cmd"))[-1] == "serve it: cmd"
    assert result_lines(result) == [
        "gate: reject: live τ 1.338 < gate.min_tau 5.0",
        "τ 1.338 live, 1.672 offline (reference engine, held-out prompts); speedup 0.38x live, 0.41x offline",
        "draft: /s/artifacts/export/e1/sglang (SGLang), /s/artifacts/export/e1/vllm (vLLM)"]   # pasted as paths
    # the UI's run header and `--watch`'s last line: one short line, the launch command left to the log
    long = run_result(records, decision, export_uri="file:///s/artifacts/export/e1", launch="python -m " + "x" * 400,
                      launch_file="/s/launch/e1-sglang.sh")
    assert result_lines(long)[-1] == "serve it: sh /s/launch/e1-sglang.sh"
    assert state_message({**long, "report": "http://127.0.0.1:4200/artifacts/artifact/a1"}) == (
        "reject: live τ 1.338 < gate.min_tau 5.0 | τ 1.338 live, 1.672 offline | draft /s/artifacts/export/e1/sglang"
        " | report http://127.0.0.1:4200/artifacts/artifact/a1")
    zero = {"verdict": "zero-acceptance", "reasons": ["live τ 1.000 ≤ 1.1"], "candidate": {"tau": 1.0},
            "diagnosis": [{"id": "F1", "status": "fail"}, {"id": "F2", "status": "pass"}],
            "fix": {"how": "restart with --speculative-algorithm EAGLE3"}}
    lines = result_lines(run_result({}, zero, export_uri="s3://b/artifacts/export/e2"))
    assert lines[1] == "diagnosis: the doctor names F1: the checkpoint or the server is wrong, not the training — " \
                       "fix F1 first"
    assert lines[2].startswith("τ 1.000 live, n/a offline") and "speedup n/a live" in lines[2]
    assert lines[-1] == ("doctor: F1 failing (docs/FAILURES.md); fix: restart with --speculative-algorithm EAGLE3")


def test_zero_acceptance_reads_offline_against_live_and_the_doctor_as_a_diagnosis():
    """The 32-prompt upload's run: offline ≈ live, every check passing — too little data, said with the numbers;
    a good draft served wrong — the serving; a failing row — that row."""
    from flows.ui import run_result

    records = {"verify": {"metrics": {"tau": 1.0811}}, "datagen": {"metrics": {"ok": 32, "answers_needed": 327}}}
    zero = {"verdict": "zero-acceptance", "reasons": ["live τ 1.077 ≤ 1.1"], "candidate": {"tau": 1.077},
            "diagnosis": [{"id": "F1", "status": "pass"}, {"id": "F2", "status": "pass"}], "fix": None}
    assert run_result(records, zero, export_uri="u")["diagnosis"] == (
        "offline τ 1.08 ≈ live τ 1.08 and every doctor check passes: the serving is right, the draft learned too "
        "little from 32 answers (its config needs ~327) — add data (more prompts, datagen.samples_per_prompt) or "
        "train longer (train.epochs)")
    served_wrong = {**zero, "candidate": {"tau": 1.0}}
    assert "the draft is good and the serving loses it (F9)" in run_result(
        {"verify": {"metrics": {"tau": 1.45}}}, served_wrong, export_uri="u")["diagnosis"]
    assert run_result(records, {**zero, "verdict": "reject"}, export_uri="u")["diagnosis"] is None


def test_production_pointing_at_a_missing_export_is_named_and_not_trusted(world, caplog):
    """Issue 27: an alias is verified before the gate trusts it; its missing target is named in the decision."""
    import json

    from steps import gate

    store = world["store"]
    store.backend.put_bytes("aliases/production.json", json.dumps(
        {"kind": "export", "id": "0123456789abcdef", "meta": {}, "previous": None}).encode())
    try:
        bench = put_benchmark(store, "bf00000000000027", world["export_id"], tau=2.4)
        m = gate.run(world["cfg"], store, world["export_id"], world["target_id"], bench)
        assert m.meta["champion"] is None
        assert any("production.json points at export/0123456789abcdef" in r for r in m.meta["reasons"]), \
            m.meta["reasons"]
        assert "export/0123456789abcdef, which is not in the store" in caplog.text
    finally:
        store.restore_alias("production", None)
