"""`make demo`'s summary (flows/demo.py): τ with its 95% interval over prompts, as verify measured it."""

from __future__ import annotations

from flows.demo import print_summary, tau_summary

VERIFY = {"tau": 1.234, "tau_interval": [1.111, 1.357], "tau_in_distribution": 1.5,
          "tau_interval_in_distribution": [1.4, 1.6], "per_position_acceptance": [0.2, 0.03],
          "num_steps": 2, "speedup": 0.5, "draft_vocab_coverage": 0.9731,
          "rejections_outside_draft_vocab": 0.0412,
          "tau_by_category": {"roleplay": {"tau": 1.1, "prompts": 2}, "writing": {"tau": 1.3, "prompts": 3}}}


def test_the_summary_carries_and_prints_each_tau_with_its_interval(capsys):
    s = tau_summary(VERIFY, {**VERIFY, "tau": 1.0})
    assert s["acceptance_length_interval"] == [1.111, 1.357]
    assert s["acceptance_length_in_distribution_interval"] == [1.4, 1.6]
    print_summary({**s, "target": "tiny", "steps": {}, "export_dirs": {}})
    out = capsys.readouterr().out
    assert "held-out MT-bench): 1.234 (95% interval 1.111–1.357 over prompts)   untrained draft: 1.00" in out, out
    assert "training sources: 1.50 (95% interval 1.400–1.600 over prompts)" in out, out
    assert "the draft's vocab holds 97.3% of the target's MT-bench answer tokens" in out, out
    assert "4.1% of the rejected drafts were tokens outside the draft's vocab" in out, out
    assert "MT-bench categories measured: roleplay 1.10, writing 1.30" in out, out
