"""Verify: offline τ of an exported SGLang draft with the reference engine, before any serving (F9).

Reads: an `export` artifact's `sglang/` directory — loaded with SGLang's own key rules
(`steps.lib.formats.sglang_loader.load_sglang_draft`: dropped keys stay random, d2t → hot ids, the target's
embedding), so a broken export shows here as τ ≈ 1 (F2, F3) — and the `target` artifact; the
capture layers are read back from the exported `eagle_config` and converted as SGLang does (F4).
Held-out prompts: MT-bench first turns (`verify.categories`, `verify.num_prompts`) in the target's
chat template, greedy, `verify.max_new_tokens`, chain of `serve.num_steps` drafts; and, when
`dataset.held_out` > 0, the held-out split of the training sources (metrics `tau_in_distribution`,
`per_position_acceptance_in_distribution`).
Writes: a `verify` artifact with `report.json` (per prompt: tokens, accept histogram, timings) and
metrics τ, per-position acceptance, accept histogram, tokens/s speculative vs plain, speedup.
Speculative output must equal plain greedy output for every prompt; any mismatch fails the step.

    python -m steps.verify --config tiny --export <export_id> --target <target_id>
"""

from __future__ import annotations

import json
import time
from typing import Any

from steps.lib.artifacts import export_dir, inference_device, load_target
from steps.lib.config import PipelineConfig, config_dict
from steps.lib.data.prompts import held_out_prompts, in_distribution_prompts
from steps.lib.formats.sglang import sglang_layer_ids
from steps.lib.formats.sglang_loader import load_sglang_draft
from steps.lib.layer_ids import target_architecture
from steps.lib.metrics import AcceptStats
from steps.lib.model.reference_engine import Engine
from steps.lib.store import Manifest, Store, artifact_id
from steps.registry import step_main

STEP = "verify"


class VerifyError(RuntimeError):
    """Speculative decoding changed the output: the engine or the draft wiring is wrong."""


def measure(engine: Engine, prompts: list[tuple[str, list[int]]], max_new_tokens: int, eos: Any
            ) -> tuple[AcceptStats, list[dict[str, Any]]]:
    """Run every prompt speculatively and plainly; per-prompt records with timings and equality."""
    total, rows = AcceptStats(engine.k), []
    for pid, ids in prompts:
        t0 = time.perf_counter()
        spec, stats = engine.generate(ids, max_new_tokens, eos)
        t1 = time.perf_counter()
        plain = engine.generate_plain(ids, max_new_tokens, eos)
        t2 = time.perf_counter()
        total.merge(stats)
        first_diff = next((i for i, (a, b) in enumerate(zip(spec, plain, strict=False)) if a != b),
                          None if len(spec) == len(plain) else min(len(spec), len(plain)))
        rows.append({"id": pid, "prompt_tokens": len(ids), "tokens": len(spec), "spec_s": t1 - t0,
                     "plain_s": t2 - t1, "accept_histogram": stats.histogram, "tau": stats.tau,
                     "match": first_diff is None, "first_diff": first_diff})
    return total, rows


def summarize(total: AcceptStats, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Offline τ, per-position acceptance, histogram, tokens/s both ways and the speedup."""
    tokens = sum(r["tokens"] for r in rows)
    spec_s, plain_s = sum(r["spec_s"] for r in rows), sum(r["plain_s"] for r in rows)
    return {**total.to_dict(), "prompts": len(rows), "tokens": tokens,
            "spec_tokens_per_s": tokens / spec_s if spec_s else 0.0,
            "plain_tokens_per_s": tokens / plain_s if plain_s else 0.0,
            "speedup": plain_s / spec_s if spec_s else 0.0,
            "mismatches": sum(not r["match"] for r in rows)}


#: 2: τ under `tau` (1 stored it as `acceptance_length`).
METRICS_SCHEMA = 2


def run(cfg: PipelineConfig, store: Store, export_id: str, target_id: str) -> Manifest:
    """Offline τ of the exported SGLang draft; fails if speculative output differs from plain greedy."""
    # the chain length is serve's (one field); in the id under its old name, so ids measured before stay
    section = {**config_dict(cfg.verify), "num_steps": cfg.serve.num_steps}
    inputs = {"export": export_id, "target": target_id}
    in_dist = cfg.dataset.held_out and cfg.verify.in_distribution_prompts != 0
    if in_dist:    # which prompts the in-distribution split holds is part of what is measured
        section["in_distribution"] = {"dataset": config_dict(cfg.dataset), "seed": cfg.seed}
    # METRICS_SCHEMA is in the id: a verify artifact from before τ was stored as `tau` is measured again
    # rather than reused with metrics its readers no longer know
    verify_id = artifact_id("verify", {**section, "metrics_schema": METRICS_SCHEMA}, inputs)
    if store.exists("verify", verify_id):
        return store.manifest("verify", verify_id)
    sglang_dir = export_dir(store, export_id, "sglang")       # a vLLM-only export: refused before any loading
    target, tokenizer = load_target(store, target_id, device=inference_device())
    draft, load_report = load_sglang_draft(sglang_dir, target=target)     # SGLang's rules, not ours
    served = sglang_layer_ids(sglang_dir, target_architecture(target.config.to_dict()))   # F4, as SGLang shifts
    engine = Engine(target, tokenizer, draft, layer_ids=served, num_steps=cfg.serve.num_steps)
    total, rows = measure(engine, held_out_prompts(cfg, tokenizer), cfg.verify.max_new_tokens,
                          tokenizer.eos_token_id)
    metrics = summarize(total, rows)
    if in_dist:
        in_total, in_rows = measure(engine, in_distribution_prompts(cfg, tokenizer), cfg.verify.max_new_tokens,
                                    tokenizer.eos_token_id)
        metrics |= {"tau_in_distribution": in_total.tau,
                    "per_position_acceptance_in_distribution": in_total.per_position,
                    "prompts_in_distribution": len(in_rows)}
        rows += [{**r, "split": "in_distribution"} for r in in_rows]
    writer = store.begin("verify", verify_id, step=STEP, inputs=inputs, config=section)
    writer.path("report.json").write_text(json.dumps({"prompts": rows, "load_report": load_report.to_dict()},
                                                     indent=2))
    bad = [r for r in rows if not r["match"]]
    if bad:   # the report stays in staging for inspection; no manifest, so no artifact
        raise VerifyError(f"verify of export {export_id}: speculative output differs from plain greedy for "
                          f"{len(bad)}/{len(rows)} prompts (first: {bad[0]['id']} at token {bad[0]['first_diff']}; "
                          f"see {writer.staging / 'report.json'}); greedy verification must be lossless — the "
                          "engine or the draft wiring is wrong")
    return writer.commit(metrics=metrics, meta={"layer_ids": engine.layer_ids, "algorithm": engine.algorithm,
                                                "dropped_keys": load_report.dropped,
                                                "missing_params": load_report.missing})


def main(argv: list[str] | None = None) -> int:
    return step_main("verify", argv)


if __name__ == "__main__":
    raise SystemExit(main())
