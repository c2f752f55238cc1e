"""The batched decode loop datagen answers with: greedy tokens equal greedy `generate`, rows leave the batch."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from steps.datagen import stop_token_ids  # noqa: E402
from steps.lib.model.decode import cpu_threads, decode, generate_reference, torch_threads  # noqa: E402
from tests.builders import tiny_chat_batch  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

QUESTIONS = ["Say hello.", "What does `json.dumps` do? Explain briefly.", "Name three colors.",
             "Write a haiku about tea and the sea, and explain every line of it.", "What is 2+2?"]


@pytest.fixture(scope="module")
def tiny(tiny_target):
    return tiny_chat_batch(tiny_target, QUESTIONS)


def test_greedy_tokens_equal_generate_on_a_ragged_batch(tiny):
    model, tok, prompts = tiny
    stops = stop_token_ids(tok, model.config)
    got = decode(model, prompts, 24, stops, tok.pad_token_id)
    assert got == generate_reference(model, prompts, 24, stops, tok.pad_token_id)


def test_rows_that_stop_leave_the_batch_and_the_rest_stay_exact(tiny):
    """Make a frequent token a stop token, so rows finish at different steps and the batch shrinks
    (and its padding columns are cut) while the others keep decoding."""
    model, tok, prompts = tiny
    first = [a.tokens for a in decode(model, prompts, 16, [], tok.pad_token_id)]
    # a token some rows produce (after their first step) and others never do
    stop = next(t for row in first for t in row[1:] if 0 < sum(t in r for r in first) < len(first))
    stops = [stop]
    got = decode(model, prompts, 16, stops, tok.pad_token_id)
    want = generate_reference(model, prompts, 16, stops, tok.pad_token_id)
    assert got == want
    finished = [a.finished for a in want]
    assert any(finished) and not all(finished)     # the case under test: some rows left early, some did not
    assert all(len(a.tokens) <= 16 for a in got)


def test_sampling_is_seeded_by_the_generator(tiny):
    model, tok, prompts = tiny

    def sample(seed):
        g = torch.Generator().manual_seed(seed)
        return [a.tokens for a in decode(model, prompts, 12, [], tok.pad_token_id, temperature=1.0, generator=g)]

    assert sample(3) == sample(3) and sample(3) != sample(4)


@pytest.mark.parametrize(("load", "cores", "threads"), [
    (0.0, 2, 2), (1.2, 2, 2), (2.4, 2, 2), (3.0, 2, 1), (10.0, 2, 1), (5.0, 8, 8), (12.0, 8, 4)])
def test_only_the_load_beyond_the_cores_takes_threads(load, cores, threads):
    # a quiet machine right after the pipeline's own step reads ~1: it must still get every core
    assert cpu_threads(load, cores) == threads


def test_thread_count_follows_the_load_and_is_restored():
    n = cpu_threads()
    assert 1 <= n <= len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
