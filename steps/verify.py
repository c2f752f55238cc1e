"""Verify: offline τ of an exported SGLang draft with the reference engine, before any serving (F9).

Reads: an `export` artifact's `sglang/` directory — loaded with SGLang's own key rules
(`steps.lib.formats.sglang_loader.load_sglang_draft`: dropped keys stay random, d2t → hot ids, the target's
embedding), so a broken export shows here as τ ≈ 1 (F2, F3) — and the `target` artifact; the
capture layers are read back from the exported `eagle_config` and converted as SGLang does (F4).
Held-out prompts: MT-bench first turns (`verify.categories`, `verify.num_prompts`) in the target's
chat template, greedy, `verify.max_new_tokens`, chain of `serve.num_steps` drafts; and, when
`dataset.held_out` > 0, the held-out split of the training sources (metrics `tau_in_distribution`,
`per_position_acceptance_in_distribution`).
`verify.turns: 2` adds the second turns after the target's own first answers; `verify.chain_lengths` measures
several k (the served one is the headline, every one under `by_chain_length`); `verify.batch_size` decodes
prompts together (`steps.lib.model.batched_engine`); each τ has a seeded 95% bootstrap `tau_interval`.
Writes: a `verify` artifact with `report.json` (per prompt: tokens, accept histogram, timings) and
metrics τ, per-position acceptance, accept histogram, tokens/s speculative vs plain, speedup.
Speculative output must equal plain greedy output for every prompt; any mismatch fails the step.

    python -m steps.verify --config tiny --export <export_id> --target <target_id>
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from steps.lib.artifacts import export_dir, inference_device, load_target
from steps.lib.config import PipelineConfig, VerifyConfig, config_dict
from steps.lib.data.prompts import held_out_prompts, in_distribution_prompts, second_turn_prompts
from steps.lib.formats.sglang import sglang_layer_ids
from steps.lib.formats.sglang_loader import load_sglang_draft
from steps.lib.layer_ids import target_architecture
from steps.lib.metrics import AcceptStats, tau_interval
from steps.lib.model.batched_engine import BatchedEngine
from steps.lib.model.decode import decode
from steps.lib.model.reference_engine import Engine
from steps.lib.store import Manifest, Store, artifact_id
from steps.registry import step_main

STEP = "verify"


class VerifyError(RuntimeError):
    """Speculative decoding changed the output: the engine or the draft wiring is wrong."""


#: one decoded prompt: (new tokens, cut after the first eos as the engine cuts them; seconds it took)
Output = tuple[list[int], float]


def plain_outputs(engine: Engine, prompts: list[tuple[str, list[int]]], max_new_tokens: int, eos: int | None, *,
                  batch_size: int = 1) -> list[Output]:
    """Plain greedy decoding of every prompt by the target alone: one at a time, or batched by `decode`
    (a batch's seconds shared evenly by its rows)."""
    if batch_size == 1:
        return [_timed(lambda ids=ids: engine.generate_plain(ids, max_new_tokens, eos)) for _, ids in prompts]
    out: list[Output] = []
    for chunk in _chunks([ids for _, ids in prompts], batch_size):
        t0 = time.perf_counter()
        answers = decode(engine.target, chunk, max_new_tokens, [] if eos is None else [eos], pad=PAD)
        s = (time.perf_counter() - t0) / len(chunk)
        out += [(a.tokens + ([eos] if a.finished else []), s) for a in answers]     # the engine keeps the eos
    return out


def spec_outputs(engine: Engine, prompts: list[tuple[str, list[int]]], max_new_tokens: int, eos: int | None, *,
                 batch_size: int = 1) -> list[tuple[list[int], AcceptStats, float]]:
    """Speculative greedy decoding of every prompt: one at a time (the reference engine), or batched."""
    if batch_size == 1:
        out = []
        for _, ids in prompts:
            t0 = time.perf_counter()
            tokens, stats = engine.generate(ids, max_new_tokens, eos)
            out.append((tokens, stats, time.perf_counter() - t0))
        return out
    batched, out = BatchedEngine(engine, pad_token_id=PAD), []
    for chunk in _chunks([ids for _, ids in prompts], batch_size):
        t0 = time.perf_counter()
        results = batched.generate(chunk, max_new_tokens, eos)
        s = (time.perf_counter() - t0) / len(chunk)
        out += [(tokens, stats, s) for tokens, stats in results]
    return out


def measure(engine: Engine, prompts: list[tuple[str, list[int]]], max_new_tokens: int, eos: Any, *,
            batch_size: int = 1, tie_tolerance: float = 0.0, plain: list[Output] | None = None
            ) -> tuple[AcceptStats, list[dict[str, Any]]]:
    """Run every prompt speculatively and plainly (`plain` when already decoded); per-prompt records with
    timings and equality. A first difference whose logit gap is within `tie_tolerance` is a near tie."""
    plain = plain_outputs(engine, prompts, max_new_tokens, eos, batch_size=batch_size) if plain is None else plain
    total, rows = AcceptStats(engine.k), []
    for (pid, ids), (spec, stats, spec_s), (ref, plain_s) in zip(
            prompts, spec_outputs(engine, prompts, max_new_tokens, eos, batch_size=batch_size), plain, strict=True):
        total.merge(stats)
        first_diff = next((i for i, (a, b) in enumerate(zip(spec, ref, strict=False)) if a != b),
                          None if len(spec) == len(ref) else min(len(spec), len(ref)))
        row = {"id": pid, "num_steps": engine.k, "prompt_tokens": len(ids), "tokens": len(spec), "spec_s": spec_s,
               "plain_s": plain_s, "accept_histogram": stats.histogram, "tau": stats.tau,
               "match": first_diff is None, "first_diff": first_diff}
        if first_diff is not None and first_diff < min(len(spec), len(ref)):
            gap = logit_gap(engine, ids + ref[:first_diff], ref[first_diff], spec[first_diff])
            row |= {"logit_gap": gap, "near_tie": gap <= tie_tolerance, "match": gap <= tie_tolerance}
        rows.append(row)
    return total, rows


@torch.no_grad()
def logit_gap(engine: Engine, context: list[int], plain_token: int, spec_token: int) -> float:
    """The target's logit of plain greedy's token minus the speculative one's after `context`, in float32
    from one plain forward: 0 is an exact tie; a bf16 verify forward can flip gaps of an ulp or two."""
    logits = engine.target(input_ids=torch.tensor([context], device=engine.device)).logits[0, -1].float()
    return float(logits[plain_token] - logits[spec_token])


def summarize(total: AcceptStats, rows: list[dict[str, Any]], *, seed: int = 0, samples: int = 1000
              ) -> dict[str, Any]:
    """Offline τ with its 95% bootstrap interval over prompts, per-position acceptance, histogram, tokens/s
    both ways and the speedup."""
    tokens = sum(r["tokens"] for r in rows)
    spec_s, plain_s = sum(r["spec_s"] for r in rows), sum(r["plain_s"] for r in rows)
    return {**total.to_dict(), "prompts": len(rows), "tokens": tokens,
            "tau_interval": tau_interval([r["accept_histogram"] for r in rows], seed=seed, samples=samples),
            "spec_tokens_per_s": tokens / spec_s if spec_s else 0.0,
            "plain_tokens_per_s": tokens / plain_s if plain_s else 0.0,
            "speedup": plain_s / spec_s if spec_s else 0.0,
            "mismatches": sum(not r["match"] for r in rows),
            "near_ties": sum(bool(r.get("near_tie")) for r in rows)}


#: 2: τ under `tau` (1 stored it as `acceptance_length`).
METRICS_SCHEMA = 2
#: the pad id of batched decoding: any id works, padded columns are masked out.
PAD = 0


def verify_section(cfg: PipelineConfig) -> dict[str, Any]:
    """What the verify id hashes: the verify section less how work is batched and less new fields at their
    id-neutral defaults (ids measured before they existed stay), with the served chain length."""
    section = {key: value for key, value in config_dict(cfg.verify).items() if key != "batch_size"
               and not (key in VerifyConfig.ID_NEUTRAL_DEFAULTS and value == VerifyConfig.ID_NEUTRAL_DEFAULTS[key])}
    # the chain length is serve's (one field); in the id under its old name, so ids measured before stay
    return {**section, "num_steps": cfg.serve.num_steps}


def measure_mtbench(cfg: PipelineConfig, engine: Engine, tokenizer: Any) -> tuple[dict[str, Any], list[dict]]:
    """MT-bench τ at each chain length, over the first turns and (`verify.turns` 2) the second turns after the
    target's own first answers; the served k's figures are the headline, every k's under `by_chain_length`."""
    v, eos = cfg.verify, tokenizer.eos_token_id
    opts = {"batch_size": v.batch_size, "tie_tolerance": v.tie_tolerance}
    first = held_out_prompts(cfg, tokenizer)
    turns = [(1, first, plain_outputs(engine, first, v.max_new_tokens, eos, batch_size=v.batch_size))]
    if v.turns == 2:    # the history is the target's own plain greedy answer, as serving would have given it
        answers = {pid: tokenizer.decode(out, skip_special_tokens=True)
                   for (pid, _), (out, _) in zip(first, turns[0][2], strict=True)}
        second = second_turn_prompts(cfg, tokenizer, answers)
        turns.append((2, second, plain_outputs(engine, second, v.max_new_tokens, eos, batch_size=v.batch_size)))
    by_k, all_rows = {}, []
    for k in v.chain_lengths or [cfg.serve.num_steps]:
        at_k = engine if k == engine.k else Engine(engine.target, tokenizer, engine.draft, layer_ids=engine.layer_ids,
                                                   num_steps=k, algorithm=engine.algorithm)
        total, rows, per_turn = AcceptStats(k), [], {}
        for turn, prompts, plain in turns:
            turn_total, turn_rows = measure(at_k, prompts, v.max_new_tokens, eos, plain=plain, **opts)
            total.merge(turn_total)
            per_turn[f"tau_turn{turn}"] = turn_total.tau
            rows += [{**r, "turn": turn} for r in turn_rows]
        by_k[k] = {**summarize(total, rows, seed=cfg.seed, samples=v.bootstrap_samples), **per_turn}
        all_rows += rows
    metrics = dict(by_k[cfg.serve.num_steps])
    if v.chain_lengths is not None:
        metrics["by_chain_length"] = {str(k): m for k, m in by_k.items()}
    return metrics, all_rows


def run(cfg: PipelineConfig, store: Store, export_id: str, target_id: str) -> Manifest:
    """Offline τ of the exported SGLang draft; fails if speculative output differs from plain greedy."""
    section = verify_section(cfg)
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
    metrics, rows = measure_mtbench(cfg, engine, tokenizer)
    if in_dist:
        v = cfg.verify
        in_total, in_rows = measure(engine, in_distribution_prompts(cfg, tokenizer), v.max_new_tokens,
                                    tokenizer.eos_token_id, batch_size=v.batch_size, tie_tolerance=v.tie_tolerance)
        metrics |= {"tau_in_distribution": in_total.tau,
                    "tau_interval_in_distribution": tau_interval([r["accept_histogram"] for r in in_rows],
                                                                 seed=cfg.seed, samples=v.bootstrap_samples),
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


def _timed(fn: Any) -> Output:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def main(argv: list[str] | None = None) -> int:
    return step_main("verify", argv)


if __name__ == "__main__":
    raise SystemExit(main())
