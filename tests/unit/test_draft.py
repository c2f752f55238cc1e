"""The draft model: canonical names, SGLang's fc rule, and train == engine attention semantics."""

from __future__ import annotations

import pytest
import torch

from steps.lib.model.draft import DraftCache, DraftConfig, Eagle3Draft
from steps.lib.training.plan import Batch
from steps.lib.training.ttt import loss_positions, ttt_unroll
from steps.mapping import build_vocab
from tests.builders import CANONICAL_DRAFT_KEYS

CANONICAL_KEYS = CANONICAL_DRAFT_KEYS
pytestmark = pytest.mark.usefixtures("one_thread")


def small_cfg(**kw) -> DraftConfig:
    base = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256, vocab_size=60,
                draft_vocab_size=40, target_hidden_size=24, num_aux=3)
    return DraftConfig(**{**base, **kw})


def random_draft(cfg: DraftConfig, seed: int = 0) -> Eagle3Draft:
    torch.manual_seed(seed)
    d2t, t2d = build_vocab(torch.randint(1, 50, (cfg.vocab_size,)), cfg.vocab_size, cfg.draft_vocab_size)
    state = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, cfg.hidden_size)}
    model = Eagle3Draft.from_target(state, cfg, d2t, t2d)
    with torch.no_grad():                       # norms away from 1 so that a swapped norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval()


def packed_batch(cfg: DraftConfig, docs: list[list[int]], length: int, seed: int = 1) -> Batch:
    """Rows of packed sequences with the given lengths (the rest padding)."""
    g = torch.Generator().manual_seed(seed)
    b = len(docs)
    doc = torch.full((b, length), -1, dtype=torch.int64)
    pos = torch.zeros(b, length, dtype=torch.int64)
    for r, lens in enumerate(docs):
        at = 0
        for d, n in enumerate(lens):
            doc[r, at:at + n], pos[r, at:at + n] = d, torch.arange(n)
            at += n
    ids = torch.randint(0, cfg.vocab_size, (b, length), generator=g)
    aux = torch.randn(b, length, cfg.num_aux * cfg.target_hidden_size, generator=g)
    return Batch(ids, doc >= 0, doc, pos, aux, torch.randn(b, length, cfg.target_hidden_size, generator=g))


def engine_chain(model: Eagle3Draft, ids: torch.Tensor, aux: torch.Tensor, p: int, steps: int) -> list[torch.Tensor]:
    """The engine's path for one sequence: feed real positions 0..p through the cache (tokens
    x[1..p+1], features f[0..p]), then chain steps 1.. one position at a time, each fed the token
    x[p+1+j] (0 past the end) and the previous out_hidden. Returns out_hidden of steps 0..steps-1."""
    n = len(ids)
    tok = lambda i: int(ids[i]) if i < n else 0  # noqa: E731
    cache = DraftCache()
    _, out = model(torch.tensor([[tok(i + 1) for i in range(p + 1)]]), aux[None, : p + 1],
                   torch.arange(p + 1)[None], cache)
    outs, h = [out[0, -1]], out[:, -1:]
    for j in range(1, steps):
        _, h = model(torch.tensor([[tok(p + 1 + j)]]), h, torch.tensor([[p + j]]), cache)
        outs.append(h[0, -1])
    assert len(cache) == p + steps
    return outs


def test_draft_uses_the_canonical_sglang_parameter_names():
    model = random_draft(small_cfg())
    assert set(model.state_dict()) == CANONICAL_KEYS
    assert model.state_dict()["d2t"].dtype == torch.int64 and model.state_dict()["t2d"].dtype == torch.bool
    assert model.fc.weight.shape == (32, 72)
    assert model.midlayer.self_attn.q_proj.weight.shape == (4 * 8, 64)        # q/k/v read 2H
    assert model.midlayer.self_attn.k_proj.weight.shape == (2 * 8, 64)


def test_training_unroll_equals_incremental_engine_drafting_with_a_kv_cache():
    """Step j of training-time test at position p == the engine's j-th chain step from p, for every
    p of every packed sequence: the TTT mask, positions, features and tokens match the cached path."""
    cfg, steps = small_cfg(), 4
    model = random_draft(cfg)
    batch = packed_batch(cfg, [[9, 7], [16], [5, 3]], length=16)
    with torch.no_grad():
        train_outs = [out for out, _ in ttt_unroll(model, batch, steps)]
        checked = 0
        for r in range(batch.doc.shape[0]):
            for d in range(int(batch.doc[r].max()) + 1):
                cols = (batch.doc[r] == d).nonzero().flatten()
                ids, aux = batch.input_ids[r, cols], batch.aux[r, cols]
                for p in range(len(cols)):
                    for j, h in enumerate(engine_chain(model, ids, aux, p, steps)):
                        torch.testing.assert_close(train_outs[j][r, cols[p]], h, rtol=1e-4, atol=1e-5)
                        checked += 1
    assert checked == (9 + 7 + 16 + 5 + 3) * steps


def test_training_on_only_the_counted_positions_still_equals_the_engine():
    """Training computes chain step j only where a counted prediction remains (assistant spans);
    those positions must still match the engine exactly, and the others must be skipped."""
    cfg, steps = small_cfg(), 4
    model = random_draft(cfg)
    batch = packed_batch(cfg, [[12, 4], [16]], length=16, seed=5)
    batch.loss_mask[0, :7] = False                                        # a prompt, then an answer
    batch.loss_mask[1, 3:9] = False
    valid = loss_positions(batch, model.t2d, steps)
    computed = 0
    with torch.no_grad():
        for j, (out, lay) in enumerate(ttt_unroll(model, batch, steps, valid)):
            if j > 0:
                assert lay.idx.shape[1] < 16                                  # chain steps skip positions
            for r in range(2):
                for m in (~lay.pad[r]).nonzero().flatten().tolist():
                    p = int(lay.idx[r, m])
                    cols = (batch.doc[r] == batch.doc[r, p]).nonzero().flatten()
                    local = p - int(cols[0])
                    h = engine_chain(model, batch.input_ids[r, cols], batch.aux[r, cols], local, j + 1)[j]
                    torch.testing.assert_close(out[r, m], h, rtol=1e-4, atol=1e-5)
                    computed += 1
            for r, p in valid[j].nonzero().tolist():                          # every counted one is computed
                assert not lay.pad[r, lay.inv[r, p]] and lay.idx[r, lay.inv[r, p]] == p
    assert computed > 32


def test_packed_sequences_do_not_attend_to_each_other():
    cfg = small_cfg()
    model = random_draft(cfg)
    alone = packed_batch(cfg, [[6]], length=12, seed=3)
    packed = packed_batch(cfg, [[6, 6]], length=12, seed=3)
    packed.input_ids[0, :6], packed.aux[0, :6] = alone.input_ids[0, :6], alone.aux[0, :6]
    with torch.no_grad():
        a = [out for out, _ in ttt_unroll(model, alone, 3)]
        b = [out for out, _ in ttt_unroll(model, packed, 3)]
    for j in range(3):   # the first sequence's last position sees x[6] only when it is its own
        torch.testing.assert_close(a[j][0, : 5 - j], b[j][0, : 5 - j], rtol=1e-5, atol=1e-6)


def test_cache_crop_then_refeed_equals_feeding_from_scratch():
    """The engine drops chain keys after verify (crop to the real positions) and feeds new ones."""
    cfg = small_cfg()
    model = random_draft(cfg)
    ids, aux = torch.randint(0, cfg.vocab_size, (1, 10)), torch.randn(1, 10, 72)
    pos = torch.arange(10)[None]
    with torch.no_grad():
        fresh_logits, _ = model(ids, aux, pos, DraftCache())
        cache = DraftCache()
        _, out = model(ids[:, :6], aux[:, :6], pos[:, :6], cache)
        model(ids[:, 6:7], out[:, -1:], pos[:, 6:7] , cache)               # a chain step, later rejected
        cache.crop(6)
        logits, _ = model(ids[:, 6:], aux[:, 6:], pos[:, 6:], cache)
    torch.testing.assert_close(logits, fresh_logits[:, 6:], rtol=1e-4, atol=1e-5)


def test_fc_is_skipped_when_the_feature_width_equals_hidden_size():
    """SGLang's rule: fc only when the feature is wider than H (so EAGLE-1 style capture skips it: F1)."""
    cfg = small_cfg()
    model = random_draft(cfg)
    ids, pos = torch.randint(0, cfg.vocab_size, (1, 5)), torch.arange(5)[None]
    narrow, wide = torch.randn(1, 5, cfg.hidden_size), torch.randn(1, 5, 72)
    with torch.no_grad():
        before_narrow, _ = model(ids, narrow, pos)
        before_wide, _ = model(ids, wide, pos)
        model.fc.weight.mul_(2.0)
        after_narrow, _ = model(ids, narrow, pos)
        after_wide, _ = model(ids, wide, pos)
    torch.testing.assert_close(before_narrow, after_narrow)
    assert not torch.allclose(before_wide, after_wide)


def test_from_target_copies_and_freezes_the_embedding_and_keeps_the_vocab_map():
    cfg = small_cfg()
    torch.manual_seed(0)
    embed, head = torch.randn(cfg.vocab_size, cfg.hidden_size), torch.randn(cfg.vocab_size, cfg.hidden_size)
    d2t, t2d = build_vocab(torch.arange(cfg.vocab_size), cfg.vocab_size, cfg.draft_vocab_size)
    state = {"model.embed_tokens.weight": embed, "lm_head.weight": head}
    assert not torch.equal(Eagle3Draft.from_target(state, cfg, d2t, t2d).lm_head.weight, head[t2d])
    model = Eagle3Draft.from_target(state, cfg, d2t, t2d, init_lm_head=True)
    assert torch.equal(model.embed_tokens.weight, embed) and not model.embed_tokens.weight.requires_grad
    assert torch.equal(model.d2t, d2t) and torch.equal(model.t2d, t2d)
    assert torch.equal(model.lm_head.weight, head[t2d])                     # optional warm start: the target's rows
    assert torch.equal(model.draft_to_target(torch.arange(cfg.draft_vocab_size)), t2d.nonzero().flatten())
