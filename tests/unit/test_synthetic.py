"""Prompts the target writes itself, deduplication, decontamination and two-turn conversations (issue 23),
on the tiny target: seeded and resumable, counted in the manifest, rendered as serving renders them."""

from __future__ import annotations

import json

import pytest

from steps import datagen as D
from steps.lib import artifacts
from steps.lib.config import ConfigError, SyntheticConfig, load_config
from steps.lib.data import synthetic as S
from steps.lib.data.chat import chat_token_ids, render, user_turn_prefix
from steps.lib.data.decontaminate import NgramIndex, decontaminate
from steps.lib.data.dedup import dedup
from steps.lib.data.prompts import benchmark_index, load_mtbench, training_prompts
from steps.lib.store import artifact_id
from tests.conftest import TINY_PRETRAIN

#: MT-bench question 81's first turn: 19 words.
HAWAII = load_mtbench()[0]["turns"][0]


@pytest.fixture(scope="module")
def tiny(tiny_target):
    store, m, _ = tiny_target
    model, tok = artifacts.load_target(store, m.id)
    return store, m.id, model, tok


def tiny_cfg(*extra):
    return load_config("configs/tiny.yaml", [TINY_PRETRAIN, "datagen.max_new_tokens=16", "datagen.batch_size=8",
                                             "dataset.synthetic.max_tokens=32", *extra])


# --- filters, dedup, decontamination ------------------------------------------------------------------

def test_dedup_drops_exact_and_near_duplicates_deterministically():
    texts = ["How do I sort a list in Python?", "how do I  sort a LIST in python",      # exact (normalised)
             "How do I sort a list in Python quickly?",                                # near: Jaccard 6/7
             "Write a haiku about the sea.", "Explain how vaccines train the immune system."]
    keep, dropped = dedup(texts)
    assert keep == [0, 3, 4] and dropped == {"exact_duplicate": 1, "near_duplicate": 1}
    assert dedup(texts) == (keep, dropped)
    assert dedup(texts, threshold=0.9)[0] == [0, 2, 3, 4]      # 0.857 is below a stricter threshold


def test_decontamination_drops_a_shared_13_gram_and_counts_it(tmp_path):
    words = HAWAII.replace(",", "").split()
    run13, run12 = " ".join(words[1:14]), " ".join(words[2:14])
    index = benchmark_index()
    prompts = [{"id": i, "source": "x", "messages": [{"role": "user", "content": text}]} for i, text in enumerate([
        f"Please help me: {run13}, thanks.",                        # a 13-gram of MT-bench: dropped
        f"Please help me: {run12}, thanks.",                        # only 12 words shared: kept
        "Prove the Pythagorean theorem, please, in two ways.",      # a short MT-bench turn 2, whole: dropped
        "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n    \"\"\" Check if in given "
        "list of numbers, are any two numbers closer to each other than\n    given threshold.",   # HumanEval/0
        "Write a limerick about a cat."])]
    kept, dropped = decontaminate(prompts, index)
    assert [p["id"] for p in kept] == [1, 4] and dropped == {"mtbench": 2, "humaneval": 1}
    assert NgramIndex({"b": [HAWAII]}, n=14).match(prompts[0]["messages"][0]["content"]) is None

    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p["messages"][0]["content"]}) + "\n"
                         for i, p in enumerate(prompts)))
    cfg = tiny_cfg(f"dataset.sources=[{{kind: file, path: '{f}'}}, {{kind: humaneval, limit: 3}}]",
                   "dataset.decontaminate=true")
    out, counts = training_prompts(cfg.dataset, cfg.seed)
    assert sorted(p["id"] for p in out) == ["p1", "p4"]             # HumanEval leaves the training pool
    assert counts == {"mtbench_questions": 0, "exact_duplicate": 0, "contaminated_mtbench": 2,
                      "contaminated_humaneval": 4}


def test_written_turns_are_filtered():
    index = benchmark_index()
    assert S.verdict("", True, index) == "empty"
    assert S.verdict("How do I bake bread at home?", False, index) == "too_long"      # unfinished at max_tokens
    assert S.verdict("Sure! Here is a recipe for bread.", True, index) == "not_request"
    assert S.verdict("The weather was nice yesterday.", True, index) == "not_request"
    assert S.verdict(HAWAII, True, index) == "contaminated"
    for ok in ("How do I bake bread at home?", "Write a poem about autumn leaves.",
               "I'd like some tips for a job interview.", "Given x + 3 = 5, what is the value of x."):
        assert S.verdict(ok, True, index) is None


# --- synthetic prompts: seeded, resumable ------------------------------------------------------------

def _write(tiny, seed, stage_rows, made):
    _, _, model, tok = tiny
    syn = SyntheticConfig(max_tokens=32)

    def stage(r, make):
        if r not in stage_rows:
            made.append(r)
            stage_rows[r] = make()
        return stage_rows[r]
    return S.write_prompts(6, tok, D.user_turn_writer(model, tok, tiny_cfg().datagen), syn, benchmark_index(),
                           seed=seed, round_size=4, stage=stage)


def test_synthetic_prompts_are_seeded_counted_and_resume_from_stored_rounds(tiny):
    _, _, _, tok = tiny
    rounds, made = {}, []
    prompts, counts = _write(tiny, 0, rounds, made)
    assert 0 < len(prompts) <= 6 and made == sorted(rounds)
    assert counts["written"] == len(prompts) + sum(counts[r] for r in (*S.REASONS, "unused")) \
        == sum(map(len, rounds.values()))
    for p in prompts:
        assert p["source"] == "synthetic" and p["messages"][-1]["role"] == "user" and p["messages"][-1]["content"]
    assert _write(tiny, 0, {}, []) == (prompts, counts)                      # the same seed, the same prompts
    assert _write(tiny, 1, {}, [])[0] != prompts
    resumed = []                                                             # killed after its first round
    assert _write(tiny, 0, {0: rounds[0]}, resumed) == (prompts, counts) and 0 not in resumed
    # the user turn starts where the template's user header ends, as a served conversation's would
    system = [{"role": "system", "content": "Be brief."}]
    assert render(tok, system + [{"role": "user", "content": "Hi"}]).startswith(user_turn_prefix(tok, system) + "Hi")


# --- datagen end to end: synthetic source, two turns, manifest counts ----------------------------------

@pytest.fixture(scope="module")
def two_turn_run(tiny, tmp_path_factory):
    store, tid, _, _ = tiny
    f = tmp_path_factory.mktemp("syn") / "p.jsonl"
    f.write_text(json.dumps({"id": "leak", "prompt": f"Please: {HAWAII}"}) + "\n"
                 + json.dumps({"id": "fine", "prompt": "What does `os.path.join` do? Explain briefly."}) + "\n")
    cfg = tiny_cfg(f"dataset.sources=[{{kind: synthetic, count: 6}}, {{kind: file, path: '{f}'}}]",
                   "dataset.decontaminate=true", "datagen.turns=2")
    return cfg, D.run(cfg, store, tid, chunk_prompts=4)


def test_datagen_writes_synthetic_two_turn_conversations_and_counts_what_it_dropped(tiny, two_turn_run):
    store, _, _, tok = tiny
    cfg, m = two_turn_run
    met = m.metrics
    print("synthetic two-turn metrics:", met)
    assert met["dropped_contaminated_mtbench"] == 1
    assert met["synthetic_written"] == met["synthetic_kept"] + sum(met[f"synthetic_{r}"] for r in (*S.REASONS,
                                                                                                   "unused"))
    assert met["turn2_written"] == met["ok"]
    assert met["two_turn"] == met["turn2_written"] - sum(met[f"turn2_{r}"] for r in S.REASONS[:4]) \
        - met["turn2_prompt_too_long"] - met["turn2_empty_answer"]
    assert any(f["path"] == "synthetic/part-00000.jsonl" for f in m.files)
    rows = list(artifacts.read_conversations(store, m.id))
    assert {r["source"] for r in rows} == {"synthetic", "file"} and "leak" not in {r["id"] for r in rows}
    two = [r for r in rows if [x["role"] for x in r["messages"] if x["role"] != "system"] == ["user", "assistant"] * 2]
    assert len(two) == met["two_turn"] > 0
    for r in two:
        msgs, ids, mask = r["messages"], r["input_ids"], r["loss_mask"]
        answers = [x["content"] + "<|im_end|>" for x in msgs if x["role"] == "assistant"]
        assert _masked_runs(tok, ids, mask) == answers                       # loss on both assistant turns
        assert tok.decode(ids) == render(tok, msgs)
        # the tokens before the second answer are exactly the prompt a server tokenizes for that turn
        assert ids[:len(chat_token_ids(tok, msgs[:-1]))] == chat_token_ids(tok, msgs[:-1])


def test_synthetic_dataset_is_content_addressed_and_reused(tiny, two_turn_run):
    store, tid, _, _ = tiny
    cfg, m = two_turn_run
    assert D.run(cfg, store, tid, chunk_prompts=4).id == m.id           # committed: found, not regenerated
    other = cfg.model_copy(update={"seed": 1})
    assert artifact_id("dataset", D.dataset_identity(other, [], 4), {"target": tid}) != \
        artifact_id("dataset", D.dataset_identity(cfg, [], 4), {"target": tid})


def test_a_killed_datagen_replays_its_stored_synthetic_rounds(tiny, two_turn_run, tmp_path, monkeypatch):
    import shutil

    from steps.lib.store import open_store
    src_store, tid, _, _ = tiny
    cfg, clean = two_turn_run
    store = open_store(f"file://{tmp_path / 'store'}")
    shutil.copytree(artifacts.target_dir(src_store, tid), store.backend.local_path(store.key("target", tid)))

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("simulated kill after the prompts were written")
    monkeypatch.setattr(D, "answer_chunk", killed)
    with pytest.raises(KeyboardInterrupt):
        D.run(cfg, store, tid, chunk_prompts=4)
    monkeypatch.undo()
    real, rounds = S._write_round, []
    monkeypatch.setattr(S, "_write_round", lambda *a, **k: (rounds.append(1), real(*a, **k))[1])
    m = D.run(cfg, store, tid, chunk_prompts=4)
    assert rounds == [] and m.id == clean.id                     # every round came from the killed run's records
    assert list(artifacts.read_conversations(store, m.id)) == list(artifacts.read_conversations(src_store, clean.id))


def _masked_runs(tok, ids, mask):
    runs, cur = [], []
    for i, k in zip(ids, mask, strict=True):
        if k:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs + ([tok.decode(cur)] if cur else [])


# --- config and ids ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("override", "says"), [
    ("dataset.sources=[{kind: synthetic}]", r"dataset\.sources.*kind=synthetic takes `count`"),
    ("dataset.sources=[{kind: stdlib, count: 3}]", r"dataset\.sources.*kind=synthetic takes `count`"),
    ("dataset.sources=[{kind: synthetic, count: 3, limit: 2}]", r"sized by `count`, not `limit`"),
    ("datagen.turns=3", r"datagen\.turns"),
    ("dataset.synthetic.temperature=0", r"dataset\.synthetic\.temperature"),
])
def test_bad_synthetic_settings_name_the_field(override, says):
    with pytest.raises(ConfigError, match=says):
        load_config("configs/tiny.yaml", [override])


def test_synthetic_and_two_turns_need_the_local_backend():
    openai = ["datagen.backend=openai", "datagen.server_url=http://127.0.0.1:1/v1"]
    with pytest.raises(ConfigError, match="kind=synthetic needs datagen.backend=local"):
        load_config("configs/tiny.yaml", [*openai, "dataset.sources=[{kind: synthetic, count: 3}]"])
    with pytest.raises(ConfigError, match=r"datagen\.turns=2 needs datagen\.backend=local"):
        load_config("configs/tiny.yaml", [*openai, "datagen.turns=2"])


def test_new_fields_leave_existing_ids_unchanged():
    cfg = load_config("configs/tiny.yaml")
    prompts = D.with_samples(training_prompts(cfg.dataset, cfg.seed)[0], cfg.datagen)
    tiny_id = artifact_id("dataset", D.dataset_identity(cfg, prompts, D.CHUNK_PROMPTS), {"target": "t"})
    assert tiny_id == "b7093a5924e5d422"                # main's id for configs/tiny.yaml before these fields
    assert artifacts.target_artifact_id(load_config("configs/smollm2-135m.yaml")) == "dcd04ba005048334"
    for changed in (["dataset.decontaminate=true"], ["datagen.turns=2"]):
        c = load_config("configs/tiny.yaml", changed)
        assert artifact_id("dataset", D.dataset_identity(c, prompts, D.CHUNK_PROMPTS), {"target": "t"}) != tiny_id
    # the writer's settings change nothing while nothing is written: not in the id
    c = load_config("configs/tiny.yaml", ["dataset.synthetic.temperature=1.0"])
    assert artifact_id("dataset", D.dataset_identity(c, prompts, D.CHUNK_PROMPTS), {"target": "t"}) == tiny_id
