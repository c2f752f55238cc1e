"""Gate: may this benchmarked drafter replace the one in production?

Reads the `benchmark` artifact of a candidate export and, when there is one, the benchmark of the
current champion (the export the `production` alias points at). Writes a `gate` artifact whose
`decision.json` says one of:

- `promote`: τ ≥ gate.min_tau, speedup ≥ gate.min_speedup, and no benchmark set (temperature ×
  batch size) lost more than gate.max_regression of the champion's τ or speedup;
- `reject`: a floor or the regression rule failed (the reasons name each number);
- `zero-acceptance`: τ ≤ gate.zero_acceptance_tau — every draft rejected. That is almost always a
  serving fault, not a training one (DESIGN.md F1–F9), so the doctor runs on the exported directory
  and on the server that was measured, and the decision names the rows it found and whether the
  pipeline can fix it by itself (`fix.applicable`): it can relaunch a server it started (the
  launch command is derived, so a relaunch undoes F1 and the launcher turns F6 into a restart
  without CUDA graphs); it cannot restart a server someone else runs (`spec_url`).
- `current`: the candidate already is production (nothing to move) and its live numbers still hold:
  τ ≥ gate.min_tau, speedup ≥ gate.min_speedup, and no set lost more than gate.max_regression of what
  production recorded when it was promoted;
- `degraded`: the candidate is production and it no longer holds (a floor or its own recorded numbers
  failed). The draft has not changed, so the serving has: the doctor runs as for zero acceptance.
  Without this a production draft whose live τ fell 12% behind a new server passed as `current`.

Before `promote` or `current`, the algorithm the measured server reported is read (F1): numbers measured
behind `--speculative-algorithm EAGLE` are not those of the derived command, whatever τ they show, so the
verdict becomes `reject` (`degraded` for production) with the F1 fix, and the pipeline relaunches.

Moving the alias is not done here: the orchestrator does it inside a transaction that can roll back.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from steps.lib.artifacts import export_dir, target_dir
from steps.lib.checks.cuda_graph import check_cuda_graph
from steps.lib.checks.finding import Finding
from steps.lib.config import GateConfig, PipelineConfig, config_dict
from steps.lib.diagnose import diagnose as run_doctor
from steps.lib.diagnose import served_algorithm
from steps.lib.store import Manifest, Store, artifact_id
from steps.registry import step_main

STEP = "gate"
log = logging.getLogger(__name__)
#: rows whose cause is the serving command, which a relaunch from the derived command fixes.
RELAUNCH_FIXES = {"F1": "relaunch with the derived command (--speculative-algorithm EAGLE3)",
                  "F6": "relaunch; the launcher retries without CUDA graphs when capture hangs"}


# --- inputs -----------------------------------------------------------------------------------------------

def benchmark_report(store: Store, benchmark_id: str) -> dict[str, Any]:
    return json.loads(store.fetch_file("benchmark", benchmark_id, "benchmark.json").read_text())


def benchmark_sets(report: dict[str, Any]) -> dict[str, dict[str, float]]:
    """τ and speedup per benchmark set ("T=0.0 bs=1"), from a benchmark.json."""
    sets: dict[str, dict[str, float]] = {}
    for temp, pair in report["results"].items():
        base, spec = pair["baseline"], pair["speculative"]
        if "error" in base or "error" in spec:
            continue
        tau = (spec.get("acceptance") or {}).get("tau", 0.0)
        for bs, row in spec["batches"].items():
            b = base["batches"][bs]["tokens_per_s"]
            sets[f"T={temp} bs={bs}"] = {"tau": tau, "speedup": row["tokens_per_s"] / b if b else 0.0}
    return sets


# --- the decision -----------------------------------------------------------------------------------------

def regressions(candidate: dict[str, dict[str, float]], champion: dict[str, dict[str, float]],
                max_regression: float, metrics: tuple[str, ...] = ("tau", "speedup")) -> list[str]:
    """Every set and metric where the candidate is worse than (1 - max_regression) × the champion."""
    out = []
    for name, champ in champion.items():
        cand = candidate.get(name)
        if cand is None:
            out.append(f"{name}: measured for the champion, missing for the candidate")
            continue
        for metric in metrics:
            if cand[metric] < champ[metric] * (1 - max_regression):
                out.append(f"{name}: {metric} {cand[metric]:.3f} < champion {champ[metric]:.3f} "
                           f"- {max_regression:.0%}")
    return out


#: verdicts after which the doctor runs: the measured draft is known good (or cannot be that bad), so
#: the serving is the suspect.
DIAGNOSED = ("zero-acceptance", "degraded")


def rejected(tau: float) -> str:
    """What a τ at the floor means, worded for the number: τ counts the bonus token, so τ - 1 is the drafted
    tokens accepted per verify step."""
    if tau <= 1.0:
        return "every draft token rejected"
    return f"almost every draft token rejected ({tau - 1:.3f} accepted per verify step)"


def decide(gate: GateConfig, metrics: dict[str, Any], candidate_sets: dict[str, dict[str, float]],
           champion_sets: dict[str, dict[str, float]] | None, *, is_champion: bool = False
           ) -> tuple[str, list[str]]:
    """(verdict, reasons) from the candidate's headline metrics and sets; the champion's sets if any.

    `is_champion`: the candidate is production itself, re-measured; `champion_sets` are then the numbers
    it recorded when promoted, and failing them (or a floor) is `degraded`, not `reject`."""
    tau, speedup = float(metrics.get("tau") or 0.0), float(metrics.get("speedup") or 0.0)
    if "error" in metrics:
        return "reject", [f"benchmark error: {metrics['error']}"]
    if metrics.get("tau") is None:   # no spec_verify_ct in any answer: the server did not speculate at all
        return "zero-acceptance", ["the benchmark recorded no live τ: the server reported no speculative "
                                   "decoding counters (is the draft loaded, the algorithm set?)"]
    if tau <= gate.zero_acceptance_tau:
        return "zero-acceptance", [f"live τ {tau:.3f} ≤ {gate.zero_acceptance_tau}: {rejected(tau)}"]
    reasons = []
    if tau < gate.min_tau:
        reasons.append(f"live τ {tau:.3f} < gate.min_tau {gate.min_tau}")
    if speedup < gate.min_speedup:
        reasons.append(f"speedup {speedup:.3f} < gate.min_speedup {gate.min_speedup}")
    if champion_sets is not None:
        # Production against its own record: τ only. Greedy τ of one draft behind a correct server is
        # reproducible; tokens/s on a shared machine is not (the speedup floor above still applies).
        reasons += regressions(candidate_sets, champion_sets, gate.max_regression,
                               ("tau",) if is_champion else ("tau", "speedup"))
    if is_champion:
        return ("degraded", reasons) if reasons else \
            ("current", [f"production still holds: live τ {tau:.3f} ≥ {gate.min_tau}, speedup {speedup:.3f} ≥ "
                         f"{gate.min_speedup}" + ("" if champion_sets is None else
                                                   f", no set below its recorded τ - {gate.max_regression:.0%}")])
    if reasons:
        return "reject", reasons
    return "promote", [f"live τ {tau:.3f} ≥ {gate.min_tau}, speedup {speedup:.3f} ≥ {gate.min_speedup}"
                       + ("" if champion_sets is None else f", no set regressed > {gate.max_regression:.0%}")]


def diagnose(cfg: PipelineConfig, store: Store, export_id: str, target_id: str, report: dict[str, Any],
             spec_url: str | None) -> list[dict[str, Any]]:
    """The doctor on the export and on the server that was measured (live if it still runs)."""
    sglang_dir, tdir = export_dir(store, export_id, "sglang"), target_dir(store, target_id)
    attempts = [a for sid in report.get("serve_artifacts", {}).values()
                for a in store.manifest("serve", sid).meta.get("attempts", [])]
    findings = run_doctor(sglang_dir, target=tdir, server=spec_url, context_length=cfg.target.context_length,
                          serve_record=attempts or None)
    # A server that is gone (ours is stopped by now; theirs may be down) is judged by what it reported
    # while it was measured: the algorithm it ran (F1) and, for ours, its CUDA-graph facts (F6).
    facts = report["servers"]["speculative"]
    if not any(f.id == "F1" for f in findings):
        findings.append(served_algorithm(sglang_dir, facts, report["metrics"].get("tau"), where="measured server"))
    if spec_url is None:
        findings.append(check_cuda_graph(facts, attempts or None, where="measured server"))
    return [f.to_dict() for f in findings]


def wrong_algorithm(store: Store, export_id: str, report: dict[str, Any]) -> Finding | None:
    """F1 failing on the algorithm the measured server reported, when it reported one: a τ measured behind
    `EAGLE` (which an engine may still accept for a while) is not the τ of the derived EAGLE3 command."""
    facts = report["servers"]["speculative"]
    if not facts.get("speculative_algorithm"):
        return None
    f = served_algorithm(export_dir(store, export_id, "sglang"), facts, report["metrics"].get("tau"),
                         where="measured server")
    return f if f.status == "fail" else None


def fix_for(findings: list[dict[str, Any]], spec_url: str | None) -> dict[str, Any] | None:
    """The first failing row with a known fix, and whether this pipeline can apply it."""
    for f in findings:
        if f["status"] == "fail" and f["id"] in RELAUNCH_FIXES:
            if spec_url is None:
                return {"row": f["id"], "applicable": True, "action": "relaunch", "how": RELAUNCH_FIXES[f["id"]]}
            return {"row": f["id"], "applicable": False, "action": None,
                    "how": f"the server at {spec_url} is not managed by this run: {f['fix'] or RELAUNCH_FIXES[f['id']]}"
                           " (print the right command with `eaglenest serve --print-command`)"}
    return None


# --- step -------------------------------------------------------------------------------------------------

def run(cfg: PipelineConfig, store: Store, export_id: str, target_id: str, benchmark_id: str, *,
        spec_url: str | None = None) -> Manifest:
    """Decide promote / reject / zero-acceptance for one benchmarked export; writes the gate artifact."""
    report = benchmark_report(store, benchmark_id)
    # an alias is verified before it is trusted: one that points at nothing is named, then judged as no champion
    alias_problem = store.alias_problem("production")
    if alias_problem:
        log.warning("gate: %s", alias_problem)
    champion = None if alias_problem else store.get_alias("production")
    champion_bench = (champion or {}).get("meta", {}).get("benchmark")
    inputs = {"export": export_id, "target": target_id, "benchmark": benchmark_id}
    section = {"gate": config_dict(cfg.gate), "champion": champion and [champion["id"], champion_bench],
               "spec_url": spec_url}
    gid = artifact_id("gate", section, inputs)
    if store.exists("gate", gid):
        return store.manifest("gate", gid)

    candidate_sets = benchmark_sets(report)
    is_champion = bool(champion and champion["id"] == export_id)
    # Production re-measured is judged against what it recorded when promoted (unless this *is* that
    # measurement), a challenger against the champion's recorded sets.
    champion_sets = benchmark_sets(benchmark_report(store, champion_bench)) \
        if champion_bench and champion_bench != benchmark_id else None
    verdict, reasons = decide(cfg.gate, report["metrics"], candidate_sets, champion_sets, is_champion=is_champion)
    if alias_problem:
        reasons = [f"no usable champion: {alias_problem}", *reasons]
    if is_champion:
        recorded = (champion.get("meta") or {}).get("tau")
        reasons = [f"export {export_id} is production (recorded live τ {_fmt(recorded)})", *reasons]
    served = wrong_algorithm(store, export_id, report) if verdict in ("promote", "current") else None
    if served is not None:        # a good τ behind the wrong algorithm is not what production would serve
        verdict, reasons = ("degraded" if is_champion else "reject"), [served.located, *reasons]
    findings = diagnose(cfg, store, export_id, target_id, report, spec_url) \
        if verdict in DIAGNOSED or served is not None else []
    decision = {"verdict": verdict, "reasons": reasons, "fix": fix_for(findings, spec_url) if findings else None,
                "diagnosis": findings, "candidate": {"export": export_id, "benchmark": benchmark_id,
                                                     "tau": report["metrics"].get("tau"),
                                                     "speedup": report["metrics"].get("speedup"),
                                                     "sets": candidate_sets},
                "champion": champion and {"export": champion["id"], "benchmark": champion_bench,
                                          "sets": champion_sets}}
    writer = store.begin("gate", gid, step=STEP, inputs=inputs, config=section)
    writer.path("decision.json").write_text(json.dumps(decision, indent=2))
    return writer.commit(metrics={"verdict": verdict, "tau": decision["candidate"]["tau"],
                                  "speedup": decision["candidate"]["speedup"]}, meta=decision)


def _fmt(value: Any) -> str:
    return "n/a" if value is None else f"{float(value):.3f}"


def exit_code(manifest: Manifest) -> int:
    """The CLI's exit code (the registry's `exit_code` hook): 1 when the export is not (or no longer) production."""
    return 0 if manifest.metrics["verdict"] in ("promote", "current") else 1


def main(argv: list[str] | None = None) -> int:
    return step_main("gate", argv)


if __name__ == "__main__":
    raise SystemExit(main())
