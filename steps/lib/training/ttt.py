"""The training-time-test (TTT) unroll and its loss, as docs/ARCHITECTURE.md "Draft semantics" states
them (see steps/train.py's docstring for the notation): which positions each step computes, the
step's attention mask, the unroll itself, the soft cross-entropy against the target over the draft
vocab, and `TTTObjective`, the module DDP and FSDP wrap."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask

from steps.lib.model.draft import DraftCache, Eagle3Draft
from steps.lib.training.plan import Batch


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


#: flex attention's block edge: a block of queries × keys is skipped, computed whole, or masked.
FLEX_BLOCK = 128


def block_mask(dense: Tensor) -> BlockMask:
    """A dense TTT mask [B, 1, Q, K] as a flex-attention block mask (the same mask: no semantics
    of its own, so the two attentions cannot disagree on who sees whom).

    Built straight from the dense mask (which blocks attend somewhere, which attend everywhere):
    `create_block_mask` re-derives the same tensor through vmap, a few hundred small launches a TTT
    step on a step whose pace the host sets."""
    m = dense[:, 0]
    b, q, k = m.shape
    nq, nk = -(-q // FLEX_BLOCK), -(-k // FLEX_BLOCK)
    padded = F.pad(m, (0, nk * FLEX_BLOCK - k, 0, nq * FLEX_BLOCK - q))        # pads attend nowhere
    blocks = padded.view(b, nq, FLEX_BLOCK, nk, FLEX_BLOCK)
    some, every = blocks.any(4).any(2), blocks.all(4).all(2)                   # [B, nq, nk]

    def listed(x: Tensor) -> tuple[Tensor, Tensor]:
        order = torch.argsort(x.to(torch.int8), dim=-1, descending=True, stable=True)
        return x.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]

    def mask_mod(bi, h, qi, ki):
        return padded[bi, qi, ki]
    return BlockMask.from_kv_blocks(*listed(some & ~every), *listed(every), BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(q, k))


def use_flex(attention: str, device: torch.device) -> bool:
    """auto: flex attention on CUDA (compiled, block-sparse); SDPA elsewhere (flex has no CPU backward)."""
    if attention not in ("auto", "flex", "sdpa"):
        raise ValueError(f"attention {attention!r}: expected auto, flex or sdpa")
    return attention == "flex" or (attention == "auto" and device.type == "cuda")


def ttt_unroll(model: Eagle3Draft, batch: Batch, steps: int, valid: list[Tensor] | None = None,
               attention: str = "auto") -> Iterator[tuple[Tensor, Layout]]:
    """Yields (out_hidden [B, M_j, H], layout) of steps 0..steps-1; K/V of each step computed once."""
    cache, lays = DraftCache(), layouts(valid, batch.doc, steps)
    # Every step's mask up front: whatever waits for the GPU here waits before the unroll is queued.
    masks = [ttt_mask(batch.doc, lays, j) for j in range(steps)]
    if use_flex(attention, batch.doc.device):
        masks = [block_mask(m) for m in masks]
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
        out = model.forward_hidden(tokens, feature, pos, cache, masks[j])
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
             denominators: Sequence[float], attention: str = "auto") -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """Σ_j decay^j · Σ_p soft-CE(p) / denominators[j] over step j's positions `valid[j]`
    -> (loss, top-1 hits per step, out_hidden of each step).

    Nothing here waits for the GPU once the unroll is queued (the hits are 0-d tensors, read by the
    caller after the backward): a wait per TTT step left the GPU idle while the next step launched.

    The denominators are the *global* counts of step j's positions (over every rank), so ranks that
    each hold some rows of a batch sum to exactly the loss of the whole batch."""
    where = [v.nonzero(as_tuple=True) for v in valid]
    index, probs, argmax = target_distributions(batch, head_rows, valid)
    loss, hits, outs = torch.zeros((), device=batch.aux.device), [], []
    length = batch.doc.shape[1]
    for j, (out, lay) in enumerate(ttt_unroll(model, batch, len(valid), valid, attention)):
        outs.append(out)
        b, p = where[j]
        if len(b) == 0:
            hits.append(torch.zeros((), device=loss.device))
            continue
        tr = index[b * length + p + 1 + j]
        logits = model.compute_logits(out[b, lay.inv[b, p]]).float()      # head only where it counts
        ce = F.cross_entropy(logits, probs[tr], reduction="sum")
        loss = loss + decay**j * ce / denominators[j]
        hits.append((logits.argmax(-1) == argmax[tr]).sum())
    return loss, hits, outs


def ttt_loss(model: Eagle3Draft, batch: Batch, head_rows: Tensor, *, steps: int, decay: float,
             attention: str = "auto") -> tuple[Tensor, list[float | None], int]:
    """Σ_j decay^j · mean soft-CE over step j's positions -> (loss, per-step top-1 acc, positions)."""
    valid = loss_positions(batch, model.t2d, steps)
    counts = [int(v.sum()) for v in valid]
    loss, hits, _ = ttt_sums(model, batch, head_rows, valid, decay=decay, denominators=[max(1, n) for n in counts],
                             attention=attention)
    return loss, [float(h) / n if n else None for h, n in zip(hits, counts, strict=True)], sum(counts)


class TTTObjective(nn.Module):
    """The draft and its TTT loss behind one `forward`, the call DDP and FSDP hook their
    communication into (the unroll itself calls the draft's `forward_hidden`/`compute_logits`)."""

    def __init__(self, draft: Eagle3Draft, *, decay: float):
        super().__init__()
        self.draft, self.decay = draft, decay

    def forward(self, batch: Batch, head_rows: Tensor, valid: list[Tensor], denominators: list[float],
                scale: float) -> tuple[Tensor, list[Tensor]]:
        """`scale` undoes the world-size averaging of DDP/FSDP gradients (1 for one process)."""
        empty = not any(bool(v.any()) for v in valid)
        loss, hits, outs = ttt_sums(self.draft, batch, head_rows, valid, decay=self.decay, denominators=denominators)
        if empty:
            # This rank holds no counted prediction (or only padding) while others do: every trainable
            # parameter must still get a (zero) gradient, or DDP/FSDP wait for it forever.
            loss = loss + 0.0 * self.draft.compute_logits(outs[-1]).sum()
        return loss * scale, hits
