"""Prompts the target writes itself (Magpie, arXiv 2406.08464): its own chat template up to a user turn,
sampled.

The offline sources do not cover a chat benchmark (issue 23: τ 2.81 on held-out prompts like the training
data, 1.72 on MT-bench). A chat model's template rendered through the header of a user turn, with nothing
after it, makes the model write what a user would ask; answering that is what it was tuned for. Prompts
written this way reach 80-93% of the acceptance that real user queries give (arXiv 2503.07807).

- `write_prompts`: `count` first user turns. Each candidate starts from a system prompt drawn from
  `dataset.synthetic.system_prompts` (null: the template's own default, e.g. SmolLM2's), and a fraction
  (`topic_hints`) is written under a hint naming one of MT-bench's eight categories and a seed topic
  (steps/lib/data/topics.py) so the mix spans them; the conversation keeps the plain system prompt.
- `write_user_turns`: the next user turn of conversations that have the target's first answer
  (datagen's second turns), written the same way.
Every written turn is filtered (`verdict`: empty, too long = unfinished at `max_tokens`, not a request),
decontaminated against every reported benchmark (steps/lib/data/decontaminate.py); first turns are also
deduplicated, exactly and nearly (steps/lib/data/dedup.py). Candidates are written in rounds, each
round stored through a `stage` callback (datagen keeps them in the dataset artifact, so a killed run
resumes from its rounds); the verdicts are replayed over the stored rounds in order, so the same seed
gives the same prompts whether the run was interrupted or not. Sampling goes through a `generate`
callback (datagen's decoder): this module never loads or runs a model itself.
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Callable
from typing import Any

from steps.lib.config import SyntheticConfig
from steps.lib.data.chat import user_turn_prefix
from steps.lib.data.decontaminate import NgramIndex
from steps.lib.data.dedup import Deduper
from steps.lib.data.topics import CATEGORIES

#: generate(prefix texts, temperature, max_tokens, seed) -> [(text, finished)], one per prefix, in order.
Generate = Callable[[list[str], float, int, int], list[tuple[str, bool]]]
#: stage(round, make) -> the round's candidates: stored ones when an earlier run wrote them, else make().
Stage = Callable[[int, Callable[[], list[dict[str, Any]]]], list[dict[str, Any]]]

#: why a written turn is dropped, in the order the checks run; the dataset manifest counts each.
REASONS = ("empty", "too_long", "not_request", "contaminated", "exact_duplicate", "near_duplicate")
#: fewer words than this is no request ("Hi.", a lone word).
MIN_WORDS = 3
#: openings of an assistant's reply, not a user's request: the model answered instead of asking.
ANSWER_OPENINGS = ("sure", "certainly", "of course", "absolutely", "as an ai", "i'm sorry", "i am sorry",
                   "here is", "here's", "hello! how can i", "hi! how can i", "how can i assist", "how can i help")
#: words a request begins with (imperatives and question words) ...
REQUEST_WORDS = frozenset(
    "write explain describe list give create summarize summarise compose translate help tell suggest provide "
    "generate design draft find calculate compute solve compare imagine pretend act rewrite edit analyze "
    "analyse evaluate identify classify extract convert implement develop plan outline recommend name show "
    "what why how who whom whose which when where is are can could would should will do does did please "
    "make build define discuss prove estimate craft given suppose consider assume if let".split())
#: ... or phrases it holds.
REQUEST_PHRASES = ("can you", "could you", "would you", "please", "help me", "i need", "i want", "i'd like",
                   "i would like", "i'm looking for", "i am looking for", "i'm trying", "tell me", "let me know",
                   "what is", "what are", "how do", "how can", "how to")
#: the hint a first turn may be written under, per MT-bench category; topics from steps/lib/data/topics.py.
CATEGORY_HINTS = {"writing": "a writing task", "roleplay": "a role-play", "reasoning": "a reasoning problem",
                  "math": "a math problem", "coding": "a programming task", "extraction": "extracting information "
                  "from a text", "stem": "a science or technology question", "humanities": "a question on "
                  "history, philosophy or the arts"}
MATH_TOPICS = ("percentages", "probability", "geometry", "algebra", "a word problem about money",
               "sequences and series", "prime numbers", "unit conversion", "a system of equations")
#: the system prompt a hint is added to when the conversation's is the template's default.
HINT_BASE = "You are a helpful assistant."
WORD_RE = re.compile(r"[\w']+")


def verdict(text: str, finished: bool, index: NgramIndex) -> str | None:
    """Why a written user turn is dropped (one of `REASONS`' filters), or None to keep it."""
    if not text.strip():
        return "empty"
    if not finished:
        return "too_long"
    if not is_request(text):
        return "not_request"
    if index.match(text) is not None:
        return "contaminated"
    return None


def is_request(text: str) -> bool:
    """A user's request: a question, an imperative, or a phrase asking for help, and not an assistant's reply."""
    low = " ".join(text.lower().split())
    w = WORD_RE.findall(low)
    if len(w) < MIN_WORDS or low.startswith(ANSWER_OPENINGS):
        return False
    return "?" in low or w[0] in REQUEST_WORDS or any(p in low for p in REQUEST_PHRASES)


def hint(rng: random.Random) -> tuple[str, str]:
    """(category, hint sentence): one of MT-bench's categories and a seed topic of it."""
    category = rng.choice(sorted(CATEGORY_HINTS))
    topics = CATEGORIES[category][1] if category in CATEGORIES else MATH_TOPICS
    topic = rng.choice(topics)
    return category, f"The user is about to ask you for help with {CATEGORY_HINTS[category]} about {topic}."


def _messages(system: str | None) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}] if system else []


def _plan(syn: SyntheticConfig, n: int, seed: int, start: int) -> list[dict[str, Any]]:
    """The candidates of one round before writing: id, system prompt and optional hint (seeded)."""
    out = []
    for k in range(start, start + n):
        rng = random.Random(f"{seed}:{k}")
        system = rng.choice(syn.system_prompts)
        category, sentence = hint(rng) if rng.random() < syn.topic_hints else (None, None)
        writer_system = f"{system or HINT_BASE} {sentence}" if sentence else system
        out.append({"id": f"synthetic-{k}", "system": system, "category": category, "writer_system": writer_system})
    return out


def _write_round(tokenizer: Any, generate: Generate, syn: SyntheticConfig, n: int, seed: int,
                 start: int) -> list[dict[str, Any]]:
    plan = _plan(syn, n, seed, start)
    prefixes = [user_turn_prefix(tokenizer, _messages(c["writer_system"])) for c in plan]
    written = generate(prefixes, syn.temperature, syn.max_tokens, seed * 1_000_003 + start)
    return [{**c, "text": text.strip(), "finished": finished}
            for c, (text, finished) in zip(plan, written, strict=True)]


def write_prompts(count: int, tokenizer: Any, generate: Generate, syn: SyntheticConfig, index: NgramIndex, *,
                  seed: int, round_size: int, stage: Stage) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """`count` first user turns written by the target (fewer if `max_attempts` × count candidates did not
    give as many); (prompts `{"id", "source": "synthetic", "messages"}`, counts: `written`, each reason, and
    `unused`: written in a round after `count` were kept). Round r is `stage(r, ...)`; its size and the ids
    of its candidates follow from the rounds before it, so a resumed run asks for the same rounds."""
    counts = dict.fromkeys(("written", *REASONS, "unused"), 0)
    dedup, kept = Deduper(syn.near_duplicate), []
    for r in itertools.count():
        budget = count * syn.max_attempts - counts["written"]
        if len(kept) >= count or budget <= 0:
            break
        # a round writes what is still missing and a quarter more (most candidates pass), at most a chunk
        n, start = min(round_size, budget, -(-(count - len(kept)) * 5 // 4)), counts["written"]
        for c in stage(r, lambda n=n, start=start: _write_round(tokenizer, generate, syn, n, seed, start)):
            counts["written"] += 1
            why = "unused" if len(kept) >= count else (verdict(c["text"], c["finished"], index)
                                                       or dedup.verdict(c["text"]))
            if why is not None:
                counts[why] += 1
            else:
                kept.append({"id": c["id"], "source": "synthetic",
                             "messages": _messages(c["system"]) + [{"role": "user", "content": c["text"]}]})
    return kept, counts


def write_user_turns(conversations: list[list[dict[str, str]]], tokenizer: Any, generate: Generate,
                     syn: SyntheticConfig, index: NgramIndex, *, seed: int,
                     ) -> tuple[list[str | None], dict[str, int]]:
    """The next user turn of each conversation (None where it was dropped), and the counts of why."""
    prefixes = [user_turn_prefix(tokenizer, c) for c in conversations]
    written = generate(prefixes, syn.temperature, syn.max_tokens, seed) if prefixes else []
    counts = dict.fromkeys(("written", *REASONS[:4]), 0)
    out: list[str | None] = []
    for text, finished in written:
        counts["written"] += 1
        why = verdict(text.strip(), finished, index)
        if why is not None:
            counts[why] += 1
        out.append(None if why else text.strip())
    return out, counts
