"""The reference engine: lossless greedy speculative decoding, real acceptance, and F1 (EAGLE skips fc).

Two targets: a seeded random tiny Llama, and a "bigram" tiny Llama whose decoder layers add nothing
(o_proj and down_proj zero, orthonormal embeddings), so every hidden state is the token's embedding
and the next token is B(x). A draft that knows B∘B through `fc` then predicts d_1 exactly: it
accepts tokens for real, and stops accepting when `fc` is skipped (algorithm EAGLE, F1).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from steps.draft import Eagle3Draft
from steps.engine import Engine
from tests import builders
from tests.builders import copying_draft, make_bigram, tiny_llama

V, H = 64, 128
LAYER_IDS = [1, 2, 3]
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_target(seed: int, *, bigram: bool = False) -> LlamaForCausalLM:
    model = tiny_llama(vocab_size=V, hidden_size=H, intermediate_size=256, seed=seed, tie_word_embeddings=False)
    return make_bigram(model) if bigram else model


def random_draft(seed: int, draft_vocab: int = 40) -> Eagle3Draft:
    return builders.random_draft(seed, vocab_size=V, hidden_size=H, draft_vocab_size=draft_vocab)


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
    engine = Engine(target, None, copying_draft(target, seed=seed), layer_ids=LAYER_IDS, num_steps=4)
    spec, stats = engine.generate(prompt(seed), 40)
    assert spec == engine.generate_plain(prompt(seed), 40)
    assert stats.per_position[0] == 1.0          # d_1 is always right
    assert 2.0 <= stats.tau <= 5.0
    assert stats.verify_steps <= 20              # at least two tokens per target forward


def test_eos_stops_both_modes_at_the_same_token():
    target = tiny_target(4, bigram=True)
    engine = Engine(target, None, copying_draft(target, seed=4), layer_ids=LAYER_IDS, num_steps=4)
    full = engine.generate_plain(prompt(4), 40)
    eos = full[9]
    cut = full[:full.index(eos) + 1]
    spec, _ = engine.generate(prompt(4), 40, eos_token_id=eos)
    assert spec == engine.generate_plain(prompt(4), 40, eos_token_id=[eos]) == cut


def test_max_new_tokens_cuts_an_overshooting_step():
    target = tiny_target(5, bigram=True)
    engine = Engine(target, None, copying_draft(target, seed=5), layer_ids=LAYER_IDS, num_steps=4)
    for n in (1, 2, 7):
        spec, _ = engine.generate(prompt(5), n)
        assert spec == engine.generate_plain(prompt(5), n) and len(spec) == n


def test_algorithm_eagle_skips_fc_and_collapses_acceptance():
    """F1: with EAGLE the target sends its final hidden (width H), so the draft never applies fc."""
    target = tiny_target(6, bigram=True)
    draft = copying_draft(target, seed=6)
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
