"""Datagen tokens/s against batch size, side by side in one process (SmolLM2-135M by default).

    python benchmarks/datagen_batching.py [--store file://out/store] [--threads 1] [--batches 8,32]

Needs a target artifact in the store (`make demo` or `eaglenest target --config smollm2-135m` makes one).
"""

from __future__ import annotations

import argparse
import time

import torch

from steps.datagen import generate_local
from steps.lib.artifacts import load_target
from steps.lib.config import DatagenConfig
from steps.lib.data.prompts import load_stdlib
from steps.lib.store import open_store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="file://out/store")
    parser.add_argument("--target", default=None, help="target artifact id (default: the first in the store)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    store = open_store(args.store)
    model, tok = load_target(store, args.target or store.list("target")[0])
    ids = []
    for p in load_stdlib()[:args.prompts]:
        x = tok.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=True)
        ids.append(x if isinstance(x, list) else x["input_ids"])
    for bs in (int(b) for b in args.batches.split(",")):
        dg = DatagenConfig(max_new_tokens=args.new_tokens, batch_size=bs)
        t0 = time.perf_counter()
        for b in range(0, len(ids), bs):
            generate_local(model, tok, ids[b:b + bs], dg, 0)
        tokens = len(ids) * args.new_tokens            # an upper bound: answers that stop early count in full
        print(f"threads={args.threads} batch={bs}: {tokens / (time.perf_counter() - t0):.1f} tok/s")


if __name__ == "__main__":
    main()
