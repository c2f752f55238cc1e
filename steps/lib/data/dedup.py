"""Duplicate prompts removed, exactly and nearly: the same question asked twice is trained on twice.

A target sampled from its own chat template (steps/lib/data/synthetic.py) repeats itself: the same
opening, the same question with one word changed. `Deduper` keeps the first of each:
- exact: equal after normalisation (lowercased words, punctuation and whitespace ignored);
- near: word-shingle Jaccard similarity ≥ `threshold` with a kept text, found through MinHash
  signatures banded into LSH buckets (only texts sharing a bucket are compared, exactly), so a
  million prompts cost a million signatures, not a trillion comparisons.
Deterministic: shingles are hashed with blake2b (not Python's salted `hash`), the permutations drawn
from a fixed seed; the verdict of each text depends only on the texts before it.
"""

from __future__ import annotations

import hashlib

import numpy as np

from steps.lib.data.decontaminate import words

#: words per shingle; a text with fewer words is one shingle.
SHINGLE_WORDS = 3
#: MinHash permutations = BANDS × ROWS; at a Jaccard of 0.7 a pair shares a band with p ≈ 0.98.
BANDS, ROWS = 16, 4
#: a Mersenne prime above every 32-bit shingle hash: (a·x + b) mod P stays below 2^62 in uint64.
PRIME = (1 << 61) - 1
PERMUTATION_SEED = 20260301


def shingles(text: str) -> set[int]:
    """The text's word 3-shingles as 32-bit hashes (stable across processes)."""
    w = words(text)
    grams = [w[i:i + SHINGLE_WORDS] for i in range(max(1, len(w) - SHINGLE_WORDS + 1))]
    return {int.from_bytes(hashlib.blake2b(" ".join(g).encode(), digest_size=4).digest(), "little")
            for g in grams}


def jaccard(a: set[int], b: set[int]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


class Deduper:
    """Feed texts in order with `verdict`: None keeps a text, `exact_duplicate` / `near_duplicate` drops it."""

    def __init__(self, threshold: float = 0.7):
        self.threshold = threshold
        rng = np.random.default_rng(PERMUTATION_SEED)
        self.a = rng.integers(1, 1 << 31, BANDS * ROWS, dtype=np.uint64)
        self.b = rng.integers(0, 1 << 31, BANDS * ROWS, dtype=np.uint64)
        self.exact: set[tuple[str, ...]] = set()
        self.kept: list[set[int]] = []
        self.buckets: dict[tuple[int, bytes], list[int]] = {}

    def signature(self, sh: set[int]) -> np.ndarray:
        x = np.fromiter(sorted(sh), dtype=np.uint64)
        return ((self.a[:, None] * x[None, :] + self.b[:, None]) % np.uint64(PRIME)).min(axis=1)

    def verdict(self, text: str) -> str | None:
        norm = words(text)
        if norm in self.exact:
            return "exact_duplicate"
        sh = shingles(text)
        sig = self.signature(sh)
        keys = [(band, sig[band * ROWS:(band + 1) * ROWS].tobytes()) for band in range(BANDS)]
        seen: set[int] = set()
        for key in keys:
            for j in self.buckets.get(key, ()):
                if j not in seen and (seen.add(j) or jaccard(sh, self.kept[j]) >= self.threshold):
                    return "near_duplicate"
        self.exact.add(norm)
        for key in keys:
            self.buckets.setdefault(key, []).append(len(self.kept))
        self.kept.append(sh)
        return None


def dedup(texts: list[str], threshold: float = 0.7) -> tuple[list[int], dict[str, int]]:
    """(indices of the texts kept, in order; {"exact_duplicate": n, "near_duplicate": m} dropped)."""
    d, keep, dropped = Deduper(threshold), [], {"exact_duplicate": 0, "near_duplicate": 0}
    for i, text in enumerate(texts):
        v = d.verdict(text)
        if v is None:
            keep.append(i)
        else:
            dropped[v] += 1
    return keep, dropped
