"""benchmarks/quality_parity.py's table: each trainer's τ with its interval at the served k and at every chain
length both were measured at (as verify reports 3/1/4 and 7/1/8), so the two rows compare like for like; and the
difference of the two on the same prompts, paired, with its own interval."""

from __future__ import annotations

import pytest

from benchmarks.quality_parity import ParityError, paired_difference, table


def _row(tau: float, by_k: dict[str, float] | None) -> dict:
    row = {"tau": tau, "tau_interval": [tau - 0.1, tau + 0.1], "per_position_acceptance": [0.5, 0.3, 0.2, 0.1],
           "train_s": 12.5, "tokens_trained": 1000, "steps": 4, "train_acc": [0.6, 0.4]}
    if by_k is not None:
        row["by_chain_length"] = {k: {"tau": t, "tau_interval": [t - 0.05, t + 0.05]} for k, t in by_k.items()}
    return row


def test_every_chain_length_both_were_measured_at_gets_a_column_with_its_interval():
    md = table({"rows": {"eaglenest": _row(2.6, {"3": 2.4, "4": 2.6, "7": 2.9}),
                         "speculators 0.9.0": _row(2.2, {"3": 2.1, "4": 2.2, "7": 2.3})}})
    head, rule, ours, theirs = md.strip().splitlines()
    assert "τ 3/1/4" in head and "τ 7/1/8" in head and "τ 4/1/5" in head
    assert head.count("|") == rule.count("|") == ours.count("|") == theirs.count("|")
    assert "| eaglenest | 2.600 [2.500, 2.700] | 2.400 [2.350, 2.450] |" in ours
    assert "2.900 [2.850, 2.950]" in ours and "2.300 [2.250, 2.350]" in theirs


def test_a_measurement_at_the_served_k_only_has_no_chain_length_columns():
    md = table({"rows": {"eaglenest": _row(1.5, None), "speculators 0.9.0": _row(1.4, {"3": 1.3})}})
    head, rule, *_ = md.strip().splitlines()
    assert "/1/" not in head                     # only lengths both rows have
    assert head.count("|") == rule.count("|")
    assert "| speculators 0.9.0 | 1.400 [1.300, 1.500] |" in md


def _prompt_rows(histograms: list[list[int]], k: int) -> list[dict]:
    """verify's rows: one a prompt and turn at chain length k (what `measure_mtbench` returns)."""
    return [{"id": f"q{i // 2}", "turn": 1 + i % 2, "num_steps": k, "accept_histogram": h}
            for i, h in enumerate(histograms)]


def test_the_difference_pairs_the_drafts_prompt_by_prompt_at_each_chain_length():
    easy_and_hard = [[0, 0, 0, 9], [9, 0, 0, 0], [1, 2, 3, 3], [6, 2, 1, 0]] * 10        # 20 questions × 2 turns
    better = [[h[0] - 1, h[1] + 1, *h[2:]] if h[0] else [h[0], h[1], h[2] - 1, h[3] + 1] for h in easy_and_hard]
    ours = _prompt_rows(better, 3) + _prompt_rows([h[:2] for h in better], 1)
    theirs = list(reversed(_prompt_rows(easy_and_hard, 3))) + _prompt_rows([h[:2] for h in easy_and_hard], 1)
    diff = paired_difference(ours, theirs, seed=0, samples=500)     # the rows' order does not matter, the ids do
    assert set(diff) == {"1", "3"} and diff["3"]["prompts"] == 40
    assert diff["3"]["tau"] == pytest.approx(40 / sum(map(sum, easy_and_hard)))   # one more accepted a prompt
    lo, hi = diff["3"]["interval"]
    assert 0 < lo <= diff["3"]["tau"] <= hi                       # better on every prompt: above zero, paired
    md = table({"rows": {"eaglenest": _row(1.5, {"3": 1.5}), "speculators 0.9.0": _row(1.4, {"3": 1.4})},
                "difference": diff})
    assert f"paired over the same 40 prompts: 1/1/2 {diff['1']['tau']:+.3f}" in md
    assert f"3/1/4 {diff['3']['tau']:+.3f} [{lo:+.3f}, {hi:+.3f}]" in md


def test_drafts_measured_on_different_prompts_have_no_paired_difference():
    rows = _prompt_rows([[1, 1, 1, 1]] * 4, 3)
    with pytest.raises(ParityError, match="different prompts"):
        paired_difference(rows, rows[:-1], seed=0, samples=100)
