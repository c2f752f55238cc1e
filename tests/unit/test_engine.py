"""The reference engine: lossless greedy speculative decoding, real acceptance, and F1 (EAGLE skips fc).

Two targets: a seeded random tiny Llama, and a "bigram" tiny Llama whose decoder layers add nothing
(o_proj and down_proj zero, orthonormal embeddings), so every hidden state is the token's embedding
and the next token is B(x). A draft that knows B∘B through `fc` then predicts d_1 exactly: it
accepts tokens for real, and stops accepting when `fc` is skipped (algorithm EAGLE, F1).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from steps.draft import DraftConfig, Eagle3Draft
from steps.engine import Engine

V, H = 64, 128
LAYER_IDS = [1, 2, 3]


@pytest.fixture(autouse=True)
def one_thread():
    # tiny matmuls: thread hand-off costs more than it saves on a shared 2-core machine
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_target(seed: int, *, bigram: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=256, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                         tie_word_embeddings=False)).eval()
    if bigram:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            q, _ = torch.linalg.qr(torch.randn(H, H))
            model.model.embed_tokens.weight.copy_(q[:V] * 3.0)
    return model


def draft_config(draft_vocab: int = V) -> DraftConfig:
    return DraftConfig(hidden_size=H, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
                       vocab_size=V, draft_vocab_size=draft_vocab, target_hidden_size=H, num_aux=len(LAYER_IDS))


def random_draft(seed: int, draft_vocab: int = 40) -> Eagle3Draft:
    torch.manual_seed(seed)
    draft = Eagle3Draft(draft_config(draft_vocab)).eval()
    ids = torch.randperm(V)[:draft_vocab].sort().values
    draft.d2t.copy_(ids - torch.arange(draft_vocab))
    draft.t2d[ids] = True
    return draft


def copying_draft(target: LlamaForCausalLM, seed: int) -> Eagle3Draft:
    """A draft for the bigram target: out_hidden = fc(aux) = Q·E[x_p]; lm_head scores B(B(x_p)).

    With the reduced vocab = the image of B (every generated token lies in it), d_1 is always right;
    later chain steps reuse the same hidden, so they are right only on fixed points.
    """
    torch.manual_seed(seed)
    emb = target.model.embed_tokens.weight.detach()
    normed = emb / emb.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    bigram = (target.lm_head.weight.detach() @ normed.T).argmax(0)            # B[x]
    vocab = torch.unique(bigram)                                              # sorted target ids
    draft = Eagle3Draft(draft_config(len(vocab))).eval()
    q, _ = torch.linalg.qr(torch.randn(H, H))
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(emb)
        draft.fc.weight.zero_()
        draft.fc.weight[:, :H] = q                                            # reads the first aux state
        draft.midlayer.self_attn.o_proj.weight.zero_()
        draft.midlayer.mlp.down_proj.weight.zero_()
        head = torch.zeros(len(vocab), H)
        for x in range(V):
            head[torch.searchsorted(vocab, bigram[bigram[x]])] += q @ normed[x]
        draft.lm_head.weight.copy_(head)
        draft.d2t.copy_(vocab - torch.arange(len(vocab)))
        draft.t2d[vocab] = True
    return draft


def prompt(seed: int, n: int = 7) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculative_output_equals_plain_greedy_with_a_random_draft(seed):
    engine = Engine(tiny_target(seed), None, random_draft(seed), layer_ids=LAYER_IDS, num_steps=3)
    spec, stats = engine.generate(prompt(seed), 30)
    assert spec == engine.generate_plain(prompt(seed), 30)
    assert len(spec) == 30 and stats.verify_steps >= 30 // 4
    assert 1.0 <= stats.tau <= 4.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_draft_that_copies_the_target_accepts_tokens_and_stays_lossless(seed):
    target = tiny_target(seed, bigram=True)
    engine = Engine(target, None, copying_draft(target, seed), layer_ids=LAYER_IDS, num_steps=4)
    spec, stats = engine.generate(prompt(seed), 40)
    assert spec == engine.generate_plain(prompt(seed), 40)
    assert stats.per_position[0] == 1.0          # d_1 is always right
    assert 2.0 <= stats.tau <= 5.0
    assert stats.verify_steps <= 20              # at least two tokens per target forward


def test_eos_stops_both_modes_at_the_same_token():
    target = tiny_target(4, bigram=True)
    engine = Engine(target, None, copying_draft(target, 4), layer_ids=LAYER_IDS, num_steps=4)
    full = engine.generate_plain(prompt(4), 40)
    eos = full[9]
    cut = full[:full.index(eos) + 1]
    spec, _ = engine.generate(prompt(4), 40, eos_token_id=eos)
    assert spec == engine.generate_plain(prompt(4), 40, eos_token_id=[eos]) == cut


def test_max_new_tokens_cuts_an_overshooting_step():
    target = tiny_target(5, bigram=True)
    engine = Engine(target, None, copying_draft(target, 5), layer_ids=LAYER_IDS, num_steps=4)
    for n in (1, 2, 7):
        spec, _ = engine.generate(prompt(5), n)
        assert spec == engine.generate_plain(prompt(5), n) and len(spec) == n


def test_algorithm_eagle_skips_fc_and_collapses_acceptance():
    """F1: with EAGLE the target sends its final hidden (width H), so the draft never applies fc."""
    target = tiny_target(6, bigram=True)
    draft = copying_draft(target, 6)
    calls = []
    draft.fc.register_forward_hook(lambda *_: calls.append(1))
    eagle3 = Engine(target, None, draft, layer_ids=LAYER_IDS, num_steps=4)
    _, good = eagle3.generate(prompt(6), 40)
    assert calls and good.tau >= 2.0
    calls.clear()
    eagle = Engine(target, None, draft, layer_ids=LAYER_IDS, num_steps=4, algorithm="EAGLE")
    out, bad = eagle.generate(prompt(6), 40)
    assert calls == []                            # fc skipped: widths match
    assert bad.tau < 1.5 < good.tau
    assert out == eagle.generate_plain(prompt(6), 40)   # still lossless, just slow


def test_the_engine_refuses_unknown_algorithms_and_zero_steps():
    target = tiny_target(0)
    with pytest.raises(ValueError, match="NEXTN"):
        Engine(target, None, random_draft(0), layer_ids=LAYER_IDS, num_steps=3, algorithm="NEXTN")
    with pytest.raises(ValueError, match="num_steps"):
        Engine(target, None, random_draft(0), layer_ids=LAYER_IDS, num_steps=0)
