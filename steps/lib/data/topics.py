"""Offline prompt sources built from seeds: `topics` (questions across MT-bench-like categories) and
`pydoc` (the Python language reference's topics, shipped with CPython as `pydoc_data.topics`).

The builtin packaged sources (steps/lib/data/prompts.py) are narrow: stdlib docstrings, 52 ShareGPT turns and
HumanEval are mostly "explain this API" and "write this function". A draft trained on them alone
predicts that register and little else (benchmarks/README.md: τ 1.40 in distribution, 1.08 on
MT-bench). These sources widen it without a download: seed topics × question templates for each of
MT-bench's eight categories (writing, roleplay, reasoning, math, coding, extraction, stem, humanities),
arithmetic word problems from a seeded generator, and excerpts of the language reference to summarise
or explain. They are never MT-bench's own questions (those stay held out; `load_prompts` also drops
any exact match). Deterministic: the same code gives the same prompts in the same order.
"""

from __future__ import annotations

import random
from typing import Any

#: per category: (templates with one {t} slot, seed topics). Templates are phrased like user requests.
CATEGORIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "writing": (
        ("Write a short blog post about {t}.", "Write a persuasive paragraph on {t}.",
         "Compose a haiku and a limerick about {t}.", "Draft a friendly email inviting a colleague to a talk on {t}.",
         "Write a product description for a gadget related to {t}.", "Write the opening of a short story about {t}."),
        ("a rainy morning in a city", "learning a second language", "remote work", "a trip to the mountains",
         "urban gardening", "the first day at a new job", "saving money", "a forgotten library", "electric bicycles",
         "a family recipe", "volunteering", "a lighthouse keeper", "minimalism", "a chess tournament",
         "public transport", "a night market", "recycling at home", "a robot that learns to paint",
         "morning routines", "a small bakery", "board games", "climate change", "a museum visit", "sleep"),
    ),
    "roleplay": (
        ("Pretend you are {t}. Introduce yourself and describe your typical day.",
         "Act as {t} and give advice to a beginner.", "You are {t}. Answer a customer who is unhappy.",
         "Imagine you are {t}. What would you say in a short speech to students?"),
        ("a medieval blacksmith", "a ship's captain", "a travel guide in Rome", "a personal fitness coach",
         "a detective in the 1920s", "a museum curator", "a chef in a busy kitchen", "an astronaut on the Moon",
         "a librarian", "a wise old gardener", "a startup founder", "a kindergarten teacher", "a tour guide in Kyoto",
         "a park ranger", "a bookshop owner", "a jazz musician", "a veterinarian", "a mountain guide"),
    ),
    "reasoning": (
        ("Explain step by step how to decide {t}.",
         "What are the pros and cons of {t}? Conclude with a recommendation.",
         "A friend claims {t} is always a good idea. Is the argument sound? Reason carefully.",
         "List the assumptions hidden in the question of {t}."),
        ("buying or renting a home", "taking a gap year", "learning to code at forty", "moving to a new city",
         "working four days a week", "banning cars from city centres", "homework for young children",
         "paying for a premium software subscription", "switching careers", "owning a dog in an apartment",
         "studying abroad", "using only public transport", "self-driving taxis", "a universal basic income"),
    ),
    "coding": (
        ("Write a Python function that {t}. Include a docstring and an example.",
         "How would you test a function that {t}? Give a few unit tests.",
         "Explain, with code, an efficient way to write a program that {t}."),
        ("reverses the words in a sentence", "checks whether a string is a palindrome", "merges two sorted lists",
         "counts word frequencies in a text file", "finds the longest common prefix of strings",
         "parses a CSV line with quoted fields", "computes the n-th Fibonacci number", "flattens a nested list",
         "removes duplicates while keeping order", "validates an email address", "rotates a matrix by 90 degrees",
         "converts Roman numerals to integers", "finds the median of a stream of numbers",
         "groups anagrams together", "implements a least-recently-used cache", "runs a binary search",
         "detects a cycle in a linked list", "formats a number with thousands separators"),
    ),
    "extraction": (
        ("Extract every date and amount from this text and return them as JSON: \"{t}\"",
         "Summarise the following in one sentence: \"{t}\"", "List the people and places mentioned here: \"{t}\""),
        ("On 3 March 2021 Maria paid 450 euros for a train ticket from Lisbon to Madrid.",
         "The meeting in Toronto on June 5 was attended by Li Wei and Ahmed, who approved a budget of $12,000.",
         "In 1998 the company moved from Boston to Austin; by 2005 revenue reached 3.2 million dollars.",
         "Tom booked a room in Oslo for 2 nights at 1,100 kroner each, arriving on 14 August.",
         "Dr. Patel's lecture in Mumbai on 9 January covered vaccines; tickets cost 200 rupees.",
         "Our shop in Berlin sold 340 umbrellas in October and 125 in November at 15 euros each."),
    ),
    "stem": (
        ("Explain {t} to a high-school student.", "What is {t}, and why does it matter in everyday life?",
         "Give three surprising facts about {t}.", "Describe a simple experiment that demonstrates {t}."),
        ("photosynthesis", "how vaccines work", "black holes", "the water cycle", "plate tectonics", "DNA replication",
         "electric circuits", "the greenhouse effect", "how a refrigerator works", "entropy", "natural selection",
         "the speed of light", "how batteries store energy", "antibiotic resistance", "machine learning",
         "prime numbers", "how GPS works", "the immune system", "ocean tides", "nuclear fusion"),
    ),
    "humanities": (
        ("Give an overview of {t} and its lasting influence.", "What were the main causes and effects of {t}?",
         "Compare two different viewpoints on {t}.", "Why do historians still study {t}?"),
        ("the Renaissance", "the Industrial Revolution", "the printing press", "the Silk Road", "ancient Athens",
         "the French Revolution", "the invention of writing", "the Roman Empire's roads", "impressionist painting",
         "the history of jazz", "the Enlightenment", "the fall of the Berlin Wall", "utilitarian ethics",
         "the Meiji Restoration", "the history of the Olympic Games", "Stoic philosophy"),
    ),
}

#: arithmetic word problems (the math category); numbers come from a seeded generator.
MATH_TEMPLATES = (
    "A shop sells pencils at {a} cents each. How much do {b} pencils cost in dollars? Show your work.",
    "A train travels {a} km in {b} hours. What is its average speed? Explain each step.",
    "Solve for x: {a}x + {b} = {c}. Show the steps.",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "What is {a}% of {c}? Explain how you computed it.",
    "If you save {a} dollars a week, how many weeks until you have {c} dollars?",
)
MATH_PROBLEMS = 240


def _prompt(pid: str, source: str, user: str) -> dict[str, Any]:
    return {"id": pid, "source": source, "messages": [{"role": "user", "content": user}]}


def load_topics() -> list[dict[str, Any]]:
    """Seed topics × templates across MT-bench-like categories, plus arithmetic word problems (deduplicated)."""
    out, seen = [], set()
    for cat, (templates, topics) in CATEGORIES.items():
        for ti, topic in enumerate(topics):
            for ki, template in enumerate(templates):
                text = template.format(t=topic)
                if text not in seen:
                    seen.add(text)
                    out.append(_prompt(f"topics-{cat}-{ti}-{ki}", "topics", text))
    rng = random.Random(1234)           # fixed: the prompts are data, not a function of the run's seed
    while sum(p["id"].startswith("topics-math-") for p in out) < MATH_PROBLEMS:
        k = rng.randrange(len(MATH_TEMPLATES))
        text = MATH_TEMPLATES[k].format(a=rng.randint(2, 99), b=rng.randint(2, 40), c=rng.randint(100, 999))
        if text not in seen:
            seen.add(text)
            out.append(_prompt(f"topics-math-{len(seen)}", "topics", text))
    return out


#: characters of a language-reference section quoted in a summarise request.
PYDOC_EXCERPT_CHARS = 700


def load_pydoc() -> list[dict[str, Any]]:
    """The language reference's topics (`pydoc_data.topics`, part of CPython): explain each, and
    summarise the opening of its text."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        text = " ".join(topics[name].split())[:PYDOC_EXCERPT_CHARS]
        out.append(_prompt(f"pydoc-{name}-explain", "pydoc",
                           f"Explain the Python language topic '{name}' with a short example."))
        out.append(_prompt(f"pydoc-{name}-summary", "pydoc",
                           f"Summarise this excerpt of the Python reference in plain words:\n\n{text}"))
    return out


__all__ = ["load_topics", "load_pydoc", "CATEGORIES"]
