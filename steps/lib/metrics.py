"""Acceptance metrics from raw counts: the one place τ is computed (verify, benchmark, gate).

τ (acceptance length) counts the bonus token: each verify step yields its accepted drafts plus one
token from the target, so τ = Σ(accepted + 1) / Σ verify steps. τ = 1 means no speedup; chain
drafting with k steps has τ ≤ k + 1. Every metric dict stores it under the key `tau` (verify, benchmark,
serve's smoke test, gate); only the demo's summary.json spells it `acceptance_length`, for readers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class AcceptStats:
    """Accept counts: `histogram[j]` = verify steps that accepted exactly j drafts; `rounds`, where an engine
    decoded here counted them (`add`), each verify step's count in decoding order (a served engine reports only
    totals), which places every rejection in the output (`rejected_tokens`)."""
    num_steps: int
    histogram: list[int] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.histogram:
            self.histogram = [0] * (self.num_steps + 1)

    def add(self, accepted: int) -> None:
        self.histogram[accepted] += 1
        self.rounds.append(accepted)

    def merge(self, other: AcceptStats) -> None:
        for j, c in enumerate(other.histogram):
            self.histogram[j] += c
        self.rounds += other.rounds

    @property
    def verify_steps(self) -> int:
        return sum(self.histogram)

    @property
    def accepted_drafts(self) -> int:
        return sum(j * c for j, c in enumerate(self.histogram))

    @property
    def tau(self) -> float:
        return acceptance_length(self.accepted_drafts, self.verify_steps)

    @property
    def per_position(self) -> list[float]:
        """P(draft position i accepted), i = 0..k-1: verify steps with more than i accepted / all."""
        n = self.verify_steps
        return [sum(self.histogram[i + 1:]) / n if n else 0.0 for i in range(self.num_steps)]

    def to_dict(self) -> dict:
        return {"tau": self.tau, "per_position_acceptance": self.per_position,
                "verify_steps": self.verify_steps, "accepted_drafts": self.accepted_drafts,
                "accept_histogram": list(self.histogram), "num_steps": self.num_steps}


def rejected_tokens(tokens: list[int], rounds: list[int], num_steps: int) -> list[int]:
    """The target's token at each rejected draft of one greedy speculative output: the first new token comes
    from the prefill, then each verify step emits its accepted drafts and the target's own next token, which
    replaces a rejected draft where fewer than `num_steps` were accepted. A token the draft vocab lacks at such a
    position is a rejection no training could have avoided."""
    out, pos = [], 1
    for accepted in rounds:
        at = pos + accepted
        if accepted < num_steps and at < len(tokens):
            out.append(tokens[at])
        pos = at + 1
    return out


def accepted_prefix(match: Tensor) -> Tensor:
    """Greedy chain verification: drafts accepted in a round = the leading run of matches, so a draft
    counts only while every draft before it was accepted. match: bool [..., k] (draft j == the
    target's token there) -> int64 [...]. The engine's verify and training's τ_sim both count with it."""
    return match.long().cumprod(-1).sum(-1)


def acceptance_length(accepted_drafts: int, verify_steps: int) -> float:
    """τ = (accepted drafts + one bonus token per verify step) / verify steps."""
    return (accepted_drafts + verify_steps) / verify_steps if verify_steps else 0.0


def acceptance_length_from_requests(requests: list[dict]) -> float:
    """τ over finished requests from SGLang meta_info: Σ(correct + verify_ct) / Σ verify_ct."""
    correct = sum(int(r["spec_num_correct_drafts"]) for r in requests)
    verify = sum(int(r["spec_verify_ct"]) for r in requests)
    return acceptance_length(correct, verify)


def pooled_tau(histograms: list[list[int]]) -> float:
    """τ of several prompts' accept histograms pooled (as `AcceptStats.merge` pools them); 0 for none."""
    if not histograms:
        return 0.0
    total = AcceptStats(len(histograms[0]) - 1)
    for h in histograms:
        total.merge(AcceptStats(len(h) - 1, list(h)))
    return total.tau


def _resampled_taus(histograms: list[list[int]], pick: Tensor) -> Tensor:
    """τ of each resampling `pick` [samples, P] of the prompts' histograms, from its pooled counts."""
    counts = torch.tensor(histograms, dtype=torch.float64)                    # [P, k + 1]
    accepted = counts @ torch.arange(counts.shape[1], dtype=torch.float64)    # [P]
    steps = counts.sum(-1)
    a, s = accepted[pick].sum(-1), steps[pick].sum(-1)
    return torch.where(s > 0, (a + s) / s.clamp(min=1), torch.zeros_like(s))


def _bootstrap(prompts: int, statistic: Callable[[Tensor], Tensor], *, seed: int, samples: int,
               level: float) -> list[float]:
    """The `level` percentile interval of `statistic(pick)` over `samples` resamplings (`pick`: [samples, prompts]
    indices drawn with replacement) of the prompts."""
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(0, prompts, (samples, prompts), generator=g)
    values = statistic(pick)
    lo, hi = torch.quantile(values, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)).tolist()
    return [lo, hi]


def tau_interval(histograms: list[list[int]], *, seed: int, samples: int = 1000, level: float = 0.95
                 ) -> list[float]:
    """A `level` bootstrap interval of τ over prompts: `samples` resamplings of the prompts with replacement,
    τ of each from its pooled counts (as `AcceptStats.tau` pools them), the percentiles. `histograms`: one
    accept histogram per prompt. Seeded: the same counts and seed give the same interval. Prompts, not
    rounds, are resampled because rounds of one prompt are correlated (one prompt moves τ by ~0.03)."""
    if not histograms:
        return [0.0, 0.0]
    return _bootstrap(len(histograms), lambda pick: _resampled_taus(histograms, pick), seed=seed, samples=samples,
                      level=level)


def tau_difference_interval(ours: list[list[int]], theirs: list[list[int]], *, seed: int, samples: int = 1000,
                            level: float = 0.95) -> list[float]:
    """A paired `level` bootstrap interval of τ(ours) − τ(theirs): `ours[i]` and `theirs[i]` are two drafts'
    accept histograms on the same prompt i, and every resampling picks the same prompts for both, so what a
    prompt does to both (an easy answer, a long one) cancels; two intervals taken apart keep it and overlap
    where the paired one need not."""
    if len(ours) != len(theirs):
        raise ValueError(f"paired τ: {len(ours)} prompts against {len(theirs)}; both drafts must be measured on "
                         "the same prompts")
    if not ours:
        return [0.0, 0.0]
    return _bootstrap(len(ours), lambda pick: _resampled_taus(ours, pick) - _resampled_taus(theirs, pick),
                      seed=seed, samples=samples, level=level)
