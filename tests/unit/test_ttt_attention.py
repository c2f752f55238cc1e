"""The fast training step computes the same loss as the reference one: flex attention over the TTT
block mask against SDPA over the dense mask, on a fixed batch (CPU, fp32, forward: flex attention
has no CPU backward; on a GPU benchmarks/gpu_perf.py runs both with gradients)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from steps.lib.model.draft import DraftConfig, Eagle3Draft
from steps.lib.training.plan import Batch
from steps.lib.training.ttt import FLEX_BLOCK, block_mask, layouts, loss_positions, ttt_loss, ttt_mask, use_flex
from steps.mapping import build_vocab

pytestmark = pytest.mark.usefixtures("one_thread")


def _draft_and_batch(seed: int = 0, scale: int = 1) -> tuple[Eagle3Draft, Batch, torch.Tensor]:
    cfg = DraftConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
                      vocab_size=300, draft_vocab_size=120, target_hidden_size=64, num_aux=3)
    g = torch.Generator().manual_seed(seed)
    d2t, t2d = build_vocab(torch.randint(0, 50, (300,), generator=g), 300, 120)
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg)
    draft.embed_tokens.weight.data.normal_(0, 0.5)
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    rows, length = 3, 150 * scale               # rows of two documents, one row ends in padding
    doc = torch.zeros(rows, length, dtype=torch.int64)
    doc[:, 70 * scale:] = 1
    doc[2, 130 * scale:] = -1
    pos = torch.cat([torch.arange(70 * scale), torch.arange(80 * scale)]).expand(rows, -1).clone()
    mask = torch.zeros(rows, length, dtype=torch.bool)
    mask[:, 30 * scale:70 * scale] = True
    mask[:, 110 * scale:] = True
    mask &= doc >= 0
    ids = t2d.nonzero().flatten()[torch.randint(0, 120, (rows, length), generator=g)]
    batch = Batch(ids, mask, doc, pos, torch.randn(rows, length, 192, generator=g),
                  torch.randn(rows, length, 64, generator=g))
    return draft, batch, torch.randn(120, 64, generator=g) * 0.3


@pytest.mark.parametrize("steps", [1, 3, 7])
def test_flex_attention_gives_the_loss_of_the_dense_mask(steps):
    draft, batch, head_rows = _draft_and_batch()
    with torch.no_grad():
        ref, ref_acc, n = ttt_loss(draft, batch, head_rows, steps=steps, decay=0.8, attention="sdpa")
        got, got_acc, m = ttt_loss(draft, batch, head_rows, steps=steps, decay=0.8, attention="flex")
    assert n == m > 0
    assert torch.isfinite(ref) and float(ref) > 0.1
    assert abs(float(got) - float(ref)) <= 1e-5 * float(ref)
    assert got_acc == ref_acc


def test_the_block_mask_holds_exactly_the_dense_mask():
    _, batch, _ = _draft_and_batch(seed=1, scale=5)       # rows of 750: several 128-blocks each way
    valid = loss_positions(batch, torch.ones(300, dtype=torch.bool), 4)
    lays = layouts(valid, batch.doc, 4)
    for j in range(4):
        dense = ttt_mask(batch.doc, lays, j)
        bm = block_mask(dense)
        assert bm.shape[-2:] == dense.shape[-2:]
        m = dense[:, 0]
        ref = create_block_mask(lambda b, h, q, kv, m=m: m[b, q, kv], B=m.shape[0], H=None, Q_LEN=m.shape[1],
                                KV_LEN=m.shape[2], device="cpu", BLOCK_SIZE=FLEX_BLOCK)
        assert torch.equal(bm.to_dense(), ref.to_dense())          # the same blocks computed ...
        assert torch.equal(bm.full_kv_num_blocks, ref.full_kv_num_blocks)   # ... the same ones unmasked
        b, q, kv = torch.meshgrid(*(torch.arange(n) for n in dense[:, 0].shape), indexing="ij")
        assert torch.equal(bm.mask_mod(b, None, q, kv), dense[:, 0])


def test_attention_choice():
    assert use_flex("auto", torch.device("cuda")) and not use_flex("auto", torch.device("cpu"))
    assert use_flex("flex", torch.device("cpu")) and not use_flex("sdpa", torch.device("cuda"))
    with pytest.raises(ValueError, match="expected auto, flex or sdpa"):
        use_flex("fast", torch.device("cpu"))
