"""`eaglenest plan --config C`: what a run will need before any GPU hour is spent.

Prints the tokens (an upper bound from the config: prompts × the longest sequence it lets through),
the bytes of hidden states per storage dtype, the extract → upload → delete rounds under the disk
budget, the hours per step at the rates measured in docs/PERFORMANCE.md (each figure names its
source; a backend with no measurement here says so and is bounded by its write path), and the
object-store bytes. Refuses, one line and exit 2, a config whose disk budget cannot hold one shard
or whose capture backend cannot hold the target. Reads nothing but the config (and a target's
config.json when the config declares no shape).

    eaglenest plan --config configs/moe-7168.yaml [--prompts N] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from steps.lib.config import ConfigError, PipelineConfig, load_config
from steps.lib.data.shards import bytes_per_token, shard_bytes_bound
from steps.lib.errors import InputError
from steps.lib.extraction.capture import ABSURD_EXTRACT_HOURS

STORAGE_DTYPES = ("bfloat16", "float8_e4m3fn")
#: shapes of the built-in targets (hidden_size, num_hidden_layers).
BUILTIN_SHAPES = {"smollm2": (576, 30)}
#: prompts assumed when the config caps none (all of the sources): say so, and take --prompts.
ASSUMED_PROMPTS = 10_000

#: rates, tok/s on one H200, with where each comes from. Extraction of an 8B target (H 4096) with the
#: shard write; training of the 8B-shaped and of the 7168-wide draft.
RATES: dict[str, tuple[float, str]] = {
    "extract_local": (11_242, "docs/PERFORMANCE.md, 1 H200, 8B target, capture + shard write, 2026-11-29"),
    "train_4096": (35_259, "docs/PERFORMANCE.md, 1 H200, 8B-shaped draft, TTT 7, 2026-11-29"),
    "train_7168": (17_523, "docs/PERFORMANCE.md, 1 H200, 7168-wide draft, FSDP2, 2026-11-29"),
    "extract_sglang": (40, "issue 24: SGLang 0.5.23 hidden states through JSON, 20-40 tok/s end to end "
                           "(the upper figure; CPU-timed stages)"),
}
#: one shard writer's rate on the H200 machine (issue 24): bounds any backend's write path.
WRITER_BYTES_PER_S = 1.0e9


class PlanError(InputError):
    """A config the plan refuses: one line naming the field and the fix."""


def target_shape(cfg: PipelineConfig, where: str) -> tuple[int, int]:
    """(hidden_size, num_hidden_layers) from the config, the built-in target, or the target's config.json."""
    t = cfg.target
    if t.source == "tiny":
        return t.tiny.hidden_size, t.tiny.num_hidden_layers
    if t.source in BUILTIN_SHAPES:
        return BUILTIN_SHAPES[t.source]
    if t.hidden_size and t.num_hidden_layers:
        return t.hidden_size, t.num_hidden_layers
    config = Path(str(t.path)) / "config.json"
    if not config.is_file():
        raise PlanError(f"{where}: target.hidden_size / target.num_hidden_layers not declared and {config} not "
                        "found; declare them to plan")
    real = json.loads(config.read_text())
    real = real.get("text_config", real)
    return int(real["hidden_size"]), int(real["num_hidden_layers"])


def prompts(cfg: PipelineConfig, override: int | None) -> tuple[int, str]:
    if override:
        return override, "--prompts"
    if cfg.dataset.max_prompts:
        return cfg.dataset.max_prompts, "dataset.max_prompts"
    limits = [s.limit for s in cfg.dataset.sources]
    if all(limits):
        return sum(limits), "the sum of dataset.sources[].limit"
    return ASSUMED_PROMPTS, "assumed (the config caps none; pass --prompts N)"


def check_backend(cfg: PipelineConfig, where: str) -> None:
    """A local backend holds the target on one device: refused for a target served over several GPUs."""
    tp = cfg.target.tensor_parallel_size
    if cfg.extract.backend == "local" and tp > 1:
        raise PlanError(f"{where}: extract.backend=local loads the target on one device, but target."
                        f"tensor_parallel_size={tp}; set extract.backend=sharded or sglang_runner (torchrun "
                        f"--nproc-per-node {tp})")


def extract_rate(cfg: PipelineConfig, bpt: int) -> tuple[float, str]:
    """tok/s of the configured capture backend, capped by one writer's bytes/s."""
    cap = WRITER_BYTES_PER_S / bpt
    backend = cfg.extract.backend
    if backend == "sglang":
        return RATES["extract_sglang"]
    if backend in ("sharded", "sglang_runner"):
        return cap, (f"not measured on GPUs: bounded by one shard writer, {WRITER_BYTES_PER_S / 1e9:.0f} GB/s "
                     f"(issue 24) / {bpt} B a token")
    rate, source = RATES["extract_local"]
    return (min(rate, cap), source + ("" if rate <= cap else "; capped by one shard writer at 1 GB/s"))


def plan(cfg: PipelineConfig, *, where: str, prompts_override: int | None = None) -> dict[str, Any]:
    """The plan record; raises PlanError for a config that cannot run as written."""
    ex = cfg.extract
    check_backend(cfg, where)
    hidden, layers = target_shape(cfg, where)
    num_aux = len(ex.aux_layer_ids) if ex.aux_layer_ids else 3
    n_prompts, prompts_from = prompts(cfg, prompts_override)
    seq = min(ex.max_length, cfg.datagen.max_prompt_tokens + cfg.datagen.max_new_tokens)
    tokens = n_prompts * seq
    per_dtype = {d: bytes_per_token(hidden, num_aux, d) for d in STORAGE_DTYPES}
    shard = shard_bytes_bound(ex.shard_tokens, 1, hidden_size=hidden, num_aux=num_aux, storage_dtype=ex.storage_dtype)
    if shard > ex.disk_budget_bytes:
        raise PlanError(f"{where}: extract.disk_budget={ex.disk_budget_bytes} bytes cannot hold one shard "
                        f"({shard} bytes: extract.shard_tokens={ex.shard_tokens} × {per_dtype[ex.storage_dtype]} B "
                        f"in {ex.storage_dtype}); raise extract.disk_budget or lower extract.shard_tokens")
    bpt = per_dtype[ex.storage_dtype]
    rate, rate_source = extract_rate(cfg, bpt)
    if ex.backend == "sglang" and tokens / rate / 3600 > ABSURD_EXTRACT_HOURS:
        tp = cfg.target.tensor_parallel_size
        raise PlanError(f"{where}: extract.backend=sglang: {tokens / rate / 3600:,.0f} h for {tokens:,} tokens at ≤ "
                        f"{rate:.0f} tok/s (hidden states through JSON) on two servers of the target (aux + final, "
                        f"2 × TP={tp}: twice its weights' memory); set extract.backend=sharded (torchrun "
                        f"--nproc-per-node {tp})")
    train_rate, train_source = RATES["train_7168" if hidden >= 7168 else "train_4096"]
    shards_per_round = max(1, ex.disk_budget_bytes // shard)
    return {
        "config": where, "target": {"hidden_size": hidden, "num_hidden_layers": layers, "num_aux": num_aux},
        "prompts": n_prompts, "prompts_from": prompts_from, "tokens_per_sequence_max": seq,
        "tokens": tokens, "bytes_per_token": per_dtype,
        "hidden_bytes": {d: tokens * b for d, b in per_dtype.items()},
        "storage_dtype": ex.storage_dtype, "object_store_bytes": tokens * bpt,
        "rounds": math.ceil(math.ceil(tokens / ex.shard_tokens) / shards_per_round),
        "shard_bytes_max": shard, "disk_budget_bytes": ex.disk_budget_bytes,
        "hours": {"extract": tokens / rate / 3600, "train": tokens * cfg.train.epochs / train_rate / 3600},
        "rates": {"extract": {"backend": ex.backend, "tok_per_s": rate, "source": rate_source},
                  "train": {"tok_per_s": train_rate, "source": train_source, "gpus": 1}},
    }


def render(p: dict[str, Any]) -> str:
    gb = 1e9
    lines = [f"plan for {p['config']} (hidden {p['target']['hidden_size']}, {p['target']['num_hidden_layers']} "
             f"layers, {p['target']['num_aux']} aux + final)",
             f"tokens ≤ {p['tokens']:,} ({p['prompts']:,} prompts from {p['prompts_from']} × ≤ "
             f"{p['tokens_per_sequence_max']} tokens)"]
    lines += [f"hidden states in {d}: {p['bytes_per_token'][d]:,} B a token → {p['hidden_bytes'][d] / gb:,.1f} GB"
              for d in STORAGE_DTYPES]
    lines.append(f"rounds under the {p['disk_budget_bytes'] / gb:,.1f} GB disk budget: {p['rounds']} "
                 f"(one shard ≤ {p['shard_bytes_max'] / gb:,.2f} GB, {p['storage_dtype']})")
    lines.append(f"object store: {p['object_store_bytes'] / gb:,.1f} GB ({p['storage_dtype']})")
    for step in ("extract", "train"):
        r = p["rates"][step]
        lines.append(f"{step}: {p['hours'][step]:,.1f} h at {r['tok_per_s']:,.0f} tok/s ({r['source']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eaglenest plan", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="the pipeline config (YAML)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts to plan for (default: the config's cap)")
    ap.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    args = ap.parse_args(argv)
    try:
        record = plan(load_config(args.config), where=args.config, prompts_override=args.prompts)
    except (ConfigError, InputError, OSError, ValueError) as err:
        print(f"eaglenest plan: {err}", file=sys.stderr)
        return 2
    print(json.dumps(record) if args.json else render(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
