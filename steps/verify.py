"""Verify: offline τ of an exported SGLang draft with the reference engine, before any serving (F9).

Reads: an `export` artifact's `sglang/` directory — loaded with SGLang's own key rules
(`steps.lib.formats.sglang_loader.load_sglang_draft`: dropped keys stay random, d2t → hot ids, the target's
embedding), so a broken export shows here as τ ≈ 1 (F2, F3) — and the `target` artifact; the
capture layers are read back from the exported `eagle_config` and converted as SGLang does (F4).
Held-out prompts: MT-bench first turns (`verify.categories`, `verify.num_prompts`) in the target's
chat template, greedy, `verify.max_new_tokens`, chain of `serve.num_steps` drafts; and, when
`dataset.held_out` > 0, the held-out split of the training sources (metrics `tau_in_distribution`,
`per_position_acceptance_in_distribution`); with `verify.code_prompts` > 0, HumanEval stubs (`tau_humaneval`; the
config refuses it where HumanEval is trained on).
`verify.turns: 2` adds the second turns after the target's own first answers; `verify.chain_lengths` measures
several k (the served one is the headline, every one under `by_chain_length`); `verify.batch_size` decodes
prompts together (`steps.lib.model.batched_engine`); each τ has a seeded 95% bootstrap `tau_interval`;
`verify.dtype: bfloat16` decodes target and draft in the served dtype (float32 by default: exact comparisons).
`verify.engine: server` (a target that does not fit one device) loads neither target nor draft here: the same
prompts are decoded by the `serve.engine` server started from the export (SGLang with the derived EAGLE3 flags,
or the reference server), plain on the baseline, then speculatively, one server at a time
(`steps.lib.serving.offline`); accept counts come from each request's meta_info, the record is the same.
Writes: a `verify` artifact with `report.json` (per prompt: tokens, accept histogram, timings) and
metrics τ, per-position acceptance, accept histogram, tokens/s speculative vs plain, speedup, and on MT-bench the
draft vocab's share of the target's answer tokens (`draft_vocab_coverage`) and of the rejections
(`rejections_outside_draft_vocab`).
Speculative output must equal plain greedy output for every prompt; any mismatch fails the step.

    python -m steps.verify --config tiny --export <export_id> --target <target_id>
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from steps.lib.artifacts import export_dir, inference_device, load_target, load_tokenizer, target_dir
from steps.lib.config import PipelineConfig, VerifyConfig, config_dict
from steps.lib.data.prompts import (
    held_out_prompts,
    humaneval_prompts,
    in_distribution_prompts,
    load_mtbench,
    mtbench_selection,
    second_turn_prompts,
)
from steps.lib.formats.sglang import sglang_layer_ids
from steps.lib.formats.sglang_loader import draft_vocab, load_sglang_draft
from steps.lib.layer_ids import target_architecture
from steps.lib.metrics import AcceptStats, pooled_tau, rejected_tokens, tau_interval
from steps.lib.model.batched_engine import BatchedEngine
from steps.lib.model.decode import decode
from steps.lib.model.reference_engine import Engine
from steps.lib.serving import offline
from steps.lib.store import Manifest, Store, artifact_id
from steps.registry import step_main

STEP = "verify"


class VerifyError(RuntimeError):
    """Speculative decoding changed the output: the engine or the draft wiring is wrong."""


#: a held-out prompt: (id, chat-templated token ids).
Prompt = tuple[str, list[int]]
#: one decoded prompt: (new tokens, cut after the first eos as the engine cuts them; seconds it took)
Output = tuple[list[int], float]
#: one speculatively decoded prompt: (new tokens, its accept counts, seconds it took)
SpecOutput = tuple[list[int], AcceptStats, float]


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


@dataclass
class Decoding:
    """How verify decodes held-out prompts: in this process (`local_decoding`) or through served engines
    (`served_decoding`, verify.engine: server). Every record and figure is computed from these by one code."""
    num_steps: int                                                  # the served chain length k
    plain: Callable[[list[Prompt]], list[Output]]
    spec: Callable[[list[Prompt], int], list[SpecOutput]]           # (prompts, k)
    gap: Callable[[list[int], int, int], float]                     # (context, plain token, spec token)


def local_decoding(engine: Engine, max_new_tokens: int, eos: Any, *, batch_size: int = 1) -> Decoding:
    """The target and draft loaded here: the reference engine (at any chain length) and its logit gaps (in the
    dtype they decode in)."""
    def spec(prompts: list[Prompt], k: int) -> list[SpecOutput]:
        at_k = engine if k == engine.k else Engine(engine.target, engine.tokenizer, engine.draft,
                                                   layer_ids=engine.layer_ids, num_steps=k, algorithm=engine.algorithm)
        return spec_outputs(at_k, prompts, max_new_tokens, eos, batch_size=batch_size)

    def plain(prompts: list[Prompt]) -> list[Output]:
        return plain_outputs(engine, prompts, max_new_tokens, eos, batch_size=batch_size)

    return Decoding(engine.k, plain, spec, lambda context, a, b: logit_gap(engine, context, a, b))


def measure(engine: Engine, prompts: list[Prompt], max_new_tokens: int, eos: Any, *,
            batch_size: int = 1, tie_tolerance: float = 0.0, plain: list[Output] | None = None
            ) -> tuple[AcceptStats, list[dict[str, Any]]]:
    """`compare` with the engine loaded here."""
    return compare(local_decoding(engine, max_new_tokens, eos, batch_size=batch_size), prompts, engine.k,
                   tie_tolerance=tie_tolerance, plain=plain)


def compare(decoding: Decoding, prompts: list[Prompt], k: int, *, tie_tolerance: float = 0.0,
            plain: list[Output] | None = None, proposable: set[int] | None = None
            ) -> tuple[AcceptStats, list[dict[str, Any]]]:
    """Run every prompt speculatively at chain length k and plainly (`plain` when already decoded); per-prompt
    records with timings and equality. A first difference whose logit gap is within `tie_tolerance` is a near tie.
    Given the target ids the draft can propose, and where the engine counted its verify steps in order (decoded
    here), each record also counts its rejected drafts and those whose right token the draft vocab lacks."""
    plain = decoding.plain(prompts) if plain is None else plain
    total, rows = AcceptStats(k), []
    for (pid, ids), (spec, stats, spec_s), (ref, plain_s) in zip(prompts, decoding.spec(prompts, k), plain,
                                                                 strict=True):
        total.merge(stats)
        first_diff = first_difference(spec, ref)
        row = {"id": pid, "num_steps": k, "prompt_tokens": len(ids), "tokens": len(spec), "spec_s": spec_s,
               "plain_s": plain_s, "accept_histogram": stats.histogram, "tau": stats.tau,
               "match": first_diff is None, "first_diff": first_diff}
        if proposable is not None and len(stats.rounds) == stats.verify_steps:
            rejected = rejected_tokens(spec, stats.rounds, k)
            row |= {"rejections": len(rejected),
                    "rejections_outside_draft_vocab": sum(t not in proposable for t in rejected)}
        if (key := differing_tokens(ids, spec, ref)) is not None:
            gap = decoding.gap(list(key[0]), key[1], key[2])
            row |= {"logit_gap": gap, "near_tie": gap <= tie_tolerance, "match": gap <= tie_tolerance}
        rows.append(row)
    return total, rows


def first_difference(spec: list[int], ref: list[int]) -> int | None:
    """The first position where the speculative output leaves plain greedy's (one being longer counts)."""
    return next((i for i, (a, b) in enumerate(zip(spec, ref, strict=False)) if a != b),
                None if len(spec) == len(ref) else min(len(spec), len(ref)))


def differing_tokens(ids: list[int], spec: list[int], ref: list[int]) -> tuple[tuple[int, ...], int, int] | None:
    """(context, plain token, speculative token) at the first token the two outputs disagree on, if any."""
    i = first_difference(spec, ref)
    if i is None or i >= min(len(spec), len(ref)):
        return None
    return tuple(ids + ref[:i]), ref[i], spec[i]


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
    if cfg.verify.engine == "server":      # which engine served it, with which draft flags, is what was measured
        section["served_by"] = {k: getattr(cfg.serve, k) for k in ("engine", "eagle_topk", "num_draft_tokens")}
    # the chain length is serve's (one field); in the id under its old name, so ids measured before stay
    return {**section, "num_steps": cfg.serve.num_steps,
            **mtbench_selection(cfg.verify.categories, cfg.verify.num_prompts)}


def second_turn(cfg: PipelineConfig, tokenizer: Any, first: list[Prompt], plain_first: list[Output]) -> list[Prompt]:
    """The second turns, after the target's own plain greedy first answers as serving would have given them."""
    answers = {pid: tokenizer.decode(out, skip_special_tokens=True)
               for (pid, _), (out, _) in zip(first, plain_first, strict=True)}
    return second_turn_prompts(cfg, tokenizer, answers)


def measure_mtbench(cfg: PipelineConfig, decoding: Decoding, tokenizer: Any, proposable: set[int] | None = None
                    ) -> tuple[dict[str, Any], list[dict]]:
    """MT-bench τ at each chain length, over the first turns and (`verify.turns` 2) the second turns after the
    target's own first answers; the served k's figures are the headline, every k's under `by_chain_length`.
    Given the target ids the draft can propose (`proposable`), also `draft_vocab_coverage`: the share of the
    target's answer tokens among them (a token outside is never drafted, so its position is rejected whatever the
    draft learned), and, decoded here, `rejections_outside_draft_vocab` at each k: the rejections it caused."""
    v = cfg.verify
    first = held_out_prompts(cfg, tokenizer)
    turns = [(1, first, decoding.plain(first))]
    if v.turns == 2:
        second = second_turn(cfg, tokenizer, first, turns[0][2])
        turns.append((2, second, decoding.plain(second)))
    answers = [t for _, _, plain in turns for out, _ in plain for t in out]
    coverage = ({"draft_vocab_coverage": sum(t in proposable for t in answers) / len(answers)}
                if proposable is not None and answers else {})
    by_k, all_rows = {}, []
    for k in v.chain_lengths or [cfg.serve.num_steps]:
        total, rows, per_turn = AcceptStats(k), [], {}
        for turn, prompts, plain in turns:
            turn_total, turn_rows = compare(decoding, prompts, k, tie_tolerance=v.tie_tolerance, plain=plain,
                                            proposable=proposable)
            total.merge(turn_total)
            per_turn[f"tau_turn{turn}"] = turn_total.tau
            rows += [{**r, "turn": turn} for r in turn_rows]
        by_k[k] = {**summarize(total, rows, seed=cfg.seed, samples=v.bootstrap_samples), **per_turn,
                   **outside_vocab_share(rows)}
        all_rows += rows
    metrics = dict(by_k[cfg.serve.num_steps]) | coverage
    if v.chain_lengths is not None:
        metrics["by_chain_length"] = {str(k): m for k, m in by_k.items()}
    served = [r for r in all_rows if r["num_steps"] == cfg.serve.num_steps]
    metrics["tau_by_category"] = tau_by_category(cfg, served)
    return metrics, all_rows


def tau_by_category(cfg: PipelineConfig, rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """τ of each MT-bench category (both turns of its questions) with its interval, from records at one k: where
    the draft lags (math, roleplay, ...) says which prompts the training data lacks."""
    category = {q["id"]: q["category"] for q in load_mtbench(cfg.verify.categories, cfg.verify.num_prompts)}
    groups: dict[str, list[list[int]]] = {}
    for r in rows:
        groups.setdefault(category[r["id"].removesuffix("-turn2")], []).append(r["accept_histogram"])
    return {name: {"tau": pooled_tau(histograms), "prompts": len(histograms),
                   "tau_interval": tau_interval(histograms, seed=cfg.seed, samples=cfg.verify.bootstrap_samples)}
            for name, histograms in sorted(groups.items())}


def outside_vocab_share(rows: list[dict[str, Any]]) -> dict[str, float]:
    """`rejections_outside_draft_vocab`: the share of rejected drafts whose right token is outside the draft vocab
    (rejections no training wins back: a token outside the map is never drafted), where the records count them."""
    counted = [r for r in rows if "rejections" in r]
    rejections = sum(r["rejections"] for r in counted)
    if not counted or not rejections:
        return {}
    return {"rejections_outside_draft_vocab": sum(r["rejections_outside_draft_vocab"] for r in counted) / rejections}


def served_decoding(cfg: PipelineConfig, store: Store, export_id: str, target_id: str, tokenizer: Any,
                    in_dist: list[Prompt]) -> tuple[Decoding, dict[str, Any]]:
    """Every prompt verify measures, decoded through served engines before any figure is computed, one server
    at a time: plain on the baseline server (the second turns built from its answers), speculative on the
    draft's, and only where the two differ, the baseline's logit gaps. -> (the Decoding that reads them back,
    the speculative server's /server_info)."""
    v = cfg.verify
    opts = {"max_new_tokens": v.max_new_tokens, "concurrency": v.batch_size}
    first = held_out_prompts(cfg, tokenizer)
    with offline.one_server(cfg, store, export_id, target_id, baseline=True) as (url, _):
        plain = dict(zip([pid for pid, _ in first], offline.plain_outputs(url, [ids for _, ids in first], **opts),
                         strict=True))
        rest = (second_turn(cfg, tokenizer, first, [plain[pid] for pid, _ in first]) if v.turns == 2 else []) + in_dist
        plain |= zip([pid for pid, _ in rest], offline.plain_outputs(url, [ids for _, ids in rest], **opts),
                     strict=True)
    prompts = first + rest
    with offline.one_server(cfg, store, export_id, target_id, baseline=False) as (url, info):
        spec = dict(zip([pid for pid, _ in prompts],
                        offline.spec_outputs(url, [ids for _, ids in prompts], num_steps=cfg.serve.num_steps, **opts),
                        strict=True))
    wanted = [key for pid, ids in prompts if (key := differing_tokens(ids, spec[pid][0], plain[pid][0])) is not None]
    gaps: dict[tuple, float] = {}
    if wanted:       # a third start, only when some output differs: the gap tells a near tie from a wrong draft
        with offline.one_server(cfg, store, export_id, target_id, baseline=True) as (url, _):
            gaps = offline.logit_gaps(url, wanted)
    return Decoding(cfg.serve.num_steps, plain=lambda ps: [plain[pid] for pid, _ in ps],
                    spec=lambda ps, k: [spec[pid] for pid, _ in ps],
                    gap=lambda context, a, b: gaps[(tuple(context), a, b)]), info


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
    v = cfg.verify
    if v.engine == "server":      # the target stays in the serving engine; this process holds its tokenizer only
        tokenizer = load_tokenizer(store, target_id)
        in_prompts = in_distribution_prompts(cfg, tokenizer) if in_dist else []
        code = humaneval_prompts(tokenizer, v.code_prompts)
        decoding, info = served_decoding(cfg, store, export_id, target_id, tokenizer, in_prompts + code)
        arch = target_architecture(json.loads((target_dir(store, target_id) / "config.json").read_text()))
        load_report = info.get("draft_load_report")           # the reference server reports it; SGLang does not
        loaded = load_report or {}
        meta = {"layer_ids": sglang_layer_ids(sglang_dir, arch), "algorithm": info.get("speculative_algorithm"),
                "dropped_keys": loaded.get("dropped"), "missing_params": loaded.get("missing"),
                "engine": "server", "server": {"engine": cfg.serve.engine, "version": info.get("version")}}
    else:
        dtype = getattr(torch, v.dtype)
        target, tokenizer = load_target(store, target_id, device=inference_device(), dtype=dtype)
        in_prompts = in_distribution_prompts(cfg, tokenizer) if in_dist else []
        code = humaneval_prompts(tokenizer, v.code_prompts)
        draft, report = load_sglang_draft(sglang_dir, target=target)     # SGLang's rules, not ours
        draft = draft.to(dtype)
        served = sglang_layer_ids(sglang_dir, target_architecture(target.config.to_dict()))   # F4, as SGLang shifts
        engine = Engine(target, tokenizer, draft, layer_ids=served, num_steps=cfg.serve.num_steps)
        decoding = local_decoding(engine, v.max_new_tokens, tokenizer.eos_token_id, batch_size=v.batch_size)
        load_report = report.to_dict()
        meta = {"layer_ids": engine.layer_ids, "algorithm": engine.algorithm, "dropped_keys": report.dropped,
                "missing_params": report.missing,     # the dtype the weights decoded in, read off them
                "dtype": {"target": str(next(target.parameters()).dtype).removeprefix("torch."),
                          "draft": str(next(draft.parameters()).dtype).removeprefix("torch.")}}
    metrics, rows = measure_mtbench(cfg, decoding, tokenizer, draft_vocab(sglang_dir))
    for split, prompts in (("in_distribution", in_prompts), ("humaneval", code)):
        if prompts:     # one turn at the served k, each figure under its split's suffix
            split_total, split_rows = compare(decoding, prompts, decoding.num_steps, tie_tolerance=v.tie_tolerance)
            metrics |= {f"tau_{split}": split_total.tau,
                        f"tau_interval_{split}": tau_interval([r["accept_histogram"] for r in split_rows],
                                                              seed=cfg.seed, samples=v.bootstrap_samples),
                        f"per_position_acceptance_{split}": split_total.per_position,
                        f"prompts_{split}": len(split_rows)}
            rows += [{**r, "split": split} for r in split_rows]
    writer = store.begin("verify", verify_id, step=STEP, inputs=inputs, config=section)
    writer.path("report.json").write_text(json.dumps({"prompts": rows, "load_report": load_report}, indent=2))
    bad = [r for r in rows if not r["match"]]
    if bad:   # the report stays in staging for inspection; no manifest, so no artifact
        raise VerifyError(f"verify of export {export_id}: speculative output differs from plain greedy for "
                          f"{len(bad)}/{len(rows)} prompts (first: {bad[0]['id']} at token {bad[0]['first_diff']}; "
                          f"see {writer.staging / 'report.json'}); greedy verification must be lossless — the "
                          "engine or the draft wiring is wrong")
    return writer.commit(metrics=metrics, meta=meta)


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
