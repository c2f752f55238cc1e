"""An engine-grade batched decoder for a Llama-family target on a GPU: what datagen answers with there.

`decode.py`'s loop keeps one shrinking batch per call and syncs with the host every token; on an H200 it
makes ~5–8k answer tok/s for SmolLM2-135M (benchmarks/README.md). This engine keeps a fixed number of
slots busy instead:

- a static KV cache, preallocated per slot (`[slots, kv_heads, prompt + new tokens, head_dim]` per layer),
  written in place at each slot's own position;
- the per-token step (every slot, one token) has static shapes, so on CUDA it is captured once in a CUDA
  graph and replayed;
- finished rows are refilled with waiting prompts (continuous batching), checked every `check_every`
  steps so the host syncs rarely; a finished slot decodes ignored tokens until the next check.

The forward is the target's own modules (embedding, norms, projections, rotary embedding, MLP, head)
called in Llama order with our cache and mask, so at float32 greedy it gives the loop's tokens
(tests/unit/test_decode_engine.py). Sampled answers draw other random numbers than the loop's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from steps.lib.model.decode import Answer

ENGINE_MODEL_TYPES = ("llama",)   # the layer layout `_forward` calls; others use the loop


class _Engine:
    """The static cache and the forward over it, for a fixed number of slots."""

    def __init__(self, model: torch.nn.Module, slots: int, length: int) -> None:
        cfg = model.config
        if cfg.model_type not in ENGINE_MODEL_TYPES:
            raise ValueError(f"datagen.decoder=engine: model type {cfg.model_type!r} is not one of "
                             f"{ENGINE_MODEL_TYPES}; use datagen.decoder=loop")
        self.model, self.inner = model, model.model
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.slots, self.length = slots, length
        shape = (slots, self.kv_heads, length, self.head_dim)
        self.k = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.inner.layers]
        self.v = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.inner.layers]
        self.columns = torch.arange(length, device=self.device)
        self.slot_ids = torch.arange(slots, device=self.device)

    def forward(self, slot: torch.Tensor | None, ids: torch.Tensor, pos: torch.Tensor, width: int) -> torch.Tensor:
        """Hidden states after the final norm for tokens `ids` [b, T] at positions `pos` [b, T] of slots
        `slot` [b] (None: every slot in order, its cache read in place rather than gathered); keys and
        values are written into those slots' cache, attention reads its first `width` columns, each query
        seeing the columns up to its own position."""
        b, t = ids.shape
        h = self.inner.embed_tokens(ids)
        rope = self.inner.rotary_emb(h, pos)
        mask = (self.columns[:width][None, None, None, :] <= pos[:, None, :, None])   # [b, 1, T, width]
        every = slot is None
        rows = (self.slot_ids if every else slot)[:, None].expand(b, t)
        for i, layer in enumerate(self.inner.layers):
            att = layer.self_attn
            x = layer.input_layernorm(h)
            q = att.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
            k = att.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            v = att.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, *rope)
            # cache[slot, :, pos] = k[:, :, t]: advanced indices on dims 0 and 2 put (b, T) first
            self.k[i][rows, :, pos] = k.transpose(1, 2)
            self.v[i][rows, :, pos] = v.transpose(1, 2)
            keys = self.k[i][:, :, :width] if every else self.k[i][slot, :, :width]
            values = self.v[i][:, :, :width] if every else self.v[i][slot, :, :width]
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=att.scaling,
                                               enable_gqa=self.kv_heads != self.heads)
            h = h + att.o_proj(o.transpose(1, 2).reshape(b, t, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.inner.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden).float()


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row: argmax at temperature 0, else a draw from softmax(logits / T)."""
    if temperature > 0:
        return torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator)[:, 0]
    return logits.argmax(dim=-1)


@torch.no_grad()
def decode_engine(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, stops: Iterable[int],
                  pad: int, *, temperature: float = 0.0, generator: torch.Generator | None = None,
                  slots: int = 1024, graphs: bool | None = None, check_every: int = 16,
                  prefill_rows: int = 128) -> list[Answer]:
    """Answer each prompt like `decode.decode` (same `Answer`s; greedy at float32 token for token), with
    `slots` rows decoding at once, refilled as rows finish. `graphs`: capture the step in a CUDA graph
    (default: on CUDA). `prefill_rows` bounds one prefill's batch (its attention is rows × width²)."""
    stop_set = set(stops)
    answers = [Answer([], False) for _ in prompts]
    if not prompts:
        return answers
    n_slots = min(slots, len(prompts))
    longest = max(len(p) for p in prompts)
    eng = _Engine(model, n_slots, longest + max_new_tokens)
    dev = eng.device
    graphs = dev.type == "cuda" if graphs is None else graphs
    room = max_new_tokens + check_every                       # a finished slot writes on until the next check
    gen = torch.full((n_slots, room), pad, dtype=torch.long, device=dev)
    count = torch.zeros(n_slots, dtype=torch.long, device=dev)
    cur = torch.full((n_slots,), pad, dtype=torch.long, device=dev)
    pos = torch.zeros(n_slots, dtype=torch.long, device=dev)
    every = torch.arange(n_slots, device=dev)
    owner: list[int | None] = [None] * n_slots                 # slot -> prompt index
    waiting = list(range(len(prompts)))[::-1]                  # popped from the end: prompt order

    def fill(free: list[int]) -> None:
        """Prefill waiting prompts into `free` slots: their cache, first token, counters."""
        take = [(s, waiting.pop()) for s in free[:len(waiting)]]
        for c in range(0, len(take), prefill_rows):
            chunk = take[c:c + prefill_rows]
            width = max(len(prompts[i]) for _, i in chunk)
            ids = torch.tensor([prompts[i] + [pad] * (width - len(prompts[i])) for _, i in chunk], device=dev)
            slot = torch.tensor([s for s, _ in chunk], device=dev)
            last = torch.tensor([len(prompts[i]) - 1 for _, i in chunk], device=dev)
            hidden = eng.forward(slot, ids, torch.arange(width, device=dev).expand(len(chunk), width), width)
            tok = _pick(eng.logits(hidden[torch.arange(len(chunk), device=dev), last]), temperature, generator)
            gen[slot, 0], count[slot], cur[slot], pos[slot] = tok, 1, tok, last + 1
            for s, i in chunk:
                owner[s] = i

    def step() -> torch.Tensor:
        return eng.logits(eng.forward(None, cur[:, None], pos[:, None], eng.length)[:, 0])

    fill(list(range(n_slots)))
    graph, out = None, None
    if graphs:
        # warm up on a side stream (cuBLAS handles, autotuning) as torch.cuda.graphs asks, then capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
    steps = 0
    while any(o is not None for o in owner):
        if graph is not None:
            graph.replay()
            logits = out
        else:
            logits = step()
        tok = _pick(logits, temperature, generator)
        gen[every, count.clamp(max=room - 1)] = tok
        count.add_(1)
        cur.copy_(tok)
        pos.add_(1).clamp_(max=eng.length - 1)
        steps += 1
        if steps % check_every:
            continue
        free = _harvest(gen, count, owner, answers, stop_set, max_new_tokens)
        if free and waiting:
            fill(free)
    return answers


def _harvest(gen: torch.Tensor, count: torch.Tensor, owner: list[int | None], answers: list[Answer],
             stop_set: set[int], max_new_tokens: int) -> list[int]:
    """Move finished slots' tokens into `answers` (cut at the first stop, as the loop cuts) and return the
    freed slots. One host sync for the whole batch."""
    rows, counts = gen.tolist(), count.tolist()
    free = []
    for s, i in enumerate(owner):
        if i is None:
            continue
        made = rows[s][:min(counts[s], max_new_tokens)]
        end = next((j for j, t in enumerate(made) if t in stop_set), None)
        if end is None and len(made) < max_new_tokens:
            continue
        answers[i] = Answer(made[:end], True) if end is not None else Answer(made, False)
        owner[s] = None
        free.append(s)
    return free


__all__ = ["ENGINE_MODEL_TYPES", "decode_engine"]
