"""What extraction captures, and in which groups: the dataset's sequences, cut into shards and capture
batches. Shared by `steps/extract.py` (offline, written to shards) and `steps/lib/training/online.py`
(online, computed inside the training job), so both see the same shards and run the same forwards."""

from __future__ import annotations

from steps.lib.artifacts import read_conversations
from steps.lib.store import Store

SHARD_PATH = "shards/shard-{:05d}.safetensors"


def read_sequences(store: Store, dataset_id: str, max_length: int) -> list[dict[str, list[int]]]:
    """Every conversation of the dataset, in order, truncated to `max_length` tokens."""
    out = []
    for row in read_conversations(store, dataset_id):
        ids, mask = row["input_ids"][:max_length], row["loss_mask"][:max_length]
        if len(ids) != len(mask):
            raise ValueError(f"dataset {dataset_id}, conversation {row.get('id')!r}: input_ids has "
                             f"{len(row['input_ids'])} tokens but loss_mask {len(row['loss_mask'])}; "
                             "re-run datagen")
        if ids:
            out.append({"input_ids": list(ids), "loss_mask": [int(m) for m in mask]})
    if not out:
        raise ValueError(f"dataset {dataset_id}: no conversations with tokens; nothing to extract")
    return out


def group_sequences(lengths: list[int], shard_tokens: int) -> list[list[int]]:
    """The sequence list, in order, cut into shards of about `shard_tokens` tokens (whole sequences).

    Deterministic in (lengths, shard_tokens): shard i of a resumed run holds the same sequences.
    A sequence longer than `shard_tokens` gets a shard of its own."""
    groups: list[list[int]] = [[]]
    tokens = 0
    for i, n in enumerate(lengths):
        if groups[-1] and tokens + n > shard_tokens:
            groups.append([])
            tokens = 0
        groups[-1].append(i)
        tokens += n
    return groups


def capture_batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """A shard's sequences (indices into it) in capture batches: similar lengths together, less padding."""
    by_length = sorted(range(len(lengths)), key=lambda k: lengths[k])
    return [by_length[s:s + batch_size] for s in range(0, len(lengths), batch_size)]
