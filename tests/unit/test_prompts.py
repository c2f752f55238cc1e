"""Prompt sources: builtin counts, dedupe, the held-out MT-bench set, and user-file errors."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from steps.lib.config import DatasetConfig, PromptSource  # noqa: E402
from steps.lib.data import prompts as P  # noqa: E402


def _user(p: dict) -> str:
    return p["messages"][-1]["content"]


def test_sharegpt_is_deduplicated_by_first_turn():
    rows = P.load_sharegpt()
    firsts = [_user(r) for r in rows]
    assert 40 <= len(rows) <= 60  # 500 records, ~52 distinct first turns
    assert len(set(firsts)) == len(firsts)
    assert all(r["messages"][-1]["role"] == "user" and r["source"] == "sharegpt" for r in rows)


def test_mtbench_has_80_questions_and_filters_categories():
    rows = P.load_mtbench()
    assert len(rows) == 80 and len({r["id"] for r in rows}) == 80
    coding = P.load_mtbench(categories=["coding"])
    assert len(coding) == 10 and {r["category"] for r in coding} == {"coding"}
    assert len(P.load_mtbench(limit=5)) == 5
    assert all(len(r["turns"]) == 2 and _user(r) == r["turns"][0] for r in rows)
    with pytest.raises(ValueError, match="known: .*coding"):
        P.load_mtbench(categories=["cooking"])


def test_a_few_mtbench_questions_span_the_categories_in_turn():
    """The file lists the questions category by category: a limit takes each category's first question in turn,
    then each one's second, so 10 questions cover all eight, not writing alone; a full set keeps the file's order."""
    rows = P.load_mtbench()
    ten = P.load_mtbench(limit=10)
    categories = list(dict.fromkeys(r["category"] for r in rows))
    assert len(categories) == 8 and [r["category"] for r in ten] == categories + categories[:2]
    assert [r["id"] for r in ten[:8]] == [next(r["id"] for r in rows if r["category"] == c) for c in categories]
    assert [r["id"] for r in P.load_mtbench(limit=80)] == [r["id"] for r in rows]
    two = P.load_mtbench(categories=["math", "coding"], limit=3)
    assert [r["category"] for r in two] == ["math", "coding", "math"]
    # an id that hashes the selection changes only where the picking differs from the file's first questions
    assert P.mtbench_selection(None, 10) == {"mtbench_selection": "round_robin_by_category"}
    assert P.mtbench_selection(["writing"], 8) == P.mtbench_selection(None, 80) == P.mtbench_selection(None, None) \
        == P.mtbench_selection(None, 1) == {}


def test_humaneval_prompts_ask_to_complete_a_function():
    rows = P.load_humaneval()
    assert len(rows) == 164
    assert _user(rows[0]).startswith("Complete the following Python function:\n```python\n")
    assert _user(rows[0]).endswith("```") and "def has_close_elements" in _user(rows[0])


def test_stdlib_questions_are_many_unique_and_deterministic():
    rows = P.load_stdlib()
    assert len(rows) > 1000
    assert len({r["id"] for r in rows}) == len(rows)
    assert rows == P.load_stdlib()
    questions = [r["messages"][0]["content"] for r in rows]
    assert "What does `json.dumps` do? Explain briefly." in questions


def test_mtbench_is_refused_as_a_training_source():
    with pytest.raises(ValueError, match="held-out"):
        P.load_source(PromptSource(kind="mtbench"))


def test_load_prompts_applies_limits_caps_and_is_seeded():
    cfg = DatasetConfig(sources=[PromptSource(kind="stdlib", limit=30), PromptSource(kind="humaneval", limit=10)])
    a, b, c = P.load_prompts(cfg, 0), P.load_prompts(cfg, 0), P.load_prompts(cfg, 1)
    assert len(a) == 40 and a == b and a != c
    assert sum(p["source"] == "humaneval" for p in a) == 10
    assert {p["source"] for p in a[:20]} == {"stdlib", "humaneval"}  # mixed, not concatenated
    capped = P.load_prompts(DatasetConfig(sources=cfg.sources, max_prompts=7), 0)
    assert len(capped) == 7


def test_training_prompts_equal_to_mtbench_questions_are_dropped(tmp_path):
    question = P.load_mtbench()[3]["messages"][0]["content"]
    f = tmp_path / "mine.jsonl"
    f.write_text(json.dumps({"prompt": question}) + "\n" + json.dumps({"prompt": "Name three colors."}) + "\n")
    out = P.load_prompts(DatasetConfig(sources=[PromptSource(kind="file", path=str(f))]), 0)
    assert [_user(p) for p in out] == ["Name three colors."]


def test_file_formats_messages_prompt_and_sharegpt(tmp_path):
    f = tmp_path / "d.jsonl"
    rows = [
        {"id": "a", "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
                                 {"role": "assistant", "content": "old answer"}]},
        {"prompt": "Write a haiku."},
        {"conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "4"}]},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    out = P.load_file(f)
    assert out[0] == {"id": "a", "source": "file", "messages": [{"role": "system", "content": "Be terse."},
                                                                 {"role": "user", "content": "Hi"}]}
    assert out[1]["messages"] == [{"role": "user", "content": "Write a haiku."}] and out[1]["id"] == "d-2"
    assert out[2]["messages"] == [{"role": "user", "content": "What is 2+2?"}]


@pytest.mark.parametrize("line, field", [
    ('{"messages": [{"role": "user", "content": "hi"}', "not valid JSON"),
    ('{"text": "no usable field"}', "'messages'"),
    ('{"messages": [{"role": "user", "content": ""}]}', "'messages[0].content'"),
    ('{"prompt": "   "}', "'prompt'"),
    ('{"prompt": 42}', "'prompt'"),
    ('{"messages": [{"role": "user", "content": 3}]}', "'messages[0]'"),
    ('{"messages": "hi"}', "'messages'"),
    ('{"conversations": [{"from": "robot", "value": "x"}]}', "'conversations[0].from'"),
    ('[1, 2]', "expected a JSON object"),
])
def test_malformed_rows_name_file_line_and_field(tmp_path, line, field):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "fine"}\n\n' + line + "\n")
    with pytest.raises(ValueError) as err:
        P.load_file(f)
    msg = str(err.value)
    assert f"{f}:3" in msg and field in msg


def test_empty_file_and_missing_file_are_errors(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl: no rows"):
        P.load_file(tmp_path / "empty.jsonl")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        P.load_file(tmp_path / "nope.jsonl")


def test_parquet_and_saved_datasets_dir(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([{"prompt": "one"}, {"prompt": "two"}])
    ds.to_parquet(str(tmp_path / "p.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    assert [_user(p) for p in P.load_file(tmp_path / "p.parquet")] == ["one", "two"]
    assert [_user(p) for p in P.load_file(tmp_path / "saved")] == ["one", "two"]
    datasets.Dataset.from_list([{"prompt": "ok"}, {"prompt": ""}]).to_parquet(str(tmp_path / "bad.parquet"))
    with pytest.raises(ValueError, match=r"bad.parquet: row 2: field 'prompt'"):
        P.load_file(tmp_path / "bad.parquet")


def test_topics_span_the_eight_categories_unique_deterministic_and_never_mtbench():
    from steps.lib.data.topics import CATEGORIES

    rows = P.load_topics()
    texts = [_user(p) for p in rows]
    assert len(rows) > 700 and len(set(texts)) == len(texts) and len({p["id"] for p in rows}) == len(rows)
    assert rows == P.load_topics()
    cats = {p["id"].split("-")[1] for p in rows}
    assert cats == set(CATEGORIES) | {"math"} == {"writing", "roleplay", "reasoning", "math", "coding",
                                                  "extraction", "stem", "humanities"}
    assert not set(texts) & {_user(p) for p in P.load_mtbench()}


def test_pydoc_asks_two_things_about_each_language_reference_topic():
    from pydoc_data.topics import topics

    rows = P.load_pydoc()
    assert len(rows) == 2 * len(topics) and {p["source"] for p in rows} == {"pydoc"}
    summary = next(p for p in rows if p["id"] == "pydoc-assert-summary")
    assert "assert" in _user(summary) and len(_user(summary)) < 900


def test_the_same_question_from_two_sources_is_kept_once(tmp_path):
    f = tmp_path / "mine.jsonl"
    dup = _user(P.load_topics()[0])
    f.write_text(json.dumps({"prompt": dup}) + "\n" + json.dumps({"prompt": "Name three colors."}) + "\n")
    out = P.load_prompts(DatasetConfig(sources=[PromptSource(kind="topics"), PromptSource(kind="file", path=str(f))]),
                         0)
    assert [_user(p) for p in out].count(dup) == 1 and len(out) == len(P.load_topics()) + 1


def test_held_out_split_is_disjoint_from_training_and_stable_under_the_cap():
    from steps.lib.config import load_config

    sources = "dataset.sources=[{kind: topics}, {kind: humaneval}]"
    cfg = load_config("configs/tiny.yaml", [sources, "dataset.held_out=12", "dataset.max_prompts=50"])
    train = P.load_prompts(cfg.dataset, cfg.seed)
    tok = _Tok()
    held = P.in_distribution_prompts(cfg, tok)
    assert len(train) == 50 and len(held) == 12
    assert not {pid for pid, _ in held} & {p["id"] for p in train}
    everything = P.load_prompts(load_config("configs/tiny.yaml", [sources]).dataset, cfg.seed)
    assert [pid for pid, _ in held] + [p["id"] for p in train] == [p["id"] for p in everything[:62]]
    bigger = load_config("configs/tiny.yaml", [sources, "dataset.held_out=12", "dataset.max_prompts=200"])
    assert P.in_distribution_prompts(bigger, tok) == held      # more training data, same held-out prompts
    fewer = load_config("configs/tiny.yaml", [sources, "dataset.held_out=12", "verify.in_distribution_prompts=5"])
    assert P.in_distribution_prompts(fewer, tok) == held[:5]
    none = load_config("configs/tiny.yaml", [sources, "dataset.held_out=12", "verify.in_distribution_prompts=0"])
    assert P.in_distribution_prompts(none, tok) == []


class _Tok:
    """Stands in for a chat template only: the split, not the tokenizer, is under test here."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return [len(m["content"]) for m in messages]


def test_a_row_over_the_byte_bound_is_refused_unparsed_and_unread_naming_its_line(tmp_path):
    """A 100 MB line once cost datagen 17 GB: a line over 4096 bytes × max_prompt_tokens is refused by its size
    (this one is not even JSON: parsing it would name another error), and is never read whole."""
    import tracemalloc

    bound = P.row_byte_bound(16)                                          # 64 KiB
    f = tmp_path / "big.jsonl"
    f.write_text('{"prompt": "fine"}\n' + '{"prompt": "' + "x" * (2 * 1024 * 1024) + "\n")
    tracemalloc.start()
    with pytest.raises(P.InputError) as err:
        P.load_file(f, max_prompt_tokens=16)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert f"{f}:2: a line longer than the bound" in str(err.value)
    assert f"{bound} bytes" in str(err.value) and "datagen.max_prompt_tokens=16" in str(err.value)
    assert peak < 4 * bound, peak                                         # a few bounds, not the 2 MiB line
    at_bound = json.dumps({"prompt": "y" * (bound - 20)})
    f.write_text(at_bound + " " * (bound - len(at_bound)) + "\n")       # exactly the bound, then the newline
    assert len(P.load_file(f, max_prompt_tokens=16)) == 1


def test_a_table_row_over_the_byte_bound_is_refused_naming_its_row(tmp_path):
    import datasets

    datasets.Dataset.from_list([{"prompt": "ok"}, {"prompt": "z" * (P.row_byte_bound(1) + 1)}]).to_parquet(
        str(tmp_path / "big.parquet"))
    with pytest.raises(P.InputError, match=r"big.parquet: row 2: a prompt of 4097 bytes, over the bound of 4096"):
        P.load_file(tmp_path / "big.parquet", max_prompt_tokens=1)
