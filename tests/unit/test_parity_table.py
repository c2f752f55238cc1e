"""benchmarks/quality_parity.py's table: each trainer's τ with its interval at the served k and at every chain
length both were measured at (as verify reports 3/1/4 and 7/1/8), so the two rows compare like for like."""

from __future__ import annotations

from benchmarks.quality_parity import table


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
