"""What the Prefect UI shows of a pipeline run: progress, a metrics table, and the run report.

- progress artifacts for long steps (datagen, extract, train), fed by `steps/progress.py`;
- a table artifact with one row per step (artifact, seconds, headline metrics);
- a markdown run report: the lineage from dataset to drafter (artifact ids and URIs), the gate's
  decision with its reasons, the doctor's findings when acceptance was zero, the server start
  attempts (F6 retries), and the benchmark plot inline.

Keys are per config (`eagle3-report-tiny`), so the Artifacts page keeps one history per pipeline.
"""

from __future__ import annotations

import base64
import re
from typing import Any

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

#: headline metrics shown per step in the table (the rest stays in the manifest).
HEADLINE = ("ok", "tokens", "tokens_per_s", "coverage", "steps", "final_loss", "tau",
            "speedup", "smoke_tau", "attempts", "verdict")


def artifact_key(kind: str, config_name: str) -> str:
    """Prefect artifact keys: lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", f"eagle3-{kind}-{config_name}".lower()).strip("-")


class ProgressArtifacts:
    """A `steps.progress` listener: one progress artifact per bar, updated in place."""

    def __init__(self, step: str):
        self.step = step
        self.ids: dict[str, Any] = {}

    def __call__(self, desc: str, done: float, total: float, unit: str, note: str = "") -> None:
        percent = 100.0 * min(1.0, done / total) if total else 100.0
        text = f"{desc}: {done:,.0f} / {total:,.0f} {unit}" + (f" · {note}" if note else "")
        if desc not in self.ids:
            self.ids[desc] = create_progress_artifact(percent, description=text)
        else:
            update_progress_artifact(self.ids[desc], percent, description=text)


def metrics_table(records: dict[str, dict[str, Any]], config_name: str) -> None:
    rows = [{"step": name, "artifact": f"{r['kind']}/{r['id']}", "seconds": r["seconds"],
             **{k: _fmt(r["metrics"].get(k)) for k in HEADLINE if k in r["metrics"]}}
            for name, r in records.items()]
    columns = ["step", "artifact", "seconds", *[k for k in HEADLINE if any(k in row for row in rows)]]
    create_table_artifact([{c: row.get(c, "") for c in columns} for row in rows],
                          key=artifact_key("metrics", config_name),
                          description=f"eagle3-pipeline {config_name}: one row per step")


def _fmt(v: Any) -> Any:
    return round(v, 4) if isinstance(v, float) else v


def run_result(records: dict[str, dict[str, Any]], decision: dict[str, Any], *, export_uri: str,
               launch: str | None = None) -> dict[str, Any]:
    """What a user wants from a finished run: the verdict and why, live and offline numbers (named as such),
    and where the exported drafter is."""
    candidate = decision.get("candidate") or {}
    offline = (records.get("verify") or {}).get("metrics", {})
    failing = [f["id"] for f in decision.get("diagnosis", []) if f["status"] == "fail"]
    return {"verdict": decision["verdict"], "reasons": list(decision.get("reasons", [])),
            "tau_live": candidate.get("tau"), "speedup_live": candidate.get("speedup"),
            "tau_offline": offline.get("tau"),
            "speedup_offline": offline.get("speedup"),
            "export": export_uri, "sglang": f"{export_uri}/sglang", "vllm": f"{export_uri}/vllm",
            "doctor": failing, "fix": (decision.get("fix") or {}).get("how"), "launch": launch}


def result_lines(result: dict[str, Any]) -> list[str]:
    """The run's closing log lines (what `prefect deployment run --watch` ends with)."""
    lines = [f"gate: {result['verdict']}: " + "; ".join(result["reasons"]),
             f"τ {_num(result['tau_live'], 3)} live, {_num(result['tau_offline'], 3)} offline (reference engine, "
             f"held-out prompts); speedup {_num(result['speedup_live'], 2, 'x')} live, "
             f"{_num(result['speedup_offline'], 2, 'x')} offline",
             f"draft: {result['sglang']} (SGLang), {result['vllm']} (vLLM)"]
    if result.get("launch"):
        lines.append(f"serve it: {result['launch']}")
    if result["doctor"]:
        lines.append(f"doctor: {', '.join(result['doctor'])} failing (docs/FAILURES.md)"
                     + (f"; fix: {result['fix']}" if result["fix"] else ""))
    return lines


def _num(value: Any, digits: int, unit: str = "") -> str:
    return "n/a" if value is None else f"{float(value):.{digits}f}{unit}"


def run_report(config_name: str, records: dict[str, dict[str, Any]], *, dataset: str | None,
               decision: dict[str, Any] | None, production: dict[str, Any] | None, plot_png: bytes | None,
               outcome: str, result: dict[str, Any] | None = None) -> str:
    """The run report as markdown (also returned, so a failed run can put it in its error)."""
    lines = [f"# eagle3-pipeline `{config_name}`: {outcome}", ""]
    if result:
        lines += ["## Result", "", *[f"- {line}" for line in result_lines(result)], ""]
    lines += ["## Lineage", "", f"dataset source: `{dataset or 'the config dataset.sources'}`", "",
              "| step | artifact | seconds | URI |", "|---|---|---|---|"]
    lines += [f"| {n} | `{r['kind']}/{r['id']}` | {r['seconds']} | `{r['uri']}` |" for n, r in records.items()]
    if production:
        recorded = _num(production.get("meta", {}).get("tau"), 3)
        lines += ["", f"`production` → export `{production['id']}` (τ {recorded}); "
                  f"previous: `{(production.get('previous') or {}).get('id')}`"]
    if decision:
        lines += ["", f"## Gate: **{decision['verdict']}**", ""] + [f"- {r}" for r in decision["reasons"]]
        if decision.get("fix"):
            fix = decision["fix"]
            lines += ["", f"Known fix for **{fix['row']}**: {fix['how']} "
                      f"({'applied: serve + benchmark retried once' if fix['applicable'] else 'not applicable here'})"]
        if decision.get("diagnosis"):
            lines += ["", "### Doctor", "", "| row | status | evidence | fix |", "|---|---|---|---|"]
            lines += [f"| {f['id']} | {f['status'].upper()} | {_cell(f['evidence'])} | {_cell(f['fix'])} |"
                      for f in decision["diagnosis"]]
    attempts = [a for r in records.values() if r["kind"] == "serve" for a in r.get("meta", {}).get("attempts", [])]
    if attempts:
        lines += ["", "## Server starts", "", "| CUDA graphs | outcome | seconds |", "|---|---|---|"]
        lines += [f"| {a.get('cuda_graph')} | {_cell(str(a.get('outcome')))} | {a.get('seconds')} |" for a in attempts]
    if plot_png:
        lines += ["", "## Benchmark", "", f"![benchmark](data:image/png;base64,{base64.b64encode(plot_png).decode()})"]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def publish_report(config_name: str, markdown: str) -> None:
    create_markdown_artifact(markdown, key=artifact_key("report", config_name),
                             description="lineage, gate decision, diagnosis and benchmark of this run")
