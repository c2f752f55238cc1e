"""Checkpoints: model, AdamW, step and RNG in the staging folder of the draft artifact, full tensors
keyed by name (a run saved on N GPUs resumes on any number), written by rank 0; `restore` resumes from
the newest readable one and trims the training log back to it. A kill or a full disk mid-save leaves no
state.json (it is written last, atomically), so that checkpoint is not complete; one that cannot be read is
skipped with a log line naming it."""

from __future__ import annotations

import json
import logging
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from steps.lib.artifacts import DRAFT_LOG_FILE, DRAFT_MODEL_FILE
from steps.lib.data.shards import save_sorted
from steps.lib.files import naming, read_jsonl, write_atomic
from steps.lib.runtime import distributed
from steps.lib.training.trainer import Trainer

CKPT_PREFIX = "checkpoint-"
#: the weights of the best τ_sim so far (steps/lib/training/evaluate.py), in the staging folder until commit.
BEST_FILE = "best-draft.safetensors"
STATE_FILE = "state.json"
#: what reading a damaged checkpoint raises (a missing or truncated file, bad JSON, a torn pickle or safetensors).
UNREADABLE = (OSError, ValueError, RuntimeError, EOFError, KeyError, pickle.UnpicklingError, SafetensorError)

log = logging.getLogger(__name__)


def fp32_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A state dict as written to disk: floating tensors fp32, everything contiguous (safetensors needs it)."""
    return {k: v.detach().float().contiguous() if v.is_floating_point() else v.contiguous() for k, v in state.items()}


def save_checkpoint(staging: Path, step: int, tr: Trainer, state: dict[str, Any]) -> None:
    """checkpoint-{step}/ with model.safetensors, optimizer.pt, rng.safetensors, state.json (last).

    Full tensors keyed by parameter name whatever the world size (a run saved on 8 GPUs resumes on
    1); gathered by every rank (FSDP), written by rank 0."""
    weights, opt_state = distributed.full_state(tr.draft, tr.opt)
    if not tr.world.is_main:
        return
    d = staging / f"{CKPT_PREFIX}{step:08d}"
    d.mkdir(parents=True, exist_ok=True)
    # Python's writes, so a full disk is an OSError naming the file (torch.save to a path raises a RuntimeError
    # naming neither; safetensors' save_file returned without an error on a full device)
    save_sorted(fp32_state(weights), d / DRAFT_MODEL_FILE)
    with naming(d / "optimizer.pt"), open(d / "optimizer.pt", "wb") as f:
        torch.save(opt_state, f)
    save_sorted({"cpu": torch.get_rng_state()}, d / "rng.safetensors")
    write_atomic(d / STATE_FILE, json.dumps({**state, "step": step, "world_size": tr.world.size}))
    for old in staging.glob(f"{CKPT_PREFIX}*"):                 # keep only the newest
        if old != d:
            shutil.rmtree(old, ignore_errors=True)


def _read_checkpoint(d: Path) -> tuple[dict, dict, Tensor, dict[str, Any]]:
    """Every file of one checkpoint, read in full before any is applied (a bad one then changes nothing)."""
    state = json.loads((d / STATE_FILE).read_text())
    return (load_file(str(d / DRAFT_MODEL_FILE)), torch.load(d / "optimizer.pt", weights_only=True),
            load_file(str(d / "rng.safetensors"))["cpu"], state)


def load_checkpoint(staging: Path, tr: Trainer) -> dict[str, Any] | None:
    """Restore the newest readable complete checkpoint (one with state.json) on every rank; None when there is
    none. An unreadable one is skipped with a log line, so a damaged save costs the steps since the one before
    (or a fresh start), never every re-run."""
    done = sorted(p for p in staging.glob(f"{CKPT_PREFIX}*") if (p / STATE_FILE).is_file())
    for d in reversed(done):
        try:
            weights, opt_state, rng, state = _read_checkpoint(d)
        except UNREADABLE as e:
            log.warning("skipped unreadable checkpoint %s (%s: %s); resuming from the one before, if any",
                        d, type(e).__name__, e)
            continue
        distributed.load_full_state(tr.draft, tr.opt, weights, opt_state)
        torch.set_rng_state(rng)
        state.pop("world_size", None)                           # the world it was saved at: informative only
        return state
    return None


def restore(staging: Path, tr: Trainer) -> tuple[dict[str, Any], list[dict]]:
    """Resume state from the newest checkpoint (or a fresh one) and, on rank 0, the log up to it."""
    state = load_checkpoint(staging, tr) or {"step": 0, "tokens": 0, "train_s": 0.0, "shards_read": []}
    if not tr.world.is_main:                                   # only rank 0 reads or writes the log
        return state, []
    log_path = staging / DRAFT_LOG_FILE
    kept = [r for r in read_jsonl(log_path) if r["step"] < state["step"]]   # a torn last line is dropped
    write_atomic(log_path, "".join(json.dumps(r) + "\n" for r in kept))   # drop steps after the checkpoint
    return state, kept[-10:]
