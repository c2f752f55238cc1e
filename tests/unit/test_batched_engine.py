"""The batched engine: every row's output is plain greedy decoding, and its accept counts are the one-request
engine's, for prompts of different lengths whose rows accept, reject and finish at different rounds."""

from __future__ import annotations

import pytest
import torch

from steps.lib.model.batched_engine import BatchedEngine
from steps.lib.model.reference_engine import Engine
from tests import builders
from tests.builders import copying_draft, make_bigram, tiny_llama

V, H = 64, 128
LAYER_IDS = [1, 2, 3]
pytestmark = pytest.mark.usefixtures("one_thread")


def prompts(seed: int, lengths=(7, 3, 12, 5)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]


def engines(seed: int, *, bigram: bool, k: int) -> tuple[Engine, BatchedEngine]:
    target = tiny_llama(vocab_size=V, hidden_size=H, intermediate_size=256, seed=seed, tie_word_embeddings=False)
    if bigram:    # the copying draft accepts one draft a round; fc perturbed, rows accept 0 or 1 ([14, 13, 0, 0])
        target = make_bigram(target)
        draft = copying_draft(target, seed=seed)
        noise = torch.randn(draft.fc.weight.shape, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            draft.fc.weight.add_(3.0 * draft.fc.weight.std() * noise)
    else:
        draft = builders.random_draft(seed, vocab_size=V, hidden_size=H, draft_vocab_size=40)
    engine = Engine(target, None, draft, layer_ids=LAYER_IDS, num_steps=k)
    return engine, BatchedEngine(engine)


@pytest.mark.parametrize(("seed", "bigram", "k"), [(0, False, 3), (1, True, 4), (2, True, 3), (3, False, 7)])
def test_batched_rows_equal_plain_greedy_and_the_one_request_engine(seed, bigram, k):
    engine, batched = engines(seed, bigram=bigram, k=k)
    ps = prompts(seed)
    results = batched.generate(ps, 40)
    for p, (out, stats) in zip(ps, results, strict=True):
        one, one_stats = engine.generate(p, 40)
        assert out == engine.generate_plain(p, 40)
        assert out == one
        assert stats.histogram == one_stats.histogram
        assert stats.rounds == one_stats.rounds and len(stats.rounds) == stats.verify_steps   # in the same order
    if bigram:    # rows accepted and rejected in different rounds: the masks' holes differ from row to row
        assert len({tuple(stats.histogram) for _, stats in results}) > 1


def test_rows_that_stop_at_eos_leave_the_batch_and_the_rest_decode_on():
    engine, batched = engines(4, bigram=True, k=3)
    ps = prompts(4)
    eos = engine.generate_plain(ps[1], 10)[4]          # row 1 stops early; the others when they meet it
    results = batched.generate(ps, 40, eos)
    assert results[1][0][-1] == eos and len(results[1][0]) <= 5
    for p, (out, stats) in zip(ps, results, strict=True):
        one, one_stats = engine.generate(p, 40, eos)
        assert out == one == engine.generate_plain(p, 40, eos)
        assert stats.histogram == one_stats.histogram
