"""Benchmark: tokens/s and live τ of the served draft against the no-draft baseline, on pinned prompts.

Reads: the `export` and `target` artifacts; two servers speaking SGLang's API — started here through
`steps.lib.serving.start.start` (engine `cfg.serve.engine`: SGLang or the reference server; the baseline is the
same command without the `--speculative-*` flags), or given as URLs. Prompts are pinned: the held-out
MT-bench first turns `steps.verify` measures offline τ on (same selection, same chat template) plus
the first HumanEval stubs, all recorded by id in the report.
Writes: a `benchmark` artifact with `benchmark.json` (settings, prompt ids, server facts, hardware,
per temperature × batch size: tokens/s both ways, speedup, live τ, per-position acceptance, TTFT
and inter-token latency), `report.md` and `benchmark.png`.

F9: live τ is computed client-side from each finished request's meta_info,
Σ(spec_num_correct_drafts + spec_verify_ct) / Σ spec_verify_ct (`steps.lib.metrics`), never from the
server's cumulative `avg_spec_accept_length`, so it is comparable with verify's offline τ: offline
good + live ≈ 1 means serving is misconfigured, not training.

    python -m steps.benchmark --config tiny --export <export_id> --target <target_id> \\
        [--baseline-url URL --spec-url URL]
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from steps.lib.artifacts import load_tokenizer
from steps.lib.config import BenchmarkConfig, PipelineConfig, config_dict
from steps.lib.data.prompts import held_out_prompts, humaneval_prompts, mtbench_selection
from steps.lib.http import get_json, json_stream
from steps.lib.metrics import AcceptStats, acceptance_length_from_requests
from steps.lib.runtime.processes import forwarding_signals
from steps.lib.serving import start as serving
from steps.lib.serving.client import generate_all, request_stats
from steps.lib.store import Manifest, Store, artifact_id, utc_now
from steps.registry import step_main

STEP = "benchmark"
#: a request longer than this is a hung server, not a slow one.
REQUEST_TIMEOUT_S = 600.0


def settings_for(cfg: PipelineConfig) -> BenchmarkConfig:
    """What is measured: the config's `benchmark` section."""
    return cfg.benchmark


# --- pinned prompts ----------------------------------------------------------------------------------

def pinned_prompts(cfg: PipelineConfig, settings: BenchmarkConfig, tokenizer: Any) -> list[dict[str, Any]]:
    """verify's held-out MT-bench prompts + the first HumanEval stubs, chat-templated: a deterministic list."""
    rows = [{"id": pid, "source": "mtbench", "input_ids": ids} for pid, ids in held_out_prompts(cfg, tokenizer)]
    rows += [{"id": pid, "source": "humaneval", "input_ids": ids}
             for pid, ids in humaneval_prompts(tokenizer, settings.num_code_prompts)]
    for r in rows:     # /v1/completions takes text: the same templated prompt, decoded
        r["text"] = tokenizer.decode(r["input_ids"])
    return rows


# --- the client ----------------------------------------------------------------------------------------

def stream_completion(base_url: str, prompt: str, *, max_tokens: int, temperature: float) -> dict[str, Any]:
    """One streamed /v1/completions request: time to first text chunk and the gaps between chunks."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "stream": True}
    t0 = time.perf_counter()
    arrivals, usage = [], {}
    with json_stream(f"{base_url}/v1/completions", body, REQUEST_TIMEOUT_S) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            if chunk["choices"] and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter() - t0)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {"ttft_s": arrivals[0] if arrivals else None, "itl_s": gaps,
            "completion_tokens": usage.get("completion_tokens")}


def run_load(base_url: str, prompts: list[dict[str, Any]], *, batch: int, settings: BenchmarkConfig,
             temperature: float) -> dict[str, Any]:
    """Every prompt through /generate, `batch` requests in flight at a time -> tokens/s and meta_infos."""
    t0 = time.perf_counter()
    responses = generate_all(base_url, [p["input_ids"] for p in prompts], concurrency=batch,
                             max_new_tokens=settings.max_new_tokens, temperature=temperature,
                             ignore_eos=settings.ignore_eos)
    wall_s = time.perf_counter() - t0
    metas = [r["meta_info"] for r in responses]
    tokens = sum(int(m["completion_tokens"]) for m in metas)
    return {"batch": batch, "requests": len(metas), "completion_tokens": tokens, "wall_s": wall_s,
            "tokens_per_s": tokens / wall_s if wall_s else 0.0,
            "mean_e2e_latency_s": statistics.fmean(float(m["e2e_latency"]) for m in metas), "meta_infos": metas}


def acceptance(metas: list[dict[str, Any]], num_steps: int) -> dict[str, Any] | None:
    """Live τ (client-side, the one formula) and per-position acceptance from the summed histograms."""
    spec = [m for m in metas if int(m.get("spec_verify_ct", 0)) > 0]
    if not spec:
        return None
    stats = [request_stats(m, num_steps) for m in spec]
    total = AcceptStats(max(s.num_steps for s in stats))
    for s in stats:
        total.merge(s)
    return {"tau": acceptance_length_from_requests(spec), "per_position_acceptance": total.per_position,
            "accept_histogram": total.histogram, "verify_steps": total.verify_steps,
            "accepted_drafts": total.accepted_drafts}


def latency(base_url: str, prompts: list[dict[str, Any]], settings: BenchmarkConfig,
            temperature: float) -> dict[str, Any]:
    """TTFT and inter-token latency from streamed completions, one request at a time."""
    runs = [stream_completion(base_url, p["text"], max_tokens=settings.max_new_tokens, temperature=temperature)
            for p in prompts[:settings.stream_prompts]]
    ttft = [r["ttft_s"] for r in runs if r["ttft_s"] is not None]
    gaps = [g for r in runs for g in r["itl_s"]]
    return {"ttft_s": statistics.fmean(ttft) if ttft else None, "itl_s": statistics.fmean(gaps) if gaps else None,
            "itl_p50_s": statistics.median(gaps) if gaps else None, "streamed_requests": len(runs)}


def measure_server(base_url: str, prompts: list[dict[str, Any]], settings: BenchmarkConfig, temperature: float,
                   num_steps: int) -> dict[str, Any]:
    """One server at one temperature: every batch size, acceptance (spec only) and streaming latency."""
    try:
        loads = [run_load(base_url, prompts, batch=b, settings=settings, temperature=temperature)
                 for b in settings.batch_sizes]
    except urllib.error.HTTPError as err:        # e.g. the greedy-only reference server refusing temperature 1
        return {"error": f"HTTP {err.code}: {err.read().decode()[:300]}"}
    out = {"batches": {str(r["batch"]): {k: v for k, v in r.items() if k != "meta_infos"} for r in loads}}
    out["acceptance"] = acceptance([m for r in loads for m in r["meta_infos"]], num_steps)
    out["latency"] = latency(base_url, prompts, settings, temperature)
    return out


# --- servers and facts -----------------------------------------------------------------------------------

@contextlib.contextmanager
def servers(cfg: PipelineConfig, store: Store, export_id: str, target_id: str, *, baseline_url: str | None,
            spec_url: str | None) -> Iterator[tuple[str, str, dict[str, str]]]:
    """(baseline URL, speculative URL, serve artifact ids): given URLs are used, the others started and stopped."""
    port = cfg.serve.port
    wanted = {"baseline": (baseline_url, True, port + 1), "speculative": (spec_url, False, port)}
    with ThreadPoolExecutor(max_workers=2) as pool:     # both load at once: startup dominates on a CPU
        futures = {name: pool.submit(serving.start, cfg, store, export_id, target_id, baseline=base, port=p)
                   for name, (url, base, p) in wanted.items() if url is None}
    started, errors = {}, []

    def stop_all() -> None:
        for _, server in started.values():
            server.stop()

    for name, future in futures.items():
        try:
            started[name] = future.result()
        except Exception as err:  # noqa: BLE001 — stop the other server before re-raising
            errors.append(err)
    if errors:
        stop_all()
        raise errors[0]
    try:
        # a cancelled run (SIGTERM) must not leave the servers, each in its own session, running
        with forwarding_signals(stop_all):
            urls = {name: url or started[name][1].base_url for name, (url, _, _) in wanted.items()}
            yield urls["baseline"], urls["speculative"], {name: m.id for name, (m, _) in started.items()}
    finally:
        stop_all()


def server_facts(base_url: str) -> dict[str, Any]:
    info = get_json(f"{base_url}/server_info")
    keys = ("version", "engine", "model_path", "speculative_algorithm", "speculative_draft_model_path",
            "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
    return {"url": base_url, **{k: info.get(k) for k in keys}}


def hardware() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "gpu": gpu, "torch": torch.__version__,
            "python": platform.python_version()}


# --- the report ------------------------------------------------------------------------------------------

def summarize(results: dict[str, dict[str, Any]], settings: BenchmarkConfig) -> dict[str, Any]:
    """Headline metrics: greedy, batch 1 (the first temperature and batch size measured)."""
    temp, batch = str(settings.temperatures[0]), str(settings.batch_sizes[0])
    base, spec = results[temp]["baseline"], results[temp]["speculative"]
    if "error" in base or "error" in spec:
        return {"error": base.get("error") or spec.get("error")}
    b, s = base["batches"][batch]["tokens_per_s"], spec["batches"][batch]["tokens_per_s"]
    acc = spec["acceptance"] or {"tau": 0.0, "per_position_acceptance": []}
    return {"tau": acc["tau"], "per_position_acceptance": acc["per_position_acceptance"],
            "baseline_tokens_per_s": b, "spec_tokens_per_s": s, "speedup": s / b if b else 0.0,
            "spec_ttft_s": spec["latency"]["ttft_s"], "spec_itl_s": spec["latency"]["itl_s"],
            "baseline_itl_s": base["latency"]["itl_s"]}


def markdown(report: dict[str, Any]) -> str:
    m, sp = report["metrics"], report["servers"]["speculative"]
    lines = [f"# Benchmark: export {report['inputs']['export']}", "",
             f"Engine `{sp['version']}`, {sp['speculative_algorithm']} steps={sp['speculative_num_steps']} "
             f"topk={sp['speculative_eagle_topk']} draft tokens={sp['speculative_num_draft_tokens']}; "
             f"hardware: {report['hardware']['gpu'] or report['hardware']['cpu']}.", "",
             f"**Live τ {m.get('tau', 0):.3f}** (client-side over finished requests), "
             f"**speedup {m.get('speedup', 0):.2f}×** at batch {report['settings']['batch_sizes'][0]}.", "",
             "| temperature | batch | baseline tok/s | speculative tok/s | speedup | live τ |",
             "|---|---|---|---|---|---|"]
    for temp, r in report["results"].items():
        if "error" in r["baseline"] or "error" in r["speculative"]:
            lines.append(f"| {temp} | – | {r['baseline'].get('error', '')} | {r['speculative'].get('error', '')} | | |")
            continue
        tau = (r["speculative"]["acceptance"] or {}).get("tau", 0.0)
        for batch, b in r["baseline"]["batches"].items():
            s = r["speculative"]["batches"][batch]
            lines.append(f"| {temp} | {batch} | {b['tokens_per_s']:.1f} | {s['tokens_per_s']:.1f} | "
                         f"{s['tokens_per_s'] / b['tokens_per_s']:.2f} | {tau:.3f} |")
    pos = ", ".join(f"{p:.2f}" for p in m.get("per_position_acceptance", []))
    lines += ["", f"Per-position acceptance: {pos}", "",
              f"TTFT {_ms(m.get('spec_ttft_s'))}; time between streamed chunks {_ms(m.get('spec_itl_s'))} "
              f"(speculative: one chunk per verify step, τ tokens) vs {_ms(m.get('baseline_itl_s'))} (baseline: one "
              "token per chunk).", "",
              f"Prompts ({len(report['prompts'])}, pinned): {', '.join(report['prompts'])}", ""]
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f} ms"


def plot(report: dict[str, Any], path: Any) -> None:
    """tokens/s baseline vs speculative per batch size, and per-position acceptance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = report["results"][str(report["settings"]["temperatures"][0])]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    if "error" not in r["baseline"] and "error" not in r["speculative"]:
        batches = list(r["baseline"]["batches"])
        xs = range(len(batches))
        ax1.bar([x - 0.2 for x in xs], [r["baseline"]["batches"][b]["tokens_per_s"] for b in batches], 0.4,
                label="baseline")
        ax1.bar([x + 0.2 for x in xs], [r["speculative"]["batches"][b]["tokens_per_s"] for b in batches], 0.4,
                label="speculative")
        ax1.set_xticks(list(xs), [f"batch {b}" for b in batches])
    ax1.set_ylabel("tokens/s")
    ax1.legend()
    per_pos = report["metrics"].get("per_position_acceptance", [])
    ax2.bar(range(1, len(per_pos) + 1), per_pos)
    ax2.set_xlabel("draft position")
    ax2.set_ylabel("P(accepted)")
    ax2.set_ylim(0, 1)
    fig.suptitle(f"live τ = {report['metrics'].get('tau', 0):.3f}")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


# --- step ------------------------------------------------------------------------------------------------

def run(cfg: PipelineConfig, store: Store, export_id: str, target_id: str, *, baseline_url: str | None = None,
        spec_url: str | None = None, attempt: int = 1) -> Manifest:
    """Baseline vs speculative on the pinned prompts; writes the benchmark artifact.

    `attempt` > 1 asks for a new measurement of the same export (after the gate relaunched serving).
    """
    settings = settings_for(cfg)
    # verify's section for its prompt selection; where and in what verify decodes (engine, dtype) is not benchmark's
    verify_section = {**{k: v for k, v in config_dict(cfg.verify).items() if k not in ("engine", "dtype")},
                      **mtbench_selection(cfg.verify.categories, cfg.verify.num_prompts)}
    section = {"benchmark": config_dict(settings), "serve": config_dict(cfg.serve), "verify": verify_section,
               **({"attempt": attempt} if attempt > 1 else {})}
    if spec_url or baseline_url:   # a server run by someone else may change under the same URL: always measure
        section["external"] = {"spec_url": spec_url, "baseline_url": baseline_url, "measured": utc_now()}
    inputs = {"export": export_id, "target": target_id}
    bench_id = artifact_id("benchmark", section, inputs)
    if store.exists("benchmark", bench_id):
        return store.manifest("benchmark", bench_id)
    prompts = pinned_prompts(cfg, settings, load_tokenizer(store, target_id))
    with servers(cfg, store, export_id, target_id, baseline_url=baseline_url, spec_url=spec_url) as (b, s, ids):
        facts = {"baseline": server_facts(b), "speculative": server_facts(s)}
        k = int(facts["speculative"]["speculative_num_steps"] or cfg.serve.num_steps)
        results = {str(t): {"baseline": measure_server(b, prompts, settings, t, k),
                            "speculative": measure_server(s, prompts, settings, t, k)}
                   for t in settings.temperatures}
    report = {"inputs": inputs, "settings": config_dict(settings), "prompts": [p["id"] for p in prompts],
              "servers": facts, "serve_artifacts": ids, "hardware": hardware(), "results": results,
              "metrics": summarize(results, settings)}
    writer = store.begin("benchmark", bench_id, step=STEP, inputs=inputs, config=section)
    writer.path("benchmark.json").write_text(json.dumps(report, indent=2))
    writer.path("report.md").write_text(markdown(report))
    plot(report, writer.path("benchmark.png"))
    return writer.commit(metrics=report["metrics"], meta={"servers": facts, "hardware": report["hardware"],
                                                          "prompts": report["prompts"]})


def main(argv: list[str] | None = None) -> int:
    return step_main("benchmark", argv)


if __name__ == "__main__":
    raise SystemExit(main())
