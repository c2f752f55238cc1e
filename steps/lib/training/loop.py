"""The training loop: the learning-rate schedule, building the trainer (`trainer.py`: the draft wrapped for
DDP/FSDP under torchrun, AdamW), one optimizer step on this rank's rows of a global batch, and the loop over the plan
with checkpoints and the run's metrics."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

from steps.lib.artifacts import DRAFT_LOG_FILE
from steps.lib.config import TrainConfig
from steps.lib.files import append_jsonl
from steps.lib.model.draft import Eagle3Draft
from steps.lib.runtime import distributed
from steps.lib.training.checkpoint import BEST_FILE, fp32_state, restore, save_checkpoint
from steps.lib.training.evaluate import EvalSet, due, exported_checkpoint, track_best
from steps.lib.training.online import OnlineSource
from steps.lib.training.plan import Batch, ShardReader, rank_batch
from steps.lib.training.trainer import Trainer
from steps.lib.training.ttt import TTTObjective, loss_positions

#: AdamW betas of EAGLE-3 / SpecForge draft training.
BETAS = (0.9, 0.95)


def lr_at(step: int, total: int, *, lr: float, warmup_ratio: float, min_lr_ratio: float) -> float:
    """1) linear warmup over warmup_ratio·total steps, 2) cosine down to min_lr_ratio·lr."""
    warm = max(1, round(warmup_ratio * total))
    if step < warm:
        return lr * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class Setup:
    model: Eagle3Draft
    head_rows: Tensor        # [draft_vocab, Ht] target lm_head rows of the draft vocab
    reader: ShardReader | OnlineSource     # offline shards from the store, or computed by the target
    plan: list
    meta: dict[str, Any]
    eval_set: EvalSet | None = None    # the held-out split τ_sim is measured on (None: off)
    num_steps: int = 3                 # the served chain length k τ_sim drafts (`serve.num_steps`)


def amp_dtype(t: TrainConfig, device: torch.device) -> torch.dtype | None:
    """auto: bf16 autocast on CUDA, fp32 on CPU (bf16 is ~20x slower on AVX2 CPUs)."""
    p = t.precision
    return torch.bfloat16 if p == "bf16" or (p == "auto" and device.type == "cuda") else None


def build_trainer(t: TrainConfig, s: Setup, world: distributed.World) -> Trainer:
    """Move the draft to this rank's device, wrap it (DDP/FSDP under torchrun), build AdamW over what
    the wrapper left (FSDP replaces parameters with shards, so the optimizer comes last)."""
    draft = s.model.to(world.device)
    mode = (distributed.choose_parallel(t.parallel, draft, fsdp_min_params=t.fsdp_min_params)
            if world.distributed else "none")
    objective = distributed.parallelize(TTTObjective(draft, decay=t.step_decay), world, mode, shard=[draft.midlayer])
    # One fused kernel for the whole update on a GPU (the foreach default makes several passes over
    # 0.4B parameters' fp32 state: ~10 ms a step at 8B shapes); FSDP's sharded parameters keep foreach.
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=t.lr, betas=BETAS,
                            weight_decay=t.weight_decay, fused=world.device.type == "cuda" and mode != "fsdp")
    return Trainer(draft, objective, opt, s.head_rows.to(world.device), world, amp_dtype(t, world.device), mode)


def train_step(tr: Trainer, batch: Batch, *, t: TrainConfig, lr: float) -> dict[str, Any]:
    """One optimizer step on this rank's rows of one global batch -> the batch's log record (global).

    The loss of rank r is Σ_j decay^j Σ_{p in r} CE / N_j, with N_j the global count of step j's
    positions, times the world size (DDP/FSDP average gradients): the sum over ranks is the loss of
    the whole batch, so the step equals one process's step on the same batch."""
    world = tr.world
    for g in tr.opt.param_groups:
        g["lr"] = lr
    valid = loss_positions(batch, tr.draft.t2d, t.ttt_steps)
    *counts, tokens = distributed.all_reduce_sum(world, [float(v.sum()) for v in valid] + [batch.tokens])
    tr.opt.zero_grad(set_to_none=True)
    loss, hits, grad_norm = 0.0, [0.0] * len(valid), 0.0
    if sum(counts):                                   # a batch of prompts only has nothing to learn
        with torch.autocast(batch.aux.device.type, dtype=tr.amp or torch.bfloat16, enabled=tr.amp is not None):
            scaled, hits = tr.objective(batch, tr.head_rows, valid, [max(1.0, n) for n in counts], float(world.size))
        scaled.backward()
        norm = torch.nn.utils.clip_grad_norm_(tr.draft.parameters(), t.grad_clip)
        tr.opt.step()
        # Read back only now, once the whole step is queued (each read waits for the GPU).
        grad_norm, loss = float(norm), scaled.item() / world.size
        hits = torch.stack([h.float() for h in hits]).tolist()
    loss, *hits = distributed.all_reduce_sum(world, [loss, *hits])
    return {"loss": loss, "acc": [h / n if n else None for h, n in zip(hits, counts, strict=True)], "lr": lr,
            "grad_norm": grad_norm, "tokens": int(tokens), "positions": int(sum(counts))}


#: the loop's timed parts besides the steps themselves (`train_s`; seconds, summed over a resumed run's calls)
LOOP_TIMERS = ("read_s", "eval_s", "checkpoint_s")


@contextmanager
def timed(state: dict[str, Any], key: str) -> Iterator[None]:
    """Add the block's wall time to `state[key]` (kept in checkpoints, so a resumed run's total is the run's)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        state[key] = state.get(key, 0.0) + time.perf_counter() - t0


def train_loop(t: TrainConfig, s: Setup, staging: Path,
               on_step: Callable[[int, dict[str, Any]], None] | None = None,
               world: distributed.World | None = None) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Train to the end of the plan (or train.max_steps) -> (metrics, full fp32 weights; rank 0's are real)."""
    world = world or distributed.setup(t.device)
    tr = build_trainer(t, s, world)
    total = len(s.plan) if t.max_steps is None else min(len(s.plan), t.max_steps)   # 0: the untrained control
    state, recent = restore(staging, tr)
    s.reader.read.update(state["shards_read"])
    shard_name, shard = None, None
    with distributed.progress_bar(world, total=total, initial=state["step"], desc="train", unit="step") as bar:
        for step in range(state["step"], total):
            name, rows = s.plan[step]
            if name != shard_name:
                with timed(state, "read_s"):     # offline: a shard's read; online: the target's forward over it
                    shard_name, shard = name, s.reader.load(name)
            batch = rank_batch(shard, rows, t.max_length, world).to(world.device)
            with timed(state, "train_s"):
                lr = lr_at(step, total, lr=t.lr, warmup_ratio=t.warmup_ratio, min_lr_ratio=t.min_lr_ratio)
                rec = {"step": step, **train_step(tr, batch, t=t, lr=lr), "shard": name}
            if s.eval_set is not None and due(step + 1, total, t.eval_every):
                with timed(state, "eval_s"):
                    rec.update(track_best(t, tr, s.eval_set, staging, state, step + 1, num_steps=s.num_steps))
                best = state["best"]
                bar.set_note(tau_sim=rec["tau_sim"], best=f"{best['tau_sim']:.3f} @ step {best['step']}")
            state["tokens"] += rec["tokens"]
            state["shards_read"] = sorted(s.reader.read)
            if world.is_main:
                append_jsonl(staging / DRAFT_LOG_FILE, rec)
            recent = (recent + [rec])[-10:]
            bar.update(1)
            bar.set_postfix(loss=f"{rec['loss']:.3f}", acc0=rec["acc"][0])
            if t.checkpoint_every and (step + 1) % t.checkpoint_every == 0 and step + 1 < total:
                with timed(state, "checkpoint_s"):
                    save_checkpoint(staging, step + 1, tr, state)
            if on_step is not None:
                on_step(step + 1, rec)
    metrics = {**_summary(state, recent, total, len(s.plan), s.reader), "world_size": world.size,
               "parallel": tr.parallel}
    weights = fp32_state(distributed.full_state(tr.draft)[0])
    metrics.update(exported_checkpoint(t, staging, state))
    if world.is_main and metrics.get("exported_step") not in (None, total):   # the best, not the last
        weights = load_file(str(staging / BEST_FILE))
    return metrics, weights


def _summary(state: dict[str, Any], recent: list[dict[str, Any]], steps: int, planned: int,
             reader: ShardReader | OnlineSource) -> dict[str, Any]:
    """Run metrics; loss and per-step accuracy are means over the last (up to 10) steps."""
    acc = []
    for j in range(max((len(r["acc"]) for r in recent), default=0)):
        vals = [r["acc"][j] for r in recent if r["acc"][j] is not None]
        acc.append(sum(vals) / len(vals) if vals else None)
    return {"final_loss": sum(r["loss"] for r in recent) / max(1, len(recent)), "acc": acc,
            "steps": steps, "planned_steps": planned, "tokens": state["tokens"],
            "tokens_per_s": state["tokens"] / state["train_s"] if state["train_s"] else None,
            "train_s": state["train_s"], **{k: state.get(k, 0.0) for k in LOOP_TIMERS}, "shards_read": len(reader.read),
            "shards_total": len(reader.shards()), "cache_peak_bytes": reader.cache.peak_bytes,
            # online: how often the target ran over a shard (kept shards are computed once per run)
            **({"shards_computed": reader.cache.computed} if isinstance(reader, OnlineSource) else {})}
