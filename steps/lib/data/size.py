"""How many answers a config needs: the τ-against-data curve of benchmarks/README.md, as one function.

The curve (SmolLM2-135M-Instruct on one H200, the same code and schedule, `benchmarks/tau_curve.py`):
τ in distribution 1.307 at 400 answers, 1.319 at 672, 1.761 at 2,468 — it rises with the logarithm of the
number of answers and nothing else there changes. `answers_needed(cfg)` reads it backwards at the config's
own bar, `gate.min_tau`: fewer answers than that cannot be expected to reach it. It is an estimate from one
target, not a promise, so only a dataset *far* below it (`FAR_BELOW`) is flagged: at upload
(`eaglenest dataset upload`) and at datagen, before the target spends time answering it (F9: measure before
scaling, and do not scale the wrong thing — here, too little data is the cause, not the serving).
"""

from __future__ import annotations

import math

from steps.lib.config import PipelineConfig

#: (answers, τ in distribution) measured in benchmarks/README.md ("τ against data")
TAU_CURVE: tuple[tuple[int, float], ...] = ((400, 1.307), (672, 1.319), (2468, 1.761))
#: a dataset with fewer than this fraction of the answers its config needs is flagged
FAR_BELOW = 0.25
#: a fix asking for more answers per prompt than this is said as "more prompts" instead
MAX_SAMPLES = 16


def _fit() -> tuple[float, float]:
    """(a, b) of τ = a + b·ln(answers), least squares over TAU_CURVE."""
    xs = [math.log(n) for n, _ in TAU_CURVE]
    ys = [tau for _, tau in TAU_CURVE]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def expected_tau(answers: int) -> float:
    """τ the curve expects from `answers` answers (never below 1.0: the bonus token alone)."""
    a, b = _fit()
    return max(1.0, a + b * math.log(max(answers, 1)))


def answers_for(tau: float) -> int:
    """The answers the curve needs to reach `tau` (at least 1)."""
    a, b = _fit()
    return max(1, math.ceil(math.exp((tau - a) / b)))


def answers_needed(cfg: PipelineConfig) -> int:
    """The answers `cfg` needs for its drafter to reach its own bar, gate.min_tau."""
    return answers_for(cfg.gate.min_tau)


def answers_of(prompts: int, cfg: PipelineConfig) -> int:
    """The answers datagen writes for `prompts` prompts (each answered datagen.samples_per_prompt times)."""
    return prompts * cfg.datagen.samples_per_prompt


def size_warning(answers: int, cfg: PipelineConfig, *, what: str) -> str | None:
    """One line when `answers` is far below what `cfg` needs (None otherwise); `what` names the data."""
    needed = answers_needed(cfg)
    if answers >= FAR_BELOW * needed:
        return None
    times = math.ceil(needed / max(answers, 1))
    fix = (f"add prompts, or answer each {times} times (datagen.samples_per_prompt={times})" if times <= MAX_SAMPLES
           else f"add prompts (about {needed - answers} more answers)")
    return (f"{what}: {answers} answers, far below the ~{needed} that {cfg.name}'s gate.min_tau {cfg.gate.min_tau} "
            f"needs by the τ-against-data curve (benchmarks/README.md): expect τ ≈ {expected_tau(answers):.2f}, "
            f"a draft that learned too little — {fix}")
