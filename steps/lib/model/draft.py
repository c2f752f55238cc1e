"""The EAGLE-3 draft model: one decoder layer over `[embed(token); feature]`, nothing else.

Reads nothing and writes nothing; `steps/train.py` trains it, `steps/lib/model/reference_engine.py` drafts with it and
`steps/export.py` renames its weights per engine. Parameter names are SGLang's canonical ones
(`midlayer.*`, `fc`, `norm`, `lm_head`, buffers `d2t`/`t2d`), so a state dict written from this
module needs no key map for SGLang (F2) and the vocab buffers travel with the weights (F3).

One layer (SGLang `llama_eagle3.py`):

    h   = fc(aux)                  if the feature is wider than H (aux states [A*Ht]), else as is
    x   = cat(input_layernorm(embed(token)), hidden_norm(h))        [.., 2H]
    r   = h + o_proj(attention(q/k/v from x, RoPE, GQA))
    out = r + mlp(post_attention_layernorm(r))                      the pre-norm residual stream
    logits = lm_head(norm(out))                                     [.., draft_vocab]

`out` (not the normed one) is the feature of the next chain step. Attention is one
`scaled_dot_product_attention` call over `cat(cached keys, new keys)` with a boolean mask (True =
attend), so training-time test and cached inference run the same code: training passes the TTT
mask explicitly, inference the default causal mask over the cache. Training on a GPU passes the
same mask as a flex-attention `BlockMask` instead: the same scores, but only the key blocks some
query attends to are computed (a TTT step's chain keys are a narrow diagonal band).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from steps.lib.draft_config import DraftConfig

_compiled_flex = None


def flex(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask) -> Tensor:
    """Flex attention over a block mask, GQA without repeating K/V; compiled on CUDA (eager flex is a
    reference implementation, used only for CPU checks without gradients)."""
    global _compiled_flex
    if q.device.type != "cuda":
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    # One memory layout for every call: dynamo guards on strides, and the pipeline's batches alternate
    # between a transposed view and a concatenated K/V, which recompiled until the limit (8) and then ran
    # unfused (an H200 run of real batches: 21k tok/s against 81k at fixed shapes, benchmarks/README.md).
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=True)


class DraftCache:
    """K/V of the positions already fed: `[B, n_kv, S, D]` (one decoder layer; post-RoPE keys)."""

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append new K/V; returns all K/V (cached + new)."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, n: int) -> None:
        """Keep the first `n` positions (the engine drops rejected drafts and chain keys)."""
        if self.k is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]


def compiled_on_gpu(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """`fn` compiled (dynamic shapes) when its first argument is on a GPU and gradients are on (training),
    as written elsewhere.

    For the elementwise chains of the layer (fp32 norms, RoPE, SiLU·up): eager, each is 5-10 small
    kernels, and at 8B shapes their launches and memory passes were a third of a training step. Decoding
    (verify's engine, batch 1, one to k+1 positions a call) stays eager: its shapes change every call and
    recompiled until dynamo's limit, seconds each, for kernels that are launch-bound anyway."""
    compiled = None

    @functools.wraps(fn)
    def call(*args: Any) -> Tensor:
        nonlocal compiled
        if not args[0].is_cuda or not torch.is_grad_enabled():
            return fn(*args)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True)
        return compiled(*args)
    return call


@compiled_on_gpu
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # normalise in fp32 (as Llama does) so bf16 training matches fp32 serving
    xf = x.float()
    return (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


@compiled_on_gpu
def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


@compiled_on_gpu
def rope(x: Tensor, position_ids: Tensor, theta: float) -> Tensor:
    """Llama rotate-half RoPE. x: [B, h, S, D]; position_ids: [B, S]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = position_ids.to(torch.float32)[:, None, :, None] * inv_freq       # [B, 1, S, D/2]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return (x.float() * cos + torch.cat([-x2, x1], -1).float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        h, nh, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.nh, self.nkv, self.d, self.theta = nh, nkv, d, cfg.rope_theta
        self.q_proj = nn.Linear(2 * h, nh * d, bias=False)     # q/k/v read the 2H concatenation
        self.k_proj = nn.Linear(2 * h, nkv * d, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, h, bias=False)

    def forward(self, x: Tensor, position_ids: Tensor, cache: DraftCache | None,
                attn_mask: Tensor | None) -> Tensor:
        # x: [B, S, 2H] -> [B, S, H]
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.nh, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.nkv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.nkv, self.d).transpose(1, 2)
        q, k = rope(q, position_ids, self.theta), rope(k, position_ids, self.theta)
        past = 0 if cache is None else len(cache)
        if cache is not None:
            k, v = cache.update(k, v)                           # [B, nkv, past+S, D]
        if attn_mask is None:                                   # causal over cache + new
            attn_mask = torch.ones(s, past + s, dtype=torch.bool, device=x.device).tril(past)
        if isinstance(attn_mask, BlockMask):     # training-time test on a GPU: only the blocks that attend
            y = flex(q, k, v, attn_mask)
        else:
            rep = self.nh // self.nkv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)   # [B, nh, S, D]
        return self.o_proj(y.transpose(1, 2).reshape(b, s, self.nh * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


class MidLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, emb: Tensor, h: Tensor, position_ids: Tensor, cache: DraftCache | None,
                attn_mask: Tensor | None) -> Tensor:
        # emb, h: [B, S, H] -> out_hidden [B, S, H]
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)
        r = h + self.self_attn(x, position_ids, cache, attn_mask)        # residual is the feature
        return r + self.mlp(self.post_attention_layernorm(r))


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)           # frozen copy of the target's
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, h, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    @classmethod
    def from_target(cls, target_state: dict[str, Tensor], cfg: DraftConfig, d2t: Tensor, t2d: Tensor,
                    *, init_lm_head: bool = False) -> Eagle3Draft:
        """A fresh draft with the target's embedding (frozen) and vocab map.

        `target_state` holds `embed_tokens.weight` (HF `model.` prefix accepted) and optionally
        `lm_head.weight`; with `init_lm_head` the draft's head starts from the target's rows of the
        draft vocab, which the draft then adapts (a warm start; the served head is the draft's own).
        """
        model = cls(cfg)
        embed = target_state.get("model.embed_tokens.weight", target_state.get("embed_tokens.weight"))
        if embed is None:
            raise KeyError("target state has no embed_tokens.weight (or model.embed_tokens.weight); "
                           f"keys: {sorted(target_state)[:8]}...")
        with torch.no_grad():
            model.embed_tokens.weight.copy_(embed)
            model.d2t.copy_(d2t)
            model.t2d.copy_(t2d)
            head = target_state.get("lm_head.weight", embed)     # tied embeddings: the head is embed
            if init_lm_head:
                model.lm_head.weight.copy_(head[d2t + torch.arange(len(d2t))])
        return model

    def forward_hidden(self, input_ids: Tensor, hidden: Tensor, position_ids: Tensor,
                       cache: DraftCache | None = None, attn_mask: Tensor | None = None) -> Tensor:
        """input_ids [B, S], hidden [B, S, A*Ht or H], position_ids [B, S] -> out_hidden [B, S, H]."""
        if hidden.shape[-1] != self.cfg.hidden_size:            # SGLang's rule: fc only when wider
            hidden = self.fc(hidden)
        return self.midlayer(self.embed_tokens(input_ids), hidden, position_ids, cache, attn_mask)

    def compute_logits(self, out_hidden: Tensor) -> Tensor:
        """out_hidden [.., H] -> draft-vocab logits [.., draft_vocab]."""
        return self.lm_head(self.norm(out_hidden))

    def forward(self, input_ids: Tensor, hidden: Tensor, position_ids: Tensor,
                cache: DraftCache | None = None, attn_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """-> (logits [B, S, draft_vocab], out_hidden [B, S, H]). attn_mask: bool, True = attend,
        broadcastable to [B, heads, S, len(cache) + S]; None = causal over cache + new."""
        out = self.forward_hidden(input_ids, hidden, position_ids, cache, attn_mask)
        return self.compute_logits(out), out

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft vocab ids -> target ids (`target = i + d2t[i]`)."""
        return draft_ids + self.d2t[draft_ids]
