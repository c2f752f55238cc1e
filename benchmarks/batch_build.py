"""Building the training batches from a shard (`steps.lib.training.plan.make_batch`) at the H200 recipe's
shapes: a 65,536-token shard of SmolLM2-135M states (3 aux layers × 576 + 576, float32 once decoded),
batches of 8 rows × 1,024 tokens packed from two-turn-sized sequences (300-700 tokens).

    python benchmarks/batch_build.py [--batches 64] [--repeat 3]

Prints ms per batch for each place the shard can live: `host` (built on the CPU, then copied to the
training device: what train did for every step before 2026-12-04) and, on a GPU, `device` (the shard
decoded on the GPU, the batch built there: what train does now). A copy of this file inside another
checkout times that checkout's make_batch (it imports the checkout it sits in): benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHARD_TOKENS, AUX, HIDDEN, MAX_LENGTH, ROWS = 65_536, 3 * 576, 576, 1024, 8


def synthetic_shard(device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths, left = [], SHARD_TOKENS
    while left > 0:
        n = min(left, int(torch.randint(300, 700, (1,), generator=g)))
        lengths.append(n)
        left -= n
    shard = {"input_ids": torch.randint(0, 49_152, (SHARD_TOKENS,), generator=g),
             "loss_mask": (torch.rand(SHARD_TOKENS, generator=g) > 0.4).to(torch.uint8),
             "aux_hidden": torch.randn(SHARD_TOKENS, AUX, generator=g),
             "final_hidden": torch.randn(SHARD_TOKENS, HIDDEN, generator=g)}
    shard = {k: v.to(device) for k, v in shard.items()}
    shard["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return shard


def time_batches(shard: dict[str, torch.Tensor], batches: int, train_device: torch.device) -> float:
    """ms per batch, from the plan's rows to a Batch on `train_device` (as the training loop does)."""
    from steps.lib.training.plan import build_plan, make_batch

    lengths = shard["cu_seqlens"].diff().tolist()
    plan = build_plan({"s": lengths}, epochs=4, seed=0, max_length=MAX_LENGTH, rows_per_batch=ROWS)[:batches]
    sync = torch.cuda.synchronize if train_device.type == "cuda" else (lambda: None)
    make_batch(shard, plan[0][1], MAX_LENGTH).to(train_device)       # warm-up
    sync()
    t0 = time.perf_counter()
    for _, rows in plan:
        batch = make_batch(shard, rows, MAX_LENGTH).to(train_device)
    sync()
    assert batch.aux.device.type == train_device.type
    return (time.perf_counter() - t0) / len(plan) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    import steps.lib.training.plan as plan

    train_device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    places = {"host": torch.device("cpu")} | ({"device": train_device} if train_device.type == "cuda" else {})
    print(f"make_batch from {Path(plan.__file__).resolve().parents[3]}, training on {train_device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, where in places.items():
        shard = synthetic_shard(where)
        runs = [time_batches(shard, args.batches, train_device) for _ in range(args.repeat)]
        print(f"shard on {name}: {statistics.median(runs):.1f} ms/batch (median of {args.repeat}: "
              f"{', '.join(f'{r:.1f}' for r in runs)})")


if __name__ == "__main__":
    main()
