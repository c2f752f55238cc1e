"""The GPU decode engine (static per-slot KV cache, continuous batching) gives the loop's greedy tokens.

Run on the CPU at float32 without CUDA graphs: the same step the graph captures on a GPU, executed eagerly.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from steps.datagen import stop_token_ids  # noqa: E402
from steps.lib import artifacts  # noqa: E402
from steps.lib.data.prompts import chat_token_ids  # noqa: E402
from steps.lib.model.decode import decode  # noqa: E402
from steps.lib.model.decode_engine import decode_engine  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

QUESTIONS = ["Say hello.", "What does `json.dumps` do? Explain briefly.", "Name three colors.",
             "Write a haiku about tea and the sea, and explain every line of it.", "What is 2+2?",
             "Why?", "List the planets of the solar system in order from the sun, with one fact each."]


@pytest.fixture(scope="module")
def tiny(tiny_target):
    store, m, _ = tiny_target
    model, tok = artifacts.load_target(store, m.id)
    prompts = [chat_token_ids(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    return model, tok, prompts


def test_engine_equals_the_loop_with_every_prompt_in_a_slot(tiny):
    model, tok, prompts = tiny
    stops = stop_token_ids(tok, model.config)
    want = decode(model, prompts, 20, stops, tok.pad_token_id)
    assert decode_engine(model, prompts, 20, stops, tok.pad_token_id, graphs=False) == want


def test_refilled_slots_equal_the_loop_on_mixed_lengths(tiny):
    """Fewer slots than prompts, a frequent token as a stop so rows finish at different steps: slots are
    refilled with prompts of other lengths over stale cache columns, and every answer stays exact."""
    model, tok, prompts = tiny
    first = [a.tokens for a in decode(model, prompts, 16, [], tok.pad_token_id)]
    stop = next(t for row in first for t in row[1:] if 0 < sum(t in r for r in first) < len(first))
    want = decode(model, prompts, 16, [stop], tok.pad_token_id)
    finished = [a.finished for a in want]
    assert any(finished) and not all(finished)
    got = decode_engine(model, prompts, 16, [stop], tok.pad_token_id, slots=2, graphs=False, check_every=3,
                        prefill_rows=1)
    assert got == want
