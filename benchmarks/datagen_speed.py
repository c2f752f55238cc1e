"""Datagen answer tokens/s: `model.generate` (datagen before 2026-12-01) against the batched decode loop
(`steps/lib/model/decode.py`), side by side in one process on the demo's own prompts.

    python benchmarks/datagen_speed.py --store file://out/store [--prompts 64] [--new-tokens 128]
        [--batches 32,64] [--threads 0]

The paths take turns group by group (one group = the largest batch's worth of prompts, sorted by
length as datagen sorts them), so a machine whose load changes during the run slows all of them
alike. Counts real answer tokens (rows that stop early count what they produced) and checks that
the loop's greedy tokens equal generate's at the same batch size. Needs a target artifact in the
store (`eaglenest target --config smollm2-135m` makes one).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from steps.datagen import stop_token_ids
from steps.lib.artifacts import load_target
from steps.lib.config import find_config, load_config
from steps.lib.data.prompts import chat_token_ids, load_prompts
from steps.lib.model.decode import cpu_threads, decode, generate_reference
from steps.lib.store import open_store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="file://out/store")
    parser.add_argument("--target", default=None, help="target artifact id (default: the first in the store)")
    parser.add_argument("--config", default="configs/smollm2-135m.yaml", help="whose dataset prompts to answer")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads of the old path (0: torch's default, as datagen had)")
    parser.add_argument("--batches", default="32,64", help="batch sizes of the new loop (old runs at the first)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()

    old_threads = args.threads or torch.get_num_threads()
    store = open_store(args.store)
    model, tok = load_target(store, args.target or store.list("target")[0])
    cfg = load_config(find_config(args.config))
    prompts = load_prompts(cfg.dataset, cfg.seed)[:args.prompts]
    ids = [chat_token_ids(tok, p["messages"]) for p in prompts]
    stops = stop_token_ids(tok, model.config)
    pad = tok.pad_token_id if tok.pad_token_id is not None else stops[0]
    batches = [int(b) for b in args.batches.split(",")]
    paths = {f"old generate b{batches[0]}": (batches[0], "old")} | {f"new loop b{b}": (b, "new") for b in batches}
    seconds = dict.fromkeys(paths, 0.0)
    answers: dict[str, list[list[int]]] = {name: [] for name in paths}
    used: dict[str, list[int]] = {name: [] for name in paths}
    group = max(batches)
    for g in range(0, len(ids), group):
        chunk = sorted(ids[g:g + group], key=len)
        for name, (bs, kind) in paths.items():
            t0 = time.perf_counter()
            threads = old_threads if kind == "old" else cpu_threads()     # new: picked by the load, per group
            used[name].append(threads)
            for b in range(0, len(chunk), bs):
                batch = chunk[b:b + bs]
                torch.set_num_threads(threads)
                if kind == "old":
                    answers[name] += [a.tokens for a in generate_reference(model, batch, args.new_tokens, stops, pad)]
                else:
                    answers[name] += [a.tokens for a in decode(model, batch, args.new_tokens, stops, pad)]
            seconds[name] += time.perf_counter() - t0
    print(f"{len(ids)} prompts of {args.config}, {args.new_tokens} new tokens, "
          f"load average {os.getloadavg()[0]:.1f} at the end")
    base = None
    old_name = next(iter(paths))
    for name in paths:
        n = sum(len(a) for a in answers[name])
        rate = n / seconds[name]
        base = base or rate
        same = sum(a == b for a, b in zip(answers[name], answers[old_name], strict=True))
        print(f"{name:20s} {seconds[name]:8.1f} s {n:7d} answer tokens {rate:7.1f} tok/s  {rate / base:4.2f}x  "
              f"same tokens as old: {same}/{len(ids)}  threads per group {used[name]}")


if __name__ == "__main__":
    main()
