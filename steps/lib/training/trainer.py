"""`Trainer`: what one optimizer step works on, in a module of its own so that the loop, the checkpoints
and the evaluation all name it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from steps.lib.model.draft import Eagle3Draft
from steps.lib.runtime import distributed


@dataclass
class Trainer:
    """What an optimizer step needs. `objective` is the module to call: the draft's TTT loss, wrapped
    for DDP/FSDP when the world has several ranks; `draft` is the unwrapped model (names, buffers)."""
    draft: Eagle3Draft
    objective: nn.Module
    opt: torch.optim.Optimizer
    head_rows: Tensor        # [draft_vocab, Ht] on the device
    world: distributed.World
    amp: torch.dtype | None  # autocast dtype, None = fp32
    parallel: str            # "ddp" | "fsdp" | "none" (one process)
