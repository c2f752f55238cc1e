"""τ's bootstrap interval over prompts: seeded, holding τ, narrowing with more prompts; the paired interval of
two drafts' difference on the same prompts."""

from __future__ import annotations

import pytest

from steps.lib.metrics import AcceptStats, pooled_tau, rejected_tokens, tau_difference_interval, tau_interval

# per-prompt accept histograms (k = 3) of very different prompts: τ 1.0, 4.0, 2.5, 1.75
HISTOGRAMS = [[10, 0, 0, 0], [0, 0, 0, 5], [2, 2, 2, 2], [6, 0, 2, 0]]


def test_tau_interval_holds_the_pooled_tau_and_is_the_same_for_the_same_seed():
    lo, hi = tau_interval(HISTOGRAMS, seed=0)
    assert lo < pooled_tau(HISTOGRAMS) < hi and 1.0 <= lo and hi <= 4.0
    many = [[h[0] + i % 3, *h[1:]] for i, h in enumerate(HISTOGRAMS * 5)]    # 20 prompts: many distinct τ
    assert tau_interval(many, seed=0) == tau_interval(many, seed=0)
    assert tau_interval(many, seed=1) != tau_interval(many, seed=0)            # the seed is used


def test_tau_interval_narrows_with_more_prompts_and_is_a_point_for_identical_prompts():
    lo, hi = tau_interval(HISTOGRAMS, seed=0)
    lo10, hi10 = tau_interval(HISTOGRAMS * 10, seed=0)
    assert hi10 - lo10 < hi - lo
    assert tau_interval([[1, 2, 3, 4]] * 5, seed=0) == [AcceptStats(3, [1, 2, 3, 4]).tau] * 2
    assert tau_interval([], seed=0) == [0.0, 0.0]


def test_the_paired_difference_separates_two_drafts_whose_own_intervals_overlap():
    """Prompts far apart in difficulty, one draft a little better on each: each τ's interval is wide (the prompts
    differ) and they overlap, while the paired interval, the same prompts picked for both, is above zero."""
    many = [[h[0] + i % 3, *h[1:]] for i, h in enumerate(HISTOGRAMS * 5)]
    better = [[h[0] - 1, h[1] + 1, *h[2:]] if h[0] > 0 else h for h in many]   # one first draft more accepted
    lo_a, hi_a = tau_interval(better, seed=0)
    lo_b, hi_b = tau_interval(many, seed=0)
    assert lo_a < hi_b                                                  # apart, the intervals overlap
    lo, hi = tau_difference_interval(better, many, seed=0)
    assert 0 < lo <= pooled_tau(better) - pooled_tau(many) <= hi
    assert tau_difference_interval(many, better, seed=0) == pytest.approx([-hi, -lo])   # the sign is the order
    assert tau_difference_interval(many, many, seed=0) == [0.0, 0.0]
    with pytest.raises(ValueError, match="same prompts"):
        tau_difference_interval(many, many[:-1], seed=0)


def test_rejected_tokens_walks_the_verify_steps_through_the_output():
    """k = 3. Token 10 comes from the prefill; step 1 accepts 11 and the target's 12 replaces its second draft;
    step 2 accepts nothing (13 replaces the first draft); step 3 accepts 14, 15, 16 and adds the bonus 17 (no
    rejection); step 4 accepts 18, and its own token falls past the output's end (cut at max_new_tokens)."""
    tokens = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    assert rejected_tokens(tokens, [1, 0, 3, 1], 3) == [12, 13]
    assert rejected_tokens(tokens, [1, 0, 3, 1], 4) == [12, 13, 17]      # at k = 4, three accepted is a rejection
    assert rejected_tokens(tokens[:1], [], 3) == []


def test_accept_stats_keep_the_order_of_their_verify_steps():
    a, b = AcceptStats(3), AcceptStats(3)
    for n in (2, 0, 3):
        a.add(n)
    b.add(1)
    assert a.rounds == [2, 0, 3] and a.histogram == [1, 0, 1, 1]
    a.merge(b)
    assert a.rounds == [2, 0, 3, 1] and a.verify_steps == 4
    assert AcceptStats(3, [1, 0, 1, 1]) == AcceptStats(3, [1, 0, 1, 1], rounds=[0, 2, 3])   # counts decide equality


def test_pooled_tau_counts_every_prompts_steps_together():
    # prompt 1: one step accepting 0, one accepting 2; prompt 2: two steps accepting 1 -> (0+2+1+1 + 4) / 4
    assert pooled_tau([[1, 0, 1], [0, 2, 0]]) == pytest.approx(8 / 4)
    assert pooled_tau([[3, 0, 0]]) == 1.0 and pooled_tau([]) == 0.0
