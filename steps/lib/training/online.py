"""Online hidden states (`train.hidden_states: online`): the target runs inside the training job and
computes each shard's aux + final states when the plan reaches it; nothing is written, so the disk
needed is constant in the number of answers.

`OnlineSource` stands where `ShardReader` stands for the offline path and hands the training loop the
same shards: the dataset cut into the shards extract would write (`steps/lib/extraction/sequences.py`),
captured in extract's batches by extract's backend (`steps/lib/extraction/capture.py`), and taken
through the storage dtype's round trip (`encode_states` → `decode_states`), so an online batch equals
the offline batch bit for bit on the same device. A local target's states never leave its device: the
round trip and the batches run there (`keep_on_device`; `make_batch` builds on the shard's device).
Memory: one shard's float32 states, as offline, plus what `train.online_memory` keeps: the shards computed
in the first epoch, in the storage dtype on the training device, up to that many bytes, so later epochs
decode them instead of running the target again (the same tensors, so the same batches and loss).
Offline stays the choice for repeated retraining on the same data and for a target that needs GPUs
of its own (docs/PERFORMANCE.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from steps.lib.data.shards import decode_states
from steps.lib.extraction.capture import CaptureBackend
from steps.lib.extraction.sequences import SHARD_PATH, capture_batches, group_sequences


@dataclass
class KeptShards:
    """Computed shards kept in memory for later epochs (their encoded states and token tensors), first come
    first kept, up to `budget_bytes`; nothing lands on the disk. `peak_bytes` is what was kept (the
    loop reports it as `cache_peak_bytes`), `computed` how many times the target ran over a shard."""
    budget_bytes: int = 0
    shards: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    peak_bytes: int = 0
    computed: int = 0

    def keep(self, rel: str, tensors: dict[str, torch.Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.peak_bytes + size <= self.budget_bytes:
            self.shards[rel] = tensors
            self.peak_bytes += size


@dataclass
class OnlineSource:
    """The shards of the hidden artifact extract would write, computed by the target when loaded."""

    target: CaptureBackend                    # extract's capture backend over the target
    sequences: list[dict[str, list[int]]]     # the dataset, as extract reads it (`read_sequences`)
    shard_tokens: int
    batch_size: int
    storage_dtype: str
    layer_ids: list[int]
    read: set[str] = field(default_factory=set)
    cache: KeptShards = field(default_factory=KeptShards)

    def __post_init__(self) -> None:
        groups = group_sequences([len(s["input_ids"]) for s in self.sequences], self.shard_tokens)
        self.groups = {SHARD_PATH.format(k): g for k, g in enumerate(groups)}

    def shards(self) -> list[str]:
        return sorted(self.groups)

    def lengths(self, rel: str) -> list[int]:
        return [len(self.sequences[i]["input_ids"]) for i in self.groups[rel]]

    def load(self, rel: str) -> dict[str, Any]:
        """The shard as `read_shard` returns it: its states computed now (extract's batches and encoding), or
        decoded from the copy kept when it was first computed."""
        self.read.add(rel)
        tensors = self.cache.shards.get(rel)
        if tensors is None:
            tensors = self._compute(rel)
            self.cache.keep(rel, tensors)
        return {"input_ids": tensors["input_ids"], "loss_mask": tensors["loss_mask"],
                "cu_seqlens": torch.tensor([0, *torch.tensor(self.lengths(rel)).cumsum(0).tolist()], dtype=torch.int64),
                **decode_states(tensors), "layer_ids": list(self.layer_ids),
                "hidden_size": int(tensors["final_hidden"].shape[-1]), "dtype": self.storage_dtype}

    def _compute(self, rel: str) -> dict[str, torch.Tensor]:
        """The target over one shard's sequences -> its encoded states and token tensors, on its device."""
        self.cache.computed += 1
        seqs = [self.sequences[i] for i in self.groups[rel]]
        rows: list[dict[str, torch.Tensor] | None] = [None] * len(seqs)
        for keys in capture_batches([len(s["input_ids"]) for s in seqs], self.batch_size):
            pending = self.target.capture_async([seqs[k]["input_ids"] for k in keys], self.storage_dtype)
            host = pending.wait()
            for k, (start, n) in zip(keys, pending.spans, strict=True):
                rows[k] = {name: t[start:start + n].clone() for name, t in host.items()}
            pending.release()
        stored = {name: torch.cat([r[name] for r in rows]) for name in rows[0]}
        device = stored["final_hidden"].device      # the target's, with a local backend: batches are built there
        return {"input_ids": torch.tensor([t for s in seqs for t in s["input_ids"]], dtype=torch.int64, device=device),
                "loss_mask": torch.tensor([t for s in seqs for t in s["loss_mask"]], dtype=torch.uint8, device=device),
                **stored}
