"""Verify's speculative decoding batched over many prompts: the reference engine's round, B rows at once.

`steps/lib/model/reference_engine.py` decodes one request at a time and reads as the contract; this runs the
same EAGLE-3 round (chain drafting, greedy verification) over a batch, so offline τ on 80 MT-bench questions ×
2 turns × 256 tokens takes minutes on a GPU instead of hours. Each row's output is plain greedy decoding of the
target and its accept counts are the one-request engine's (tests/unit/test_batched_engine.py checks both).

How rows of different lengths share one cache: nothing is ever cropped per row. Every forward appends the
same number of columns to every row's target and draft cache, and a validity mask per cache ([B, L], 1 = a
real position of that row) hides the rest — left padding of the prompts, the rejected drafts of each round,
the padding of a round's catch-up feed. RoPE positions are each row's own (logical) positions, passed
explicitly, so a hole in the physical cache changes nothing the model computes. The draft's chain keys are
the one thing cropped, for all rows at once, as the one-request engine crops them. Rows that finish leave
the batch (and their cache rows) at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache

from steps.lib.metrics import AcceptStats, accepted_prefix
from steps.lib.model.draft import DraftCache
from steps.lib.model.reference_engine import Engine, _done, _eos_set, _finish


@dataclass
class _Batch:
    """Rows in flight. x[r] = row r's tokens so far (prompt + output); x[r][-1] is the target's latest
    proposal, not yet fed to it. `feats` [B, S, F] with `fvalid` [B, S]: in order, the valid columns of row r
    are the target features f[m..n-1] its draft has not seen (m = draft positions fed, n = len(x[r]) - 1)."""
    rows: list[int]                 # batch row -> prompt index
    x: list[list[int]]
    target_cache: DynamicCache
    tmask: Tensor                   # [B, Lt] long, 1 = a real target position of that row
    draft_cache: DraftCache
    dmask: Tensor                   # [B, Ld] bool, True = a real draft position of that row
    feats: Tensor
    fvalid: Tensor

    def select(self, keep: list[int]) -> None:
        """Keep batch rows `keep` (finished rows leave the batch and their caches)."""
        idx = torch.tensor(keep, device=self.tmask.device)
        self.target_cache.batch_select_indices(idx)
        if self.draft_cache.k is not None:
            self.draft_cache.k, self.draft_cache.v = self.draft_cache.k[idx], self.draft_cache.v[idx]
        self.rows, self.x = [self.rows[r] for r in keep], [self.x[r] for r in keep]
        self.tmask, self.dmask = self.tmask[idx], self.dmask[idx]
        self.feats, self.fvalid = self.feats[idx], self.fvalid[idx]


class BatchedEngine:
    """The one-request `Engine`'s target, draft, layer ids and chain length, decoding a batch of prompts."""

    def __init__(self, engine: Engine, pad_token_id: int = 0):
        if engine.draft is None:
            raise ValueError("BatchedEngine needs a draft; plain greedy decoding is steps.lib.model.decode")
        self.engine, self.k, self.pad = engine, engine.k, pad_token_id
        self.device, self.draft = engine.device, engine.draft

    # --- the target: one forward of S columns for every row ------------------------------------------------

    def _target_forward(self, b: _Batch, ids: Tensor, pos: Tensor, new_mask: Tensor) -> tuple[Tensor, Tensor]:
        """ids, pos, new_mask [B, S] -> (argmax ids [B, S], features [B, S, F]); appends S columns."""
        e = self.engine
        b.tmask = torch.cat([b.tmask, new_mask], dim=1)
        out = e.target(input_ids=ids, attention_mask=b.tmask, position_ids=pos, use_cache=True,
                       output_hidden_states=True, **{e._cache_kw: b.target_cache})
        hs = out.hidden_states
        feats = hs[-1] if e.algorithm == "EAGLE" else torch.cat([hs[i] for i in e.layer_ids], dim=-1)
        return out.logits.argmax(-1), feats.to(e.feature_dtype)

    # --- the draft: catch up on each row's real positions, then chain k tokens -------------------------------

    @torch.no_grad()
    def draft_chain(self, b: _Batch) -> Tensor:
        """Draft k tokens (target ids) per row after x[r][n]: [B, k]. Leaves only real positions cached."""
        B, S = b.fvalid.shape
        ids, pos, last = [[self.pad] * S for _ in range(B)], [[0] * S for _ in range(B)], []
        for r in range(B):
            cols = b.fvalid[r].nonzero()[:, 0].tolist()
            n = len(b.x[r]) - 1
            m = n - len(cols)
            # real feed: position p gets token x[p+1] and feature f[p], for p = m..n-1
            for p, c in zip(range(m, n), cols, strict=True):
                ids[r][c], pos[r][c] = b.x[r][p + 1], p
            last.append(cols[-1])
        past = b.dmask.shape[1]
        # query (r, s) sees the row's real cached keys, the real new keys up to s, and itself (a padding
        # query attending to nothing would give NaN; its output is never read)
        causal = torch.ones(S, S, dtype=torch.bool, device=self.device).tril()
        new = (b.fvalid[:, None, :] & causal[None]) | torch.eye(S, dtype=torch.bool, device=self.device)[None]
        mask = torch.cat([b.dmask[:, None, :].expand(B, S, past), new], dim=2)[:, None]   # [B, 1, S, past+S]
        logits, h = self.draft(self._t(ids), b.feats, self._t(pos), cache=b.draft_cache, attn_mask=mask)
        b.dmask = torch.cat([b.dmask, b.fvalid], dim=1)
        at = torch.arange(B, device=self.device), self._t(last)
        drafts, h = [self._to_target(logits[at])], h[at][:, None]          # h: [B, 1, H]
        # chain step j: position n-1+j gets d_j and the draft's own previous out_hidden (no fc)
        n = self._t([len(x) - 1 for x in b.x])[:, None]
        chain_mask = b.dmask[:, None, None, :]
        for j in range(1, self.k):
            chain_mask = torch.cat([chain_mask, chain_mask.new_ones(B, 1, 1, 1)], dim=-1)
            logits, h = self.draft(drafts[-1][:, None], h, n - 1 + j, cache=b.draft_cache, attn_mask=chain_mask)
            drafts.append(self._to_target(logits[:, -1]))
        b.draft_cache.crop(b.dmask.shape[1])                                # chain keys are never real
        return torch.stack(drafts, dim=1)

    def _to_target(self, draft_logits: Tensor) -> Tensor:
        return self.draft.draft_to_target(draft_logits.argmax(-1))

    def _t(self, rows: list) -> Tensor:
        return torch.tensor(rows, device=self.device)

    # --- one speculative round for every row: draft -> verify -> accept --------------------------------------

    @torch.no_grad()
    def speculative_step(self, b: _Batch) -> list[int]:
        """One round per row (the one-request engine's notation); returns accepted drafts per row."""
        d = self.draft_chain(b)                                                # [B, k]
        last = self._t([[x[-1]] for x in b.x])
        n = self._t([len(x) - 1 for x in b.x])[:, None]
        # verify [x[n], d_1..d_k] at positions n..n+k in one target forward
        t, g = self._target_forward(b, torch.cat([last, d], dim=1), n + torch.arange(self.k + 1, device=self.device),
                                    torch.ones_like(d[:, :1]).repeat(1, self.k + 1))
        a = accepted_prefix(d == t[:, :self.k])                                # [B]
        # x[n], d_1..d_a stay real in the target's cache; their features feed the draft next round
        kept = torch.arange(self.k + 1, device=self.device)[None] <= a[:, None]
        b.tmask[:, -(self.k + 1):] = kept.long()
        b.feats, b.fvalid = g, kept
        for r, (ar, dr, tr) in enumerate(zip(a.tolist(), d.tolist(), t.tolist(), strict=True)):
            b.x[r] += dr[:ar] + [tr[ar]]
        return a.tolist()

    # --- requests ----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | list[int] | None = None
                 ) -> list[tuple[list[int], AcceptStats]]:
        """Speculative greedy decoding of every prompt -> per prompt (new tokens, accept counts), as
        `Engine.generate` gives them one at a time."""
        eos, stats = _eos_set(eos_token_id), [AcceptStats(self.k) for _ in prompts]
        outs: list[list[int]] = [[] for _ in prompts]
        width = max(len(p) for p in prompts)
        tmask = self._t([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        b = _Batch(rows=list(range(len(prompts))), x=[list(p) for p in prompts], target_cache=DynamicCache(),
                   tmask=tmask[:, :0], draft_cache=DraftCache(),
                   dmask=torch.zeros(len(prompts), 0, dtype=torch.bool, device=self.device),
                   feats=torch.empty(0), fvalid=tmask.bool())
        ids = self._t([[self.pad] * (width - len(p)) + list(p) for p in prompts])
        # prefill: f[0..P-1] per row (left padded), proposes x[P]
        t, b.feats = self._target_forward(b, ids, (tmask.cumsum(-1) - 1).clamp(min=0), tmask)
        for r, tok in enumerate(t[:, -1].tolist()):
            b.x[r].append(tok)
        while b.rows:
            keep = []
            for r, i in enumerate(b.rows):
                outs[i] = _finish(b.x[r][len(prompts[i]):], max_new_tokens, eos)
                if not _done(outs[i], max_new_tokens, eos):
                    keep.append(r)
            if len(keep) < len(b.rows):
                if not keep:
                    break
                b.select(keep)
            for i, a in zip(b.rows, self.speculative_step(b), strict=True):
                stats[i].add(a)
        return list(zip(outs, stats, strict=True))
