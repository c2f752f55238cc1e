"""steps/lib/data/size.py: the answers a config needs, read from benchmarks/README.md's τ-against-data curve."""

from __future__ import annotations

from steps.lib.config import load_config
from steps.lib.data.size import TAU_CURVE, answers_for, answers_needed, expected_tau, size_warning


def test_the_fit_follows_the_measured_curve_and_rises_with_data():
    for answers, tau in TAU_CURVE:
        assert abs(expected_tau(answers) - tau) < 0.1, (answers, tau, expected_tau(answers))
    assert expected_tau(32) == 1.0 < expected_tau(400) < expected_tau(2468) < expected_tau(10_000)
    assert answers_for(expected_tau(5000)) in range(4990, 5010)


def test_each_config_needs_the_answers_its_own_gate_min_tau_asks_for():
    tiny, smollm2 = load_config("configs/tiny.yaml"), load_config("configs/smollm2-135m.yaml")
    assert answers_needed(tiny) == answers_for(1.2) == 327        # gate.min_tau 1.2
    assert answers_needed(smollm2) == answers_for(2.0) > 5000       # the default 2.0: README's "~10k" order


def test_only_a_dataset_far_below_the_need_is_flagged_and_the_line_says_how_much_and_what_to_do():
    tiny = load_config("configs/tiny.yaml")
    assert size_warning(200, tiny, what="x") is None               # tiny's own 200 prompts: near enough
    line = size_warning(32, tiny, what="support-chats.jsonl")
    assert line.startswith("support-chats.jsonl: 32 answers, far below the ~327 that tiny's gate.min_tau 1.2")
    assert "expect τ ≈ 1.00" in line and "datagen.samples_per_prompt=11" in line and "\n" not in line
    assert "add prompts (about" in size_warning(3, tiny, what="x")   # 109 samples a prompt: ask for prompts
