"""What the Prefect UI shows of a pipeline run: progress, a metrics table, and the run report.

- progress artifacts for long steps (datagen, extract, train), fed by `steps/lib/runtime/progress.py`: keyed by step
  (`train-progress`), a text bar, ETA and the step's postfix (train's loss); the same line in the log every
  10% (the worker log has no terminal for tqdm to draw on);
- on every step run, its own small artifacts (`step_artifacts`): its metrics table; the benchmark's plot
  on the benchmark run; train's loss (and τ_sim when train_log.jsonl has it) curve on the train run;
- a table artifact with one row per step (artifact, seconds, headline metrics);
- a markdown run report: the lineage from dataset to drafter (artifact ids and URIs), the gate's
  decision with its reasons, the doctor's findings when acceptance was zero, the server start
  attempts (F6 retries), and the benchmark plot inline.

Keys are per config and in pipeline order (`eagle3-tiny-00-report`, `eagle3-tiny-00-metrics`,
`eagle3-tiny-02-datagen-progress`, ..., `eagle3-tiny-08-benchmark-plot`): the Artifacts page, sorted by key,
lists a pipeline's artifacts together, its report first and each step's in the order the steps run, and keeps
one history per key.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable
from typing import Any

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from steps.lib.checks.tau import read_no_acceptance
from steps.lib.runtime.progress import Update, clock
from steps.lib.runtime.redaction import redact, redact_text
from steps.registry import STEPS

#: headline metrics shown per step in the table (the rest stays in the manifest).
HEADLINE = ("ok", "tokens", "tokens_per_s", "coverage", "steps", "final_loss", "tau",
            "speedup", "smoke_tau", "attempts", "verdict")


def artifact_key(kind: str, config_name: str, step: str | None = None) -> str:
    """`eagle3-<config>-<NN>-<step>-<kind>`, NN the step's place in the chain (00: the run's own, before every
    step); Prefect artifact keys are lowercase letters, digits and dashes only."""
    order = f"{list(STEPS).index(step) + 1:02d}-{step}" if step else "00"
    return re.sub(r"[^a-z0-9-]+", "-", f"eagle3-{config_name}-{order}-{kind}".lower()).strip("-")


class ProgressArtifacts:
    """A `steps.lib.runtime.progress` listener: one progress artifact per bar, keyed by step and bar (not a UUID),
    updated in place; a plain log line at every 10% (and the end) through `log`."""

    def __init__(self, step: str, config_name: str, log: Callable[[str], None] | None = None):
        self.step, self.config_name, self.log = step, config_name, log
        self.ids: dict[str, Any] = {}
        self.logged: dict[str, int] = {}

    def __call__(self, update: Update) -> None:
        percent = 100.0 * update.fraction
        text = progress_markdown(self.step, update)
        if update.desc not in self.ids:
            kind = "progress" if update.desc == self.step else f"{update.desc}-progress"
            key = artifact_key(kind, self.config_name, self.step)
            self.ids[update.desc] = create_progress_artifact(percent, key=key, description=text)
        else:
            update_progress_artifact(self.ids[update.desc], percent, description=text)
        decile = int(percent // 10)
        if self.log and decile > self.logged.get(update.desc, -1):
            self.logged[update.desc] = decile
            self.log(update.line())


def progress_markdown(step: str, update: Update, width: int = 20) -> str:
    """`**train** `████████░░░░` 45% · 45/100 step · ETA 0:15 · loss 2.345`"""
    filled = int(round(width * update.fraction))
    eta = update.eta_s
    parts = [f"**{step}** `{'█' * filled}{'░' * (width - filled)}` {100 * update.fraction:.0f}%",
             f"{update.done:,.0f}/{update.total:,.0f} {update.unit}", f"{clock(update.elapsed_s)} elapsed",
             f"ETA {clock(eta) if eta is not None else '?'}", *[f"{k} {v}" for k, v in update.postfix_items()]]
    return " · ".join(parts)


# --- a step run's own artifacts -------------------------------------------------------------------------

def step_artifacts(step: str, record: dict[str, Any], config_name: str, *, plot_png: bytes | None = None,
                   train_log: list[dict[str, Any]] | None = None) -> list[str]:
    """Publish a step run's artifacts: its metrics (every scalar of the manifest), the benchmark plot, the
    training curves. Returns the keys published."""
    key = artifact_key("metrics", config_name, step)
    rows = [{"metric": k, "value": _fmt(v)} for k, v in record["metrics"].items() if _scalar(v)]
    rows.append({"metric": "seconds", "value": record["seconds"]})
    create_table_artifact(redact(rows), key=key,
                          description=redact_text(f"`{step}` → `{record['kind']}/{record['id']}` ({record['uri']})"))
    keys = [key]
    if plot_png:
        keys.append(artifact_key("plot", config_name, step))
        create_markdown_artifact(f"# {step} `{record['id']}`\n\n![{step}]({png_uri(plot_png)})\n", key=keys[-1],
                                 description=f"{step}: τ, throughput and latency, speculative vs baseline")
    if train_log:
        keys.append(artifact_key("curves", config_name, step))
        create_markdown_artifact(training_curves(train_log, record["id"]), key=keys[-1],
                                 description="training loss (and simulated τ) per optimizer step")
    return keys


def _scalar(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool)) or value is None


def png_uri(png: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(png).decode()}"


def training_curves(log: list[dict[str, Any]], draft_id: str) -> str:
    """Markdown with an inline SVG line chart per series of train_log.jsonl: `loss`, and `tau_sim` when
    the log has it (steps without a value are skipped)."""
    lines = [f"# train `{draft_id}`: {len(log)} steps", ""]
    for name, label in (("loss", "loss"), ("tau_sim", "τ_sim (simulated acceptance length)")):
        points = [(float(r["step"]), float(r[name])) for r in log
                  if isinstance(r.get(name), (int, float)) and not isinstance(r.get(name), bool)]
        if points:
            first, last = points[0][1], points[-1][1]
            lines += [f"## {label}: {first:.3f} → {last:.3f}", "", f"![{name}]({svg_uri(line_chart(points))})", ""]
    return "\n".join(lines)


def line_chart(points: list[tuple[float, float]], width: int = 480, height: int = 160, pad: int = 28) -> str:
    """A dependency-free SVG polyline with its y range labelled (enough to see a loss go down)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    sx = (width - 2 * pad) / ((x1 - x0) or 1.0)
    sy = (height - 2 * pad) / ((y1 - y0) or 1.0)
    path = " ".join(f"{pad + (x - x0) * sx:.1f},{height - pad - (y - y0) * sy:.1f}" for x, y in points)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-size="11" '
            f'font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>'
            f'<polyline fill="none" stroke="#2563eb" stroke-width="1.5" points="{path}"/>'
            f'<text x="2" y="{pad}">{y1:.3g}</text><text x="2" y="{height - pad}">{y0:.3g}</text>'
            f'<text x="{pad}" y="{height - 6}">step {x0:.0f}</text>'
            f'<text x="{width - pad}" y="{height - 6}" text-anchor="end">{x1:.0f}</text></svg>')


def svg_uri(svg: str) -> str:
    return f"data:image/svg+xml;base64,{base64.b64encode(svg.encode()).decode()}"


def metrics_table(records: dict[str, dict[str, Any]], config_name: str) -> None:
    create_table_artifact(redact(metrics_rows(records)), key=artifact_key("metrics", config_name),
                          description=f"eagle3-pipeline {config_name}: one row per step")


def metrics_rows(records: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per step in four columns: the step, its artifact, its seconds and its headline metrics in one
    cell (`tokens 1234 · tau 1.338`). A column per metric made the table wider than the page: the UI cut it at
    the right edge."""
    return [{"step": name, "artifact": f"{r['kind']}/{r['id']}", "seconds": r["seconds"],
             "metrics": " · ".join(f"{k} {_fmt(r['metrics'][k])}" for k in HEADLINE if k in r["metrics"])}
            for name, r in records.items()]


def _fmt(v: Any) -> Any:
    # τ, speedup, loss: three decimals everywhere a user reads them (1.338, not 1.338095238095238)
    return round(v, 3) if isinstance(v, float) else v


def run_result(records: dict[str, dict[str, Any]], decision: dict[str, Any], *, export_uri: str,
               launch: str | None = None, launch_file: str | None = None) -> dict[str, Any]:
    """What a user wants from a finished run: the verdict and why, live and offline numbers (named as such),
    and where the exported drafter is."""
    candidate = decision.get("candidate") or {}
    offline = (records.get("verify") or {}).get("metrics", {})
    failing = [f["id"] for f in decision.get("diagnosis", []) if f["status"] == "fail"]
    data = (records.get("datagen") or {}).get("metrics", {})
    reading = None if decision["verdict"] != "zero-acceptance" else read_no_acceptance(
        candidate.get("tau"), offline.get("tau"), failing, answers=data.get("ok"), needed=data.get("answers_needed"))
    return {"verdict": decision["verdict"], "reasons": list(decision.get("reasons", [])), "diagnosis": reading,
            "tau_live": candidate.get("tau"), "speedup_live": candidate.get("speedup"),
            "tau_offline": offline.get("tau"),
            "speedup_offline": offline.get("speedup"),
            "export": export_uri, "sglang": f"{shown(export_uri)}/sglang", "vllm": f"{shown(export_uri)}/vllm",
            "doctor": failing, "fix": (decision.get("fix") or {}).get("how"), "launch": launch,
            "launch_file": launch_file, "report": None}


def shown(uri: str) -> str:
    """A location as a user pastes it: a file store's as its absolute path, anything else as its URI."""
    return uri.removeprefix("file://") if uri.startswith("file:///") else uri


def state_message(result: dict[str, Any]) -> str:
    """The run's state message (the UI's run header, `--watch`'s last line): the verdict and why, τ, the draft or
    the diagnosis, the report. Short: the launch command is the log's (and a script's)."""
    parts = [f"{result['verdict']}: " + "; ".join(result["reasons"]),
             f"τ {_num(result['tau_live'], 3)} live, {_num(result['tau_offline'], 3)} offline",
             result["diagnosis"] if result.get("diagnosis") else f"draft {result['sglang']}"]
    if result.get("report"):
        parts.append(f"report {result['report']}")
    return " | ".join(parts)


def result_lines(result: dict[str, Any]) -> list[str]:
    """The run's closing log lines (what `prefect deployment run --watch` ends with)."""
    lines = [*([f"report: {result['report']}"] if result.get("report") else []),
             f"gate: {result['verdict']}: " + "; ".join(result["reasons"]),
             *([f"diagnosis: {result['diagnosis']}"] if result.get("diagnosis") else []),
             f"τ {_num(result['tau_live'], 3)} live, {_num(result['tau_offline'], 3)} offline (reference engine, "
             f"held-out prompts); speedup {_num(result['speedup_live'], 2, 'x')} live, "
             f"{_num(result['speedup_offline'], 2, 'x')} offline",
             f"draft: {result['sglang']} (SGLang), {result['vllm']} (vLLM)"]
    if result.get("launch_file"):
        lines.append(f"serve it: sh {result['launch_file']}")
    elif result.get("launch"):
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
        if result.get("launch"):
            lines += ["```sh", result["launch"], "```", ""]
    lines += ["## Lineage", "", f"dataset source: `{dataset or 'the config dataset.sources'}`", "",
              *_store_line(records), "| step | artifact | seconds |", "|---|---|---|"]
    lines += [f"| {n} | `{r['kind']}/{r['id']}` | {r['seconds']} |" for n, r in records.items()]
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
        lines += ["", "## Benchmark", "", f"![benchmark]({png_uri(plot_png)})"]
    return "\n".join(lines) + "\n"


def _store_line(records: dict[str, dict[str, Any]]) -> list[str]:
    """Where the lineage's artifacts are, said once above the table: every one is `<root>/artifacts/<kind>/<id>`,
    and a URI column made the table wider than the page. A record stored elsewhere keeps its URI in the line."""
    tails = [(r["uri"], f"/artifacts/{r['kind']}/{r['id']}") for r in records.values()]
    roots = {uri[:-len(tail)] if uri.endswith(tail) else None for uri, tail in tails}
    if len(roots) == 1 and None not in roots:
        return [f"artifacts under `{shown(roots.pop())}/artifacts/<kind>/<id>`", ""]
    return ["artifacts: " + ", ".join(f"`{shown(r['uri'])}`" for r in records.values()), ""]


def shell_lines(argv: list[str]) -> str:
    """A command as a shell reads it back, each `--option` (with its values) on a line of its own after a `\\`:
    the report and the launch script show a twenty-option SGLang command that fits the page, and `sh` parses it
    into the same argv."""
    import shlex

    lines: list[str] = []
    for arg in argv:
        if lines and not arg.startswith("--"):
            lines[-1] += " " + shlex.quote(arg)
        else:
            lines.append(shlex.quote(arg))
    return " \\\n    ".join(lines)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def publish_report(config_name: str, markdown: str) -> str | None:
    """Publish the run report; its address in the Prefect UI (None where no UI address is known)."""
    from prefect.settings import PREFECT_UI_URL

    artifact_id = create_markdown_artifact(redact_text(markdown), key=artifact_key("report", config_name),
                                           description="lineage, gate decision, diagnosis and benchmark of this run")
    ui_url = PREFECT_UI_URL.value()
    return f"{ui_url.rstrip('/')}/artifacts/artifact/{artifact_id}" if ui_url and artifact_id else None
