"""The batch plan and the shard reader: sequences packed first-fit into rows of `max_length`, rows into
batches of ~`batch_tokens`, in a seeded order planned before the first step (every shard of every epoch);
shards read through a bounded local cache (F8); each rank takes every N-th row of a planned batch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from steps.lib.data.shards import read_shard
from steps.lib.runtime import distributed
from steps.lib.store import LocalCache, Manifest, Store


@dataclass
class Batch:
    """Packed rows; `doc` numbers the sequences of a row (-1 = padding)."""
    input_ids: Tensor     # [B, L] int64
    loss_mask: Tensor     # [B, L] bool
    doc: Tensor           # [B, L] int64
    pos: Tensor           # [B, L] int64, position inside its sequence
    aux: Tensor           # [B, L, A*Ht]
    final: Tensor         # [B, L, Ht]

    @property
    def tokens(self) -> int:
        return int((self.doc >= 0).sum())

    def to(self, device: torch.device) -> Batch:
        return Batch(*(getattr(self, f).to(device) for f in Batch.__dataclass_fields__))


def shard_paths(hidden: Manifest) -> list[str]:
    shards = hidden.meta.get("shards")
    paths = [s["path"] for s in shards] if shards else [f["path"] for f in hidden.files
                                                        if f["path"].startswith("shards/")]
    if not paths:
        raise ValueError(f"hidden artifact {hidden.id} lists no shards; re-run extract")
    return sorted(paths)


def pack(lengths: list[int], order: list[int], max_length: int) -> list[list[tuple[int, int]]]:
    """First-fit packing of sequences (in `order`) into rows of `max_length`: [(seq, length), ...]."""
    rows: list[list[tuple[int, int]]] = []
    free: list[int] = []
    for i in order:
        n = min(lengths[i], max_length)            # longer sequences are truncated
        r = next((k for k, f in enumerate(free) if f >= n), None)
        if r is None:
            rows.append([])
            free.append(max_length)
            r = len(rows) - 1
        rows[r].append((i, n))
        free[r] -= n
    return rows


#: `train.epochs: auto` trains this many tokens in all, in 2 to 12 passes over the data (benchmarks/README.md,
#: issue 23's curves on SmolLM2-135M: at 1.92M sequence tokens τ rose at 3, 6 and 12 epochs; at 5.5M (10k
#: written two-turn prompts) 16.5M trained tokens gave MT-bench τ 2.146 at 3/1/4 and 44M gave 2.429, τ_sim
#: still rising at the end; peers train ~500k samples for 2–3 epochs; beyond 12 passes the CPU demo's small
#: data overfits, and τ can peak and fall, which train.keep_best guards).
AUTO_EPOCH_TOKENS = 44_000_000
AUTO_EPOCHS_MIN, AUTO_EPOCHS_MAX = 2.0, 12.0


def auto_epochs(train_tokens: int) -> float:
    """Epochs for `train.epochs: auto`: AUTO_EPOCH_TOKENS over the data's trained tokens, clamped to 2..12."""
    if train_tokens <= 0:
        return AUTO_EPOCHS_MAX
    return min(AUTO_EPOCHS_MAX, max(AUTO_EPOCHS_MIN, AUTO_EPOCH_TOKENS / train_tokens))


def build_plan(shard_lengths: dict[str, list[int]], *, epochs: float, seed: int, max_length: int,
               rows_per_batch: int, exclude: dict[str, set[int]] | None = None
               ) -> list[tuple[str, list[list[tuple[int, int]]]]]:
    """Every batch of the run, in order: (shard, rows). Epoch e visits shards in a seeded order and
    each shard's sequences in a seeded order; a fractional last epoch keeps its first batches.
    `exclude` (shard -> sequence indices: the held-out split) are never planned; the seeded orders
    are drawn as without it, so an empty split plans exactly the same batches."""
    plan = []
    names = sorted(shard_lengths)
    for epoch in range(math.ceil(epochs)):
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        epoch_plan = []
        for s in torch.randperm(len(names), generator=g).tolist():
            lengths = shard_lengths[names[s]]
            skip = (exclude or {}).get(names[s], set())
            order = [i for i in torch.randperm(len(lengths), generator=g).tolist() if i not in skip]
            rows = pack(lengths, order, max_length)
            epoch_plan += [(names[s], rows[k:k + rows_per_batch]) for k in range(0, len(rows), rows_per_batch)]
        keep = len(epoch_plan) if epoch + 1 <= epochs else math.ceil((epochs - epoch) * len(epoch_plan))
        plan += epoch_plan[:keep]
    return plan


def make_batch(shard: dict[str, Any], rows: list[list[tuple[int, int]]], max_length: int) -> Batch:
    """Rows of packed sequences, as long as the fullest row (a shard's last batch is often short), built on
    the shard's device: each tensor is one concatenation of the sequences' slices and the rows' zero padding,
    so a shard kept on the GPU makes its batches there (no float32 batch built on the host and copied each
    step) and a host shard is copied once, with nothing zero-filled first."""
    cu = shard["cu_seqlens"].tolist()
    length = min(max_length, max(sum(n for _, n in row) for row in rows))
    spans = []                                    # (start in the shard, length) per piece; start None: padding
    doc = torch.full((len(rows), length), -1, dtype=torch.int64)
    pos = torch.zeros_like(doc)
    for r, row in enumerate(rows):
        at = 0
        for d, (seq, n) in enumerate(row):
            spans.append((cu[seq], n))
            doc[r, at:at + n], pos[r, at:at + n] = d, torch.arange(n)
            at += n
        if at < length:
            spans.append((None, length - at))
    device = shard["aux_hidden"].device

    def rows_of(flat: Tensor) -> Tensor:
        pieces = [flat[a:a + n] if a is not None else flat.new_zeros(n, *flat.shape[1:]) for a, n in spans]
        return torch.cat(pieces).view(len(rows), length, *flat.shape[1:]).to(device)

    return Batch(rows_of(shard["input_ids"]), rows_of(shard["loss_mask"]).bool(), doc.to(device), pos.to(device),
                 rows_of(shard["aux_hidden"]), rows_of(shard["final_hidden"]))


class ShardReader:
    """Shards of a hidden artifact through a bounded local cache; counts what it read."""

    def __init__(self, store: Store, hidden: Manifest, budget_bytes: int, device: torch.device | None = None):
        self.store, self.hidden, self.cache = store, hidden, LocalCache(budget_bytes)
        self.device = device            # where a loaded shard's tensors live (and its batches are built)
        self.read: set[str] = set()

    def local(self, rel: str) -> Path:
        path = self.store.fetch_file("hidden", self.hidden.id, rel, self.hidden)
        remote = self.store.local_path(f"{self.store.key('hidden', self.hidden.id)}/{rel}") is None
        self.cache.admit(path, path.stat().st_size, owned=remote)   # evicts older copies (remote stores)
        return path

    def shards(self) -> list[str]:
        return shard_paths(self.hidden)

    def lengths(self, rel: str) -> list[int]:
        with safe_open(str(self.local(rel)), framework="pt") as f:
            return f.get_tensor("cu_seqlens").diff().tolist()

    def load(self, rel: str) -> dict[str, Any]:
        self.read.add(rel)
        return read_shard(self.local(rel), self.device)


def rank_batch(shard: dict[str, Any], rows: list[list[tuple[int, int]]], max_length: int,
               world: distributed.World) -> Batch:
    """This rank's rows of a global batch (every size-th row); a rank left without rows gets one
    padding position, so it still takes part in the step's collectives."""
    mine = distributed.split_strided(rows, world)
    if mine:
        return make_batch(shard, mine, max_length)
    a, h = shard["aux_hidden"].shape[-1], shard["final_hidden"].shape[-1]
    zeros = torch.zeros(1, 1, dtype=torch.int64)
    return Batch(zeros, zeros.bool(), zeros - 1, zeros.clone(), torch.zeros(1, 1, a), torch.zeros(1, 1, h))
