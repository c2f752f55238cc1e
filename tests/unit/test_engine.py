"""The reference engine: lossless greedy speculative decoding, real acceptance, and F1 (EAGLE skips fc).

Two targets: a seeded random tiny Llama, and a "bigram" tiny Llama whose decoder layers add nothing
(o_proj and down_proj zero, orthonormal embeddings), so every hidden state is the token's embedding
and the next token is B(x). A draft that knows B∘B through `fc` then predicts d_1 exactly: it
accepts tokens for real, and stops accepting when `fc` is skipped (algorithm EAGLE, F1).

Expected accept counts are worked out by hand, never read back from the engine: a `ScriptedDraft`
proposes tokens chosen from the target's own plain greedy output (all right, all wrong, right-wrong-
right), and the copying draft's counts follow from its construction (see each test).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from steps.lib.model.draft import Eagle3Draft
from steps.lib.model.reference_engine import Engine
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


class ScriptedDraft:
    """A stand-in with `Eagle3Draft`'s calling convention (not the thing under test: the engine is) whose
    chain proposal j after the last real position p is `propose(p, j)`, a target id.

    It keeps the DraftCache as a real draft does (one slot per position fed) and checks that the engine
    feeds positions right after the cached ones, so the engine's cache crops are exercised too. The
    engine calls it once for the real feed (j = 0) and k - 1 times for the chain (j = 1..k-1).
    """

    def __init__(self, k: int, propose):
        self.k, self.propose, self.calls = k, propose, 0

    def __call__(self, ids, hidden, pos, cache):
        s = ids.shape[1]
        assert pos[0].tolist() == list(range(len(cache), len(cache) + s)), (pos, len(cache))
        cache.update(torch.zeros(1, 1, s, 1), torch.zeros(1, 1, s, 1))
        j = self.calls % self.k
        self.calls += 1
        logits = torch.full((1, s, V), float("-inf"))
        logits[0, -1, self.propose(int(pos[0, -1]) - j, j)] = 0.0
        return logits, torch.zeros(1, s, 1)

    @staticmethod
    def draft_to_target(idx):
        return idx


# After the prefill has produced 1 token, a round that accepts a drafts yields a + 1 tokens; a request
# for N tokens runs rounds until it has N or more. With k = 3 and N = 30 (29 tokens left after prefill):
#   every draft right (a = 3, 4 tokens a round): 1 + 4·7 = 29 < 30 <= 1 + 4·8 -> 8 rounds, τ = 4
#   every draft wrong (a = 0, 1 token a round):  29 rounds, τ = 1
#   right, wrong, right (a = 1: acceptance stops at the first wrong draft, 2 tokens a round):
#     1 + 2·14 = 29 < 30 <= 1 + 2·15 -> 15 rounds, τ = 2
SCRIPTS = {
    "all_right": (lambda full, p, j: full[p + 2 + j], [0, 0, 0, 8], 4.0, [1.0, 1.0, 1.0]),
    "all_wrong": (lambda full, p, j: (full[p + 2 + j] + 1) % V, [29, 0, 0, 0], 1.0, [0.0, 0.0, 0.0]),
    "right_wrong_right": (lambda full, p, j: (full[p + 2 + j] + (j == 1)) % V, [0, 15, 0, 0], 2.0, [1.0, 0.0, 0.0]),
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_accept_counts_are_exact_for_drafts_with_known_proposals(script):
    """After real position p (token x[p+1]) the target's greedy next token is full[p + 2], so chain step j
    is right when it proposes full[p + 2 + j] (full = prompt + plain greedy output)."""
    propose, histogram, tau, per_position = SCRIPTS[script]
    target, k = tiny_target(7), 3
    plain = Engine(target, None, None, layer_ids=LAYER_IDS, num_steps=k).generate_plain(prompt(7), 30 + k + 2)
    full = prompt(7) + plain
    draft = ScriptedDraft(k, lambda p, j: propose(full, p, j))
    spec, stats = Engine(target, None, draft, layer_ids=LAYER_IDS, num_steps=k).generate(prompt(7), 30)
    assert spec == plain[:30]
    assert stats.histogram == histogram
    assert stats.tau == tau and stats.per_position == per_position


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculative_output_equals_plain_greedy_with_a_random_draft(seed):
    target = tiny_target(seed)
    engine = Engine(target, None, random_draft(seed), layer_ids=LAYER_IDS, num_steps=3)
    forwards = []
    hook = target.register_forward_hook(lambda *_: forwards.append(1))
    spec, stats = engine.generate(prompt(seed), 30)
    hook.remove()
    assert spec == engine.generate_plain(prompt(seed), 30)
    # the counts match what happened: one target forward per verify step after the prefill, and the
    # tokens the rounds yielded (1 from the prefill + accepted + one bonus a round) reach 30, overshooting
    # by at most the k = 3 drafts of the last round
    assert len(forwards) == 1 + stats.verify_steps
    assert 30 <= 1 + stats.accepted_drafts + stats.verify_steps <= 30 + 3


def no_fixed_point_on_the_way(engine: Engine, p: list[int], n: int) -> list[int]:
    """The bigram target's greedy output, checked to never repeat a token (B(x) != x all along)."""
    out = engine.generate_plain(p, n)
    assert all(a != b for a, b in zip(out, out[1:], strict=False)), out
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_draft_that_copies_the_target_accepts_exactly_its_first_token_each_round(seed):
    """The copying draft's d_1 = B(x[n]) is right; its chain reuses the same hidden, so d_2 = d_1, right only
    if d_1 = B(d_1), which the greedy output never has (checked). So every round accepts exactly one draft:
    k = 4, N = 40, 2 tokens a round: 1 + 2·19 < 40 <= 1 + 2·20 -> 20 rounds, τ = 2."""
    target = tiny_target(seed, bigram=True)
    engine = Engine(target, None, copying_draft(target, seed=seed), layer_ids=LAYER_IDS, num_steps=4)
    plain = no_fixed_point_on_the_way(engine, prompt(seed), 42)
    spec, stats = engine.generate(prompt(seed), 40)
    assert spec == plain[:40]
    assert stats.histogram == [0, 20, 0, 0, 0]
    assert stats.tau == 2.0 and stats.per_position == [1.0, 0.0, 0.0, 0.0]


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
    plain = no_fixed_point_on_the_way(eagle3, prompt(6), 42)
    _, good = eagle3.generate(prompt(6), 40)
    assert calls and good.histogram == [0, 20, 0, 0, 0]      # as in the copying test above: τ = 2
    calls.clear()
    eagle = Engine(target, None, draft, layer_ids=LAYER_IDS, num_steps=4, algorithm="EAGLE")
    out, bad = eagle.generate(prompt(6), 40)
    assert calls == []                            # fc skipped: widths match
    # served as EAGLE the draft reads the target's final hidden of x[n-1] through the target's own head,
    # so d_1 = B(x[n-1]) = x[n], the token already there: never B(x[n]) without a fixed point -> 39 rounds
    # of one token each (1 + 39 = 40), τ = 1
    assert bad.histogram == [39, 0, 0, 0, 0] and bad.tau == 1.0
    assert out == plain[:40]                      # still lossless, just slow


def test_the_engine_refuses_unknown_algorithms_and_zero_steps():
    target = tiny_target(0)
    with pytest.raises(ValueError, match="NEXTN"):
        Engine(target, None, random_draft(0), layer_ids=LAYER_IDS, num_steps=3, algorithm="NEXTN")
    with pytest.raises(ValueError, match="num_steps"):
        Engine(target, None, random_draft(0), layer_ids=LAYER_IDS, num_steps=0)
