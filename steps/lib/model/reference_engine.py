"""The reference EAGLE-3 speculative decoding engine: chain drafting, greedy verification, batch 1.

Reads: a Hugging Face causal LM target (with its KV cache) and an `Eagle3Draft` (`steps/lib/model/draft.py`),
usually loaded from an exported SGLang directory by `steps.lib.formats.sglang_loader.load_sglang_draft`. Writes
nothing; `steps/verify.py` turns its accept counts into offline τ (F9: acceptance is measured before
any serving). It follows the contract's "Engine round" exactly, so a draft that is good here and
≈1 on a live server points at serving, not training.

`algorithm="EAGLE"` reproduces F1 the way SGLang 0.5.23 serves an EAGLE-3 draft under the EAGLE
flag (shared/reference/sglang.md §1.4–1.6): the target captures no aux layers and sends its final
hidden state (width H), so the draft's `fc` is skipped because the widths match; the worker's
non-EAGLE3 `init_lm_head` replaces the draft's embedding *and* head with the target's; and no
`hot_token_id` map is applied (the head now spans the target vocab). Reproducing only the skipped
`fc` left the trained draft head reading the target's final state, which still accepted drafts
(live τ 1.18 on the tiny target) where SGLang gives 1.00 — a test double kinder than the server.

Greedy verification makes the output identical to plain greedy decoding of the target; the
tests check that token for token.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import DynamicCache

from steps.lib.metrics import AcceptStats, accepted_prefix
from steps.lib.model.decode import cache_kwarg
from steps.lib.model.draft import DraftCache, Eagle3Draft

ALGORITHMS = ("EAGLE3", "EAGLE")


@dataclass
class _State:
    """One request in flight. x = all tokens so far (prompt + output); x[n] is the target's latest
    proposal, not yet fed to it. `feats` are the target features f[m..n-1] the draft has not seen."""
    x: list[int]
    target_cache: DynamicCache
    draft_cache: DraftCache = field(default_factory=DraftCache)
    feats: Tensor | None = None     # [n - m, F]

    @property
    def n(self) -> int:
        return len(self.x) - 1


class Engine:
    """Target + draft. `layer_ids` are internal (HF `hidden_states` indices) — what the target captures."""

    def __init__(self, target: torch.nn.Module, tokenizer, draft: Eagle3Draft | None, *,
                 layer_ids: list[int], num_steps: int, algorithm: str = "EAGLE3"):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")
        if num_steps < 1:
            raise ValueError(f"num_steps={num_steps}: chain drafting needs at least one step")
        if algorithm == "EAGLE" and draft is not None:
            draft = served_as_eagle(draft, target)
        self.device = next(target.parameters()).device          # the draft runs beside the target
        if isinstance(draft, torch.nn.Module):
            draft = draft.to(self.device)
        self.target, self.tokenizer, self.draft = target.eval(), tokenizer, draft
        # the draft reads the target's features in its own dtype (float32, or bf16 as served)
        self.feature_dtype = (next(draft.parameters()).dtype if isinstance(draft, torch.nn.Module)
                              else torch.float32)
        self.layer_ids, self.k, self.algorithm = list(layer_ids), num_steps, algorithm
        self._cache_kw = cache_kwarg(target)

    def _target(self, ids: list[int], cache: DynamicCache, **kw):
        return self.target(input_ids=self._ids([ids]), use_cache=True, **{self._cache_kw: cache}, **kw)

    def _ids(self, ids: list[int] | list[list[int]]) -> Tensor:
        """Token ids (or positions) as a tensor on the model's device."""
        return torch.tensor(ids, device=self.device)

    # --- the target: one forward over new tokens, returning argmax ids and features ------------------

    @torch.no_grad()
    def target_forward(self, ids: list[int], cache: DynamicCache) -> tuple[Tensor, Tensor]:
        """Feed `ids` after the cached positions -> (argmax ids [S], features [S, F]).

        EAGLE3: F = A*Ht, the aux states at `layer_ids` (HF hidden_states index, as SGLang captures
        at the entry of decoder layer i). EAGLE: F = H, the final (normed) hidden — no aux capture.
        """
        out = self._target(ids, cache, output_hidden_states=True)
        hs = out.hidden_states                                   # N+1 tensors [1, S, Ht]
        feats = hs[-1] if self.algorithm == "EAGLE" else torch.cat([hs[i] for i in self.layer_ids], dim=-1)
        return out.logits[0].argmax(-1), feats[0].to(self.feature_dtype)

    # --- the draft: catch up on real positions, then chain k tokens --------------------------------------

    @torch.no_grad()
    def draft_chain(self, s: _State) -> list[int]:
        """Draft k tokens (target ids) after x[n]; leaves the draft cache at n real positions."""
        m, n = len(s.draft_cache), s.n
        # real feed: position p gets token x[p+1] and feature f[p], for p = m..n-1
        ids = self._ids([s.x[m + 1:n + 1]])
        pos = torch.arange(m, n, device=self.device)[None]
        logits, h = self.draft(ids, s.feats[None], pos, cache=s.draft_cache)
        drafts, h = [self._to_target(logits[0, -1])], h[:, -1:]
        # chain step j: position n-1+j gets d_j and the draft's own previous out_hidden (no fc)
        for j in range(1, self.k):
            logits, h = self.draft(self._ids([[drafts[-1]]]), h, self._ids([[n - 1 + j]]),
                                   cache=s.draft_cache)
            drafts.append(self._to_target(logits[0, -1]))
        s.draft_cache.crop(n)                                    # chain keys are never real
        return drafts

    def _to_target(self, draft_logits: Tensor) -> int:
        return int(self.draft.draft_to_target(draft_logits.argmax(-1)))

    # --- one speculative step: draft -> verify -> accept ------------------------------------------------

    def speculative_step(self, s: _State) -> tuple[list[int], int]:
        """One round; returns (new tokens, accepted drafts).

        Notation: d_1..d_k drafted tokens (target ids); t_j = the target's argmax after it has
        consumed x[n], d_1..d_j; greedy acceptance keeps d_{j+1} while d_{j+1} == t_j, so the
        output equals plain greedy decoding. a = accepted drafts; t_a is the bonus token.
        """
        n = s.n
        d = self.draft_chain(s)
        # verify [x[n], d_1..d_k] at positions n..n+k in one target forward
        t, g = self.target_forward([s.x[n]] + d, s.target_cache)
        a = int(accepted_prefix(self._ids(d) == t[:self.k]))
        new = d[:a] + [int(t[a])]
        # keep the target's cache for x[n], d_1..d_a; their features feed the draft next round
        _crop(s.target_cache, n + a + 1)
        s.feats = g[:a + 1]
        s.x += new
        return new, a

    # --- requests: generators yield each target forward's new tokens (the server streams them) -------------

    def stream(self, input_ids, max_new_tokens: int, eos_token_id: int | list[int] | None = None,
               stats: AcceptStats | None = None) -> Iterator[list[int]]:
        """Speculative greedy decoding, yielding the tokens each round commits; accept counts go to `stats`."""
        if self.draft is None:
            raise ValueError("Engine.generate needs a draft; use generate_plain for the no-draft baseline")
        prompt, eos = _as_list(input_ids), _eos_set(eos_token_id)
        s = _State(x=list(prompt), target_cache=DynamicCache())
        t, s.feats = self.target_forward(prompt, s.target_cache)     # prefill: f[0..P-1], proposes x[P]
        s.x.append(int(t[-1]))
        emitted = 0
        while True:
            out = _finish(s.x[len(prompt):], max_new_tokens, eos)
            if len(out) > emitted:
                yield out[emitted:]
                emitted = len(out)
            if _done(out, max_new_tokens, eos):
                return
            _, a = self.speculative_step(s)
            if stats is not None:
                stats.add(a)

    def stream_plain(self, input_ids, max_new_tokens: int, eos_token_id: int | list[int] | None = None
                     ) -> Iterator[list[int]]:
        """Plain greedy decoding with the target alone (the baseline; no aux capture), a token at a time."""
        prompt, eos = _as_list(input_ids), _eos_set(eos_token_id)
        cache, out, ids = DynamicCache(), [], prompt
        with torch.no_grad():
            while not _done(out, max_new_tokens, eos):
                logits = self._target(ids, cache).logits
                out.append(int(logits[0, -1].argmax()))
                ids = out[-1:]
                yield out[-1:]

    def generate(self, input_ids, max_new_tokens: int, eos_token_id: int | list[int] | None = None
                 ) -> tuple[list[int], AcceptStats]:
        """Speculative greedy decoding -> (new tokens, accept counts)."""
        stats = AcceptStats(self.k)
        out = [tok for new in self.stream(input_ids, max_new_tokens, eos_token_id, stats) for tok in new]
        return out, stats

    def generate_plain(self, input_ids, max_new_tokens: int, eos_token_id: int | list[int] | None = None
                       ) -> list[int]:
        """Plain greedy decoding with the target alone -> new tokens."""
        return [tok for new in self.stream_plain(input_ids, max_new_tokens, eos_token_id) for tok in new]


def served_as_eagle(draft: Eagle3Draft, target: torch.nn.Module) -> Eagle3Draft:
    """The draft as SGLang's EAGLE (not EAGLE3) worker runs it: the target's embedding and lm_head in
    place of the draft's, and no draft→target vocab map (ids come out of the target's full vocab)."""
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    if head.shape[1] != draft.cfg.hidden_size:   # SGLang shares nothing then; the fc width error is loud
        return draft
    served = copy.deepcopy(draft)
    served.embed_tokens = torch.nn.Embedding.from_pretrained(embed.detach().clone(), freeze=True)
    served.lm_head = torch.nn.Linear(head.shape[1], head.shape[0], bias=False)
    with torch.no_grad():
        served.lm_head.weight.copy_(head)
    served.d2t = torch.zeros(head.shape[0], dtype=torch.int64)      # identity: draft ids are target ids
    return served.eval()


def _crop(cache: DynamicCache, keep: int) -> None:
    """Keep the first `keep` positions (DynamicCache.crop takes the negative number to remove)."""
    drop = cache.get_seq_length() - keep
    if drop > 0:
        cache.crop(-drop)


def _as_list(input_ids) -> list[int]:
    if isinstance(input_ids, Tensor):
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise ValueError(f"the reference engine decodes batch 1; got input_ids {list(input_ids.shape)}")
            input_ids = input_ids[0]
        return [int(i) for i in input_ids]
    return [int(i) for i in input_ids]


def _eos_set(eos_token_id: int | list[int] | None) -> set[int]:
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(e) for e in eos_token_id}


def _done(out: list[int], max_new_tokens: int, eos: set[int]) -> bool:
    return len(out) >= max_new_tokens or any(tok in eos for tok in out)


def _finish(out: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """Cut after the first eos and at max_new_tokens (a step may overshoot both)."""
    for i, tok in enumerate(out):
        if tok in eos:
            out = out[:i + 1]
            break
    return out[:max_new_tokens]
