"""Training-time-test (TTT) training of the EAGLE-3 draft.

Reads: a `hidden` artifact (aux + final hidden-state shards, `steps/shards.py`, streamed through a
bounded local cache: F8), a `vocab` artifact (`d2t`/`t2d`, validated by `steps/mapping.py`: F3) and
the `target` artifact (only its embedding and the lm_head rows of the draft vocab are read).
Writes: a `draft` artifact: `model.safetensors` (canonical SGLang keys, fp32, with `d2t`/`t2d`),
`draft_config.json` (the `DraftConfig`, the aux `layer_ids` in the internal convention (F4), the
target's shape and context length (F5)) and `train_log.jsonl`.

The unroll follows docs/ARCHITECTURE.md "Draft semantics", the contract the reference engine
drafts with. Stream position p holds (token x[p+1], feature of p):
  step 0   token x[p+1], feature = aux states f[p] (through fc), position id p;
  step j   token x[p+1+j], feature = the draft's own out_hidden of step j-1 at p, position id p+j;
           attends to the step-0 keys at positions <= p of the same sequence and to its own chain
           keys of steps 1..j at p (the K/V of every step are computed once and kept in a
           `DraftCache`, exactly as the engine keeps them);
  loss     soft cross-entropy against softmax(target_lm_head(final[p+1+j])) over the draft vocab,
           weighted step_decay**j, on positions where x[p+2+j] is an assistant token of the same
           sequence that lies inside the draft vocab.
The last condition stands in for "the target's argmax at p+1+j is in the draft vocab": the data is
regenerated greedily by the target, so x[p+2+j] *is* that argmax, and checking it costs nothing
where the exact check needs the full target head (49k rows for SmolLM2) at every position.

Cost: step 0 runs every position (each is a real key); chain step j >= 1 runs only the positions
whose chain still reaches a counted prediction (about the assistant spans), and the draft's lm_head
and the target's head rows run only where a prediction is counted. Sequences are packed into rows
of `max_length` (block-diagonal attention: no sequence sees another), rows into batches of
~`batch_tokens`, in a seeded order planned before the first step (every shard of every epoch).
Checkpoints (model, AdamW, step, RNG) go into the artifact's staging folder every
`checkpoint_every` steps; a re-run resumes from the latest one.

Several GPUs: `torchrun --nproc-per-node N -m steps.train ...` (`steps/distributed.py`). Each rank
takes every N-th row of each planned batch; the loss is normalised by the global count of
predictions, so the N ranks take the optimizer steps one process takes on the same plan (the same
loss curve within float tolerance, and the same draft id). `train.parallel` picks DDP or FSDP.
Checkpoints hold full tensors keyed by name, written by rank 0, so a run resumes at any world size;
only rank 0 writes the log and the artifact.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from steps import distributed
from steps.artifacts import DRAFT_CONFIG_FILE, DRAFT_LOG_FILE, DRAFT_MODEL_FILE, load_vocab, target_dir
from steps.checks.vocab import validate_vocab
from steps.config import PipelineConfig, resolve_draft_shape, resolve_max_position_embeddings
from steps.draft import DraftCache, DraftConfig, Eagle3Draft
from steps.shards import read_shard
from steps.store import LocalCache, Manifest, Store, artifact_id, open_store

CKPT_PREFIX = "checkpoint-"
#: train fields that change how the work is spread over GPUs, not what is learned: the same draft
#: id at any world size (the loss curve is the same within float tolerance).
NOT_IN_ID = ("parallel", "fsdp_min_params")
#: AdamW betas of EAGLE-3 / SpecForge draft training.
BETAS = (0.9, 0.95)


# --- inputs: target head, draft shape -----------------------------------------------------------------

def read_target_head(tdir: Path, tcfg: dict[str, Any]) -> dict[str, Tensor]:
    """The target's `embed_tokens.weight` and `lm_head.weight` (the embedding when tied), nothing else."""
    index = tdir / "model.safetensors.index.json"
    files = ({n: tdir / f for n, f in json.loads(index.read_text())["weight_map"].items()} if index.is_file()
             else dict.fromkeys(_safetensors_keys(tdir / "model.safetensors"), tdir / "model.safetensors"))
    tied = bool(tcfg.get("tie_word_embeddings", False))
    out: dict[str, Tensor] = {}
    for name, want in (("embed_tokens.weight", "model.embed_tokens.weight"), ("lm_head.weight", "lm_head.weight")):
        if want not in files:
            if name == "lm_head.weight" and tied:
                out[name] = out["embed_tokens.weight"]
                continue
            raise KeyError(f"{tdir}: no tensor {want!r} in the target's safetensors "
                           f"(tie_word_embeddings={tied}); is this a Llama-style HF checkpoint?")
        with safe_open(str(files[want]), framework="pt") as f:
            out[name] = f.get_tensor(want).float()
    return out


def _safetensors_keys(path: Path) -> list[str]:
    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def _rope_theta(tcfg: dict[str, Any]) -> float:
    # transformers 5 writes rope_parameters: {"rope_theta": ...}; older configs a top-level rope_theta
    params = tcfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", tcfg.get("rope_theta", 10000.0)))


def draft_config(cfg: PipelineConfig, tcfg: dict[str, Any], num_aux: int, d2t: Tensor) -> DraftConfig:
    shape = resolve_draft_shape(cfg, tcfg)
    return DraftConfig(**shape, rms_norm_eps=float(tcfg.get("rms_norm_eps", 1e-6)), rope_theta=_rope_theta(tcfg),
                       max_position_embeddings=resolve_max_position_embeddings(cfg, tcfg),
                       vocab_size=int(tcfg["vocab_size"]), draft_vocab_size=len(d2t),
                       target_hidden_size=int(tcfg["hidden_size"]), num_aux=num_aux)


# --- data: a deterministic plan of packed batches over every shard --------------------------------------

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


def build_plan(shard_lengths: dict[str, list[int]], *, epochs: float, seed: int, max_length: int,
               rows_per_batch: int) -> list[tuple[str, list[list[tuple[int, int]]]]]:
    """Every batch of the run, in order: (shard, rows). Epoch e visits shards in a seeded order and
    each shard's sequences in a seeded order; a fractional last epoch keeps its first batches."""
    plan = []
    names = sorted(shard_lengths)
    for epoch in range(math.ceil(epochs)):
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        epoch_plan = []
        for s in torch.randperm(len(names), generator=g).tolist():
            lengths = shard_lengths[names[s]]
            rows = pack(lengths, torch.randperm(len(lengths), generator=g).tolist(), max_length)
            epoch_plan += [(names[s], rows[k:k + rows_per_batch]) for k in range(0, len(rows), rows_per_batch)]
        keep = len(epoch_plan) if epoch + 1 <= epochs else math.ceil((epochs - epoch) * len(epoch_plan))
        plan += epoch_plan[:keep]
    return plan


def make_batch(shard: dict[str, Any], rows: list[list[tuple[int, int]]], max_length: int) -> Batch:
    """Rows of packed sequences, as long as the fullest row (a shard's last batch is often short)."""
    cu = shard["cu_seqlens"].tolist()
    max_length = min(max_length, max(sum(n for _, n in row) for row in rows))
    b, a, h = len(rows), shard["aux_hidden"].shape[-1], shard["final_hidden"].shape[-1]
    ids = torch.zeros(b, max_length, dtype=torch.int64)
    mask = torch.zeros(b, max_length, dtype=torch.bool)
    doc = torch.full((b, max_length), -1, dtype=torch.int64)
    pos = torch.zeros(b, max_length, dtype=torch.int64)
    aux, final = torch.zeros(b, max_length, a), torch.zeros(b, max_length, h)
    for r, row in enumerate(rows):
        at = 0
        for d, (seq, n) in enumerate(row):
            src = slice(cu[seq], cu[seq] + n)
            ids[r, at:at + n], mask[r, at:at + n] = shard["input_ids"][src], shard["loss_mask"][src].bool()
            aux[r, at:at + n], final[r, at:at + n] = shard["aux_hidden"][src], shard["final_hidden"][src]
            doc[r, at:at + n], pos[r, at:at + n] = d, torch.arange(n)
            at += n
    return Batch(ids, mask, doc, pos, aux, final)


class ShardReader:
    """Shards of a hidden artifact through a bounded local cache; counts what it read."""

    def __init__(self, store: Store, hidden: Manifest, budget_bytes: int):
        self.store, self.hidden, self.cache = store, hidden, LocalCache(budget_bytes)
        self.read: set[str] = set()

    def local(self, rel: str) -> Path:
        path = self.store.fetch_file("hidden", self.hidden.id, rel, self.hidden)
        remote = self.store.local_path(f"{self.store.key('hidden', self.hidden.id)}/{rel}") is None
        self.cache.admit(path, path.stat().st_size, owned=remote)   # evicts older copies (remote stores)
        return path

    def lengths(self, rel: str) -> list[int]:
        with safe_open(str(self.local(rel)), framework="pt") as f:
            return f.get_tensor("cu_seqlens").diff().tolist()

    def load(self, rel: str) -> dict[str, Any]:
        self.read.add(rel)
        return read_shard(self.local(rel))


# --- the training-time-test unroll and its loss ------------------------------------------------------------

def _shift(x: Tensor, k: int, fill: int = 0) -> Tensor:
    """x[:, p+k] at p (fill past the end). x: [B, L]."""
    out = torch.full_like(x, fill)
    out[:, : x.shape[1] - k] = x[:, k:]
    return out


@dataclass
class Layout:
    """Which positions a step computes: chain step j >= 1 only needs the positions whose chain
    still reaches a counted prediction (assistant spans, about half of a chat), step 0 needs all
    (every position is a real key). Rows are padded to the longest; `inv` maps back."""
    idx: Tensor    # [B, M] position of each slot (ascending)
    pad: Tensor    # [B, M] bool, slot unused
    inv: Tensor    # [B, L] slot of each position (valid where the position is computed)


def layouts(valid: list[Tensor] | None, doc: Tensor, steps: int) -> list[Layout]:
    """Step j computes the positions counted at some step j' >= j (all positions when valid is None)."""
    every = torch.ones_like(doc, dtype=torch.bool)
    needs, n = [], torch.zeros_like(every)
    for j in reversed(range(steps)):
        n = every if valid is None else n | valid[j]
        needs.insert(0, n)
    needs[0] = every                                   # step 0: every position is a real key
    return [_layout(n) for n in needs]


def _layout(need: Tensor) -> Layout:
    order = torch.sort((~need).to(torch.int8), dim=1, stable=True).indices   # needed first, ascending
    m = max(1, int(need.sum(1).max()))
    return Layout(order[:, :m], ~need.gather(1, order[:, :m]), order.argsort(1))


def ttt_mask(doc: Tensor, lays: list[Layout], j: int) -> Tensor:
    """Step j's mask, bool [B, 1, M_j, L + M_1 + .. + M_j] over [step-0 keys, chain keys of steps 1..j]:
    a query at p sees step-0 keys of its own sequence at positions <= p and chain keys at p only.
    Every query sees at least one key (padding sees itself), so no softmax row is empty."""
    q = lays[j]
    length = doc.shape[1]
    keys = torch.arange(length, device=doc.device)
    real = (doc[:, None, :] == doc.gather(1, q.idx)[:, :, None]) & (keys <= q.idx[:, :, None])
    if j == 0:
        real |= torch.eye(length, dtype=torch.bool, device=doc.device)
    else:
        real &= ~q.pad[:, :, None]
    blocks = [real]
    for i in range(1, j + 1):
        k = lays[i]
        same = (k.idx[:, None, :] == q.idx[:, :, None]) & ~k.pad[:, None, :] & ~q.pad[:, :, None]
        if i == j:
            same |= torch.eye(q.idx.shape[1], dtype=torch.bool, device=doc.device) & q.pad[:, :, None]
        blocks.append(same)
    return torch.cat(blocks, dim=-1)[:, None]


def ttt_unroll(model: Eagle3Draft, batch: Batch, steps: int,
               valid: list[Tensor] | None = None) -> Iterator[tuple[Tensor, Layout]]:
    """Yields (out_hidden [B, M_j, H], layout) of steps 0..steps-1; K/V of each step computed once."""
    cache, lays = DraftCache(), layouts(valid, batch.doc, steps)
    out = None
    for j, lay in enumerate(lays):
        same = _shift(batch.doc, 1 + j, -2) == batch.doc
        tokens = torch.where(same, _shift(batch.input_ids, 1 + j), 0).gather(1, lay.idx)   # x[p+1+j]
        if j == 0:
            feature = batch.aux                                              # [B, L, A*Ht] -> fc
        else:                                                                # own out_hidden at p
            slots = torch.where(lay.pad, 0, lays[j - 1].inv.gather(1, lay.idx))   # padding: any slot
            feature = out.gather(1, slots[:, :, None].expand(-1, -1, out.shape[-1]))
        pos = batch.pos.gather(1, lay.idx) + j
        out = model.forward_hidden(tokens, feature, pos, cache, ttt_mask(batch.doc, lays, j))
        yield out, lay


def loss_positions(batch: Batch, t2d: Tensor, steps: int) -> list[Tensor]:
    """Step j -> bool [B, L]: x[p+2+j] is an assistant token of p's sequence inside the draft vocab."""
    out = []
    for j in range(steps):
        k = 2 + j
        ok = (_shift(batch.doc, k, -2) == batch.doc) & (batch.doc >= 0)
        out.append(ok & _shift(batch.loss_mask, k, False) & t2d[_shift(batch.input_ids, k)])
    return out


def target_distributions(batch: Batch, head_rows: Tensor, valid: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Target probs over the draft vocab (renormalised) at the rows some step needs.
    Returns (row index map [B*L] (-1 = not computed), probs [N, Vd], argmax [N])."""
    length = batch.doc.shape[1]
    needed = torch.zeros_like(valid[0])
    for j, v in enumerate(valid):                      # step j at p reads the target at p+1+j
        needed[:, 1 + j:] |= v[:, : length - 1 - j]
    rows = needed.flatten().nonzero().flatten()
    index = torch.full((needed.numel(),), -1, dtype=torch.int64, device=rows.device)
    index[rows] = torch.arange(len(rows), device=rows.device)
    with torch.no_grad():
        logits = batch.final.flatten(0, 1)[rows] @ head_rows.T             # [N, Vd]: draft rows only
        return index, torch.softmax(logits.float(), -1), logits.argmax(-1)


def ttt_sums(model: Eagle3Draft, batch: Batch, head_rows: Tensor, valid: list[Tensor], *, decay: float,
             denominators: Sequence[float]) -> tuple[Tensor, list[float], list[Tensor]]:
    """Σ_j decay^j · Σ_p soft-CE(p) / denominators[j] over step j's positions `valid[j]`
    -> (loss, top-1 hits per step, out_hidden of each step).

    The denominators are the *global* counts of step j's positions (over every rank), so ranks that
    each hold some rows of a batch sum to exactly the loss of the whole batch."""
    index, probs, argmax = target_distributions(batch, head_rows, valid)
    loss, hits, outs = torch.zeros((), device=batch.aux.device), [], []
    length = batch.doc.shape[1]
    for j, (out, lay) in enumerate(ttt_unroll(model, batch, len(valid), valid)):
        outs.append(out)
        b, p = valid[j].nonzero(as_tuple=True)
        if len(b) == 0:
            hits.append(0.0)
            continue
        tr = index[b * length + p + 1 + j]
        logits = model.compute_logits(out[b, lay.inv[b, p]]).float()      # head only where it counts
        ce = F.cross_entropy(logits, probs[tr], reduction="sum")
        loss = loss + decay**j * ce / denominators[j]
        hits.append(float((logits.argmax(-1) == argmax[tr]).sum()))
    return loss, hits, outs


def ttt_loss(model: Eagle3Draft, batch: Batch, head_rows: Tensor, *, steps: int,
             decay: float) -> tuple[Tensor, list[float | None], int]:
    """Σ_j decay^j · mean soft-CE over step j's positions -> (loss, per-step top-1 acc, positions)."""
    valid = loss_positions(batch, model.t2d, steps)
    counts = [int(v.sum()) for v in valid]
    loss, hits, _ = ttt_sums(model, batch, head_rows, valid, decay=decay, denominators=[max(1, n) for n in counts])
    return loss, [h / n if n else None for h, n in zip(hits, counts, strict=True)], sum(counts)


class TTTObjective(nn.Module):
    """The draft and its TTT loss behind one `forward`, the call DDP and FSDP hook their
    communication into (the unroll itself calls the draft's `forward_hidden`/`compute_logits`)."""

    def __init__(self, draft: Eagle3Draft, *, decay: float):
        super().__init__()
        self.draft, self.decay = draft, decay

    def forward(self, batch: Batch, head_rows: Tensor, valid: list[Tensor], denominators: list[float],
                scale: float) -> tuple[Tensor, list[float]]:
        """`scale` undoes the world-size averaging of DDP/FSDP gradients (1 for one process)."""
        loss, hits, outs = ttt_sums(self.draft, batch, head_rows, valid, decay=self.decay, denominators=denominators)
        if not any(bool(v.any()) for v in valid):
            # This rank holds no counted prediction (or only padding) while others do: every trainable
            # parameter must still get a (zero) gradient, or DDP/FSDP wait for it forever.
            loss = loss + 0.0 * self.draft.compute_logits(outs[-1]).sum()
        return loss * scale, hits


# --- optimisation, checkpoints ------------------------------------------------------------------------

def lr_at(step: int, total: int, *, lr: float, warmup_ratio: float, min_lr_ratio: float) -> float:
    """1) linear warmup over warmup_ratio·total steps, 2) cosine down to min_lr_ratio·lr."""
    warm = max(1, round(warmup_ratio * total))
    if step < warm:
        return lr * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def fp32_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A state dict as written to disk: floating tensors fp32, everything contiguous (safetensors needs it)."""
    return {k: v.detach().float().contiguous() if v.is_floating_point() else v.contiguous() for k, v in state.items()}


def trainable_state(model: Eagle3Draft) -> dict[str, Tensor]:
    return fp32_state(model.state_dict())


@dataclass
class Setup:
    model: Eagle3Draft
    head_rows: Tensor        # [draft_vocab, Ht] target lm_head rows of the draft vocab
    reader: ShardReader
    plan: list
    meta: dict[str, Any]


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


def amp_dtype(cfg: PipelineConfig, device: torch.device) -> torch.dtype | None:
    """auto: bf16 autocast on CUDA, fp32 on CPU (bf16 is ~20x slower on AVX2 CPUs)."""
    p = cfg.train.precision
    return torch.bfloat16 if p == "bf16" or (p == "auto" and device.type == "cuda") else None


def build_trainer(cfg: PipelineConfig, s: Setup, world: distributed.World) -> Trainer:
    """Move the draft to this rank's device, wrap it (DDP/FSDP under torchrun), build AdamW over what
    the wrapper left (FSDP replaces parameters with shards, so the optimizer comes last)."""
    t = cfg.train
    draft = s.model.to(world.device)
    mode = (distributed.choose_parallel(t.parallel, draft, fsdp_min_params=t.fsdp_min_params)
            if world.distributed else "none")
    objective = distributed.parallelize(TTTObjective(draft, decay=t.step_decay), world, mode, shard=[draft.midlayer])
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=t.lr, betas=BETAS,
                            weight_decay=t.weight_decay)
    return Trainer(draft, objective, opt, s.head_rows.to(world.device), world, amp_dtype(cfg, world.device), mode)


def save_checkpoint(staging: Path, step: int, tr: Trainer, state: dict[str, Any]) -> None:
    """checkpoint-{step}/ with model.safetensors, optimizer.pt, rng.safetensors, state.json (last).

    Full tensors keyed by parameter name whatever the world size (a run saved on 8 GPUs resumes on
    1); gathered by every rank (FSDP), written by rank 0."""
    weights, opt_state = distributed.full_state(tr.draft, tr.opt)
    if not tr.world.is_main:
        return
    d = staging / f"{CKPT_PREFIX}{step:08d}"
    d.mkdir(parents=True, exist_ok=True)
    save_file(fp32_state(weights), str(d / DRAFT_MODEL_FILE))
    torch.save(opt_state, d / "optimizer.pt")
    save_file({"cpu": torch.get_rng_state()}, str(d / "rng.safetensors"))
    (d / "state.json").write_text(json.dumps({**state, "step": step, "world_size": tr.world.size}))
    for old in staging.glob(f"{CKPT_PREFIX}*"):                 # keep only the newest
        if old != d:
            shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(staging: Path, tr: Trainer) -> dict[str, Any] | None:
    """Restore the newest complete checkpoint (one with state.json) on every rank; None when there is none."""
    done = sorted(p for p in staging.glob(f"{CKPT_PREFIX}*") if (p / "state.json").is_file())
    if not done:
        return None
    d = done[-1]
    distributed.load_full_state(tr.draft, tr.opt, load_file(str(d / DRAFT_MODEL_FILE)),
                                torch.load(d / "optimizer.pt", weights_only=True))
    torch.set_rng_state(load_file(str(d / "rng.safetensors"))["cpu"])
    state = json.loads((d / "state.json").read_text())
    state.pop("world_size", None)                               # the world it was saved at: informative only
    return state


# --- the loop ----------------------------------------------------------------------------------------------

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


def train_step(tr: Trainer, batch: Batch, *, cfg: PipelineConfig, lr: float) -> dict[str, Any]:
    """One optimizer step on this rank's rows of one global batch -> the batch's log record (global).

    The loss of rank r is Σ_j decay^j Σ_{p in r} CE / N_j, with N_j the global count of step j's
    positions, times the world size (DDP/FSDP average gradients): the sum over ranks is the loss of
    the whole batch, so the step equals one process's step on the same batch."""
    t, world = cfg.train, tr.world
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
        grad_norm = float(torch.nn.utils.clip_grad_norm_(tr.draft.parameters(), t.grad_clip))
        tr.opt.step()
        loss = scaled.item() / world.size
    loss, *hits = distributed.all_reduce_sum(world, [loss, *hits])
    return {"loss": loss, "acc": [h / n if n else None for h, n in zip(hits, counts, strict=True)], "lr": lr,
            "grad_norm": grad_norm, "tokens": int(tokens), "positions": int(sum(counts))}


def restore(staging: Path, tr: Trainer) -> tuple[dict[str, Any], list[dict]]:
    """Resume state from the newest checkpoint (or a fresh one) and, on rank 0, the log up to it."""
    state = load_checkpoint(staging, tr) or {"step": 0, "tokens": 0, "train_s": 0.0, "shards_read": []}
    if not tr.world.is_main:                                   # only rank 0 reads or writes the log
        return state, []
    log_path = staging / DRAFT_LOG_FILE
    kept = [ln for ln in (log_path.read_text().splitlines() if log_path.exists() else [])
            if json.loads(ln)["step"] < state["step"]]
    log_path.write_text("".join(ln + "\n" for ln in kept))    # drop steps after the checkpoint
    return state, [json.loads(ln) for ln in kept[-10:]]


def train_loop(cfg: PipelineConfig, s: Setup, staging: Path,
               on_step: Callable[[int, dict[str, Any]], None] | None = None,
               world: distributed.World | None = None) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Train to the end of the plan (or train.max_steps) -> (metrics, full fp32 weights; rank 0's are real)."""
    t = cfg.train
    world = world or distributed.setup(t.device)
    tr = build_trainer(cfg, s, world)
    total = len(s.plan) if t.max_steps is None else min(len(s.plan), t.max_steps)   # 0: the untrained control
    state, recent = restore(staging, tr)
    s.reader.read.update(state["shards_read"])
    shard_name, shard = None, None
    with distributed.progress_bar(world, total=total, initial=state["step"], desc="train", unit="step") as bar:
        for step in range(state["step"], total):
            name, rows = s.plan[step]
            if name != shard_name:
                shard_name, shard = name, s.reader.load(name)
            batch = _to(rank_batch(shard, rows, t.max_length, world), world.device)
            t0 = time.perf_counter()
            lr = lr_at(step, total, lr=t.lr, warmup_ratio=t.warmup_ratio, min_lr_ratio=t.min_lr_ratio)
            rec = {"step": step, **train_step(tr, batch, cfg=cfg, lr=lr), "shard": name}
            state["train_s"] += time.perf_counter() - t0
            state["tokens"] += rec["tokens"]
            state["shards_read"] = sorted(s.reader.read)
            if world.is_main:
                with (staging / DRAFT_LOG_FILE).open("a") as f:
                    f.write(json.dumps(rec) + "\n")
            recent = (recent + [rec])[-10:]
            bar.update(1)
            bar.set_postfix(loss=f"{rec['loss']:.3f}", acc0=rec["acc"][0])
            if t.checkpoint_every and (step + 1) % t.checkpoint_every == 0 and step + 1 < total:
                save_checkpoint(staging, step + 1, tr, state)
            if on_step is not None:
                on_step(step + 1, rec)
    metrics = {**_summary(state, recent, total, len(s.plan), s.reader), "world_size": world.size,
               "parallel": tr.parallel}
    return metrics, fp32_state(distributed.full_state(tr.draft)[0])


def _to(batch: Batch, device: torch.device) -> Batch:
    return Batch(*(getattr(batch, f).to(device) for f in Batch.__dataclass_fields__))


def _summary(state: dict[str, Any], recent: list[dict[str, Any]], steps: int, planned: int,
             reader: ShardReader) -> dict[str, Any]:
    """Run metrics; loss and per-step accuracy are means over the last (up to 10) steps."""
    acc = []
    for j in range(max((len(r["acc"]) for r in recent), default=0)):
        vals = [r["acc"][j] for r in recent if r["acc"][j] is not None]
        acc.append(sum(vals) / len(vals) if vals else None)
    return {"final_loss": sum(r["loss"] for r in recent) / max(1, len(recent)), "acc": acc,
            "steps": steps, "planned_steps": planned, "tokens": state["tokens"],
            "tokens_per_s": state["tokens"] / state["train_s"] if state["train_s"] else None,
            "train_s": state["train_s"], "shards_read": len(reader.read),
            "shards_total": len(shard_paths(reader.hidden)), "cache_peak_bytes": reader.cache.peak_bytes}


# --- the step ---------------------------------------------------------------------------------------------

def prepare(cfg: PipelineConfig, store: Store, target_id: str, hidden_id: str, vocab_id: str) -> Setup:
    """Read the inputs, build the draft from the target and the plan of batches."""
    hidden = store.manifest("hidden", hidden_id)
    layer_ids = list(hidden.meta["layer_ids"])
    d2t, t2d = load_vocab(store, vocab_id)
    tdir = target_dir(store, target_id)
    tcfg = json.loads((tdir / "config.json").read_text())
    validate_vocab(d2t, t2d, int(tcfg["vocab_size"]))
    dcfg = draft_config(cfg, tcfg, len(layer_ids), d2t)
    head = read_target_head(tdir, tcfg)
    torch.manual_seed(cfg.seed)                   # every rank starts from the same weights
    model = Eagle3Draft.from_target(head, dcfg, d2t, t2d)
    budget = cfg.train.cache_budget or cfg.extract.disk_budget_bytes
    reader = ShardReader(store, hidden, int(budget))
    lengths = {rel: reader.lengths(rel) for rel in shard_paths(hidden)}
    plan = build_plan(lengths, epochs=cfg.train.epochs, seed=cfg.seed, max_length=cfg.train.max_length,
                      rows_per_batch=max(1, cfg.train.batch_tokens // cfg.train.max_length))
    meta = {**dcfg.to_dict(), "layer_ids": layer_ids,
            "target": {"num_hidden_layers": int(tcfg["num_hidden_layers"]), "hidden_size": int(tcfg["hidden_size"]),
                       "vocab_size": int(tcfg["vocab_size"]),
                       "max_position_embeddings": int(tcfg["max_position_embeddings"]),
                       "name": store.manifest("target", target_id).meta.get("name", cfg.target.display_name)}}
    return Setup(model, head["lm_head.weight"][d2t + torch.arange(len(d2t))], reader, plan, meta)


def draft_id(cfg: PipelineConfig, inputs: dict[str, str]) -> str:
    """The `draft` artifact id: the train section (less how it is spread over GPUs), the seed, the inputs."""
    section = cfg.train.model_dump(mode="json", exclude=set(NOT_IN_ID))
    return artifact_id("draft", {"train": section, "seed": cfg.seed}, inputs)


def run(cfg: PipelineConfig, store: Store, target_id: str, hidden_id: str, vocab_id: str, *,
        on_step: Callable[[int, dict[str, Any]], None] | None = None) -> Manifest:
    """Train (or resume, or reuse) the draft for these inputs; `on_step(step, record)` after each step.

    Under torchrun every rank calls this; rank 0 writes the artifact, the others return its manifest."""
    inputs = {"target": target_id, "hidden": hidden_id, "vocab": vocab_id}
    art_id = draft_id(cfg, inputs)
    if store.exists("draft", art_id):
        return store.manifest("draft", art_id)
    world = distributed.setup(cfg.train.device)
    setup = prepare(cfg, store, target_id, hidden_id, vocab_id)
    # One attempt per job (checkpoints are read by every rank): rank 0 takes the lease, the others join it.
    writer = store.begin("draft", art_id, step="train", inputs=inputs, config=cfg.train) if world.is_main else None
    attempt = distributed.all_gather_object(world, writer.attempt if writer else None)[0]
    if attempt == "reused":                                      # another run committed it while we waited
        return store.manifest("draft", art_id)
    if writer is None:
        writer = store.begin("draft", art_id, step="train", inputs=inputs, config=cfg.train, join=attempt)
    metrics, weights = train_loop(cfg, setup, writer.staging, on_step, world)
    if world.is_main:
        save_file(weights, str(writer.path(DRAFT_MODEL_FILE)))
        writer.path(DRAFT_CONFIG_FILE).write_text(json.dumps(setup.meta, indent=2))
        for ckpt in writer.staging.glob(f"{CKPT_PREFIX}*"):      # resume state is not part of the artifact
            shutil.rmtree(ckpt)
        writer.commit(metrics=metrics, meta=setup.meta)
    distributed.barrier(world)                                   # the manifest exists for every rank now
    return store.manifest("draft", art_id)


def main(argv: list[str] | None = None) -> int:
    from steps.config import find_config, load_config

    p = argparse.ArgumentParser(prog="python -m steps.train", description="Train the EAGLE-3 draft (TTT); "
                                "on several GPUs: torchrun --nproc-per-node N -m steps.train ...")
    p.add_argument("--config", required=True, help="config name (configs/<name>.yaml) or path")
    p.add_argument("--set", action="append", default=[], metavar="a.b=v", help="config override")
    p.add_argument("--store", default=None, help="store URI (default: config's store)")
    p.add_argument("--target", required=True, help="target artifact id")
    p.add_argument("--hidden", required=True, help="hidden artifact id (extract)")
    p.add_argument("--vocab", required=True, help="vocab artifact id (mapping)")
    args = p.parse_args(argv)
    cfg = load_config(find_config(args.config), args.set)
    try:
        m = run(cfg, open_store(args.store or cfg.store), args.target, args.hidden, args.vocab)
        if distributed.env_world_size() == 1 or int(os.environ.get("RANK", "0")) == 0:   # one answer per job
            print(json.dumps({"kind": m.kind, "id": m.id, "metrics": m.metrics}))
    finally:
        distributed.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
