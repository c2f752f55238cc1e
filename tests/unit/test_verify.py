"""Verify: offline τ of the exported SGLang directory with the reference engine, end to end on tiny artifacts.

`world` is the one of tests/unit/test_export.py (a random draft; tests/builders.py), exported once per
module. `copying_world` is the bigram target and its copying draft (tests/builders.py), whose τ is worked
out by hand from the target's bigram map, so the measured τ is checked against a number, not a range.
"""

from __future__ import annotations

import json

import pytest
import torch

from steps import export, verify
from steps.lib import artifacts, formats
from steps.lib.data.prompts import held_out_prompts, load_mtbench
from steps.lib.metrics import pooled_tau
from steps.lib.model.reference_engine import Engine
from steps.lib.store import open_store
from tests.builders import (
    bigram_world,
    cli_record,
    free_port,
    put_random_draft,
    record_of,
    tiny_pipeline_config,
    tiny_target_dir,
)

V, H, VD = 272, 64, 128
LAYER_IDS = [1, 2, 3]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from steps import target

    root = tmp_path_factory.mktemp("verify")
    tdir = tiny_target_dir(root, vocab_size=V, hidden_size=H, intermediate_size=128)
    store = open_store(f"file://{root}/store")
    cfg = tiny_pipeline_config(tdir, draft_vocab_size=VD, layer_ids=LAYER_IDS)
    target_id = target.run(cfg, store).id
    draft_id = put_random_draft(store, tdir, draft_vocab_size=VD, intermediate_size=128)
    export_id = export.run(cfg, store, draft_id, target_id).id
    return {"store": store, "cfg": cfg, "target_id": target_id, "export_id": export_id}


def test_verify_reports_offline_tau_and_speed_for_the_exported_sglang_dir(world):
    m = verify.run(world["cfg"], world["store"], world["export_id"], world["target_id"])
    k = world["cfg"].serve.num_steps
    assert m.kind == "verify" and m.inputs == {"export": world["export_id"], "target": world["target_id"]}
    assert m.metrics["mismatches"] == 0 and m.metrics["prompts"] == 2 and m.metrics["num_steps"] == k
    assert m.metrics["spec_tokens_per_s"] > 0 and m.metrics["plain_tokens_per_s"] > 0 and m.metrics["speedup"] > 0
    assert m.meta["layer_ids"] == LAYER_IDS and m.meta["dropped_keys"] == [] and m.meta["missing_params"] == []
    report = json.loads(world["store"].fetch_file("verify", m.id, "report.json").read_text())
    assert [r["match"] for r in report["prompts"]] == [True, True]
    assert report["load_report"]["embed_from_target"] is True
    assert verify.run(world["cfg"], world["store"], world["export_id"], world["target_id"]).id == m.id


def test_main_prints_the_verify_record_and_refuses_an_unknown_export(world, tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(world["cfg"].model_dump_json())
    common = ("--config", str(config), "--store", world["store"].uri, "--target", world["target_id"])
    code, record = cli_record(capsys, verify.main, *common, "--export", world["export_id"])
    assert code == 0
    m = world["store"].manifest("verify", record["id"])
    assert record == record_of(world["store"], m) and m.inputs["export"] == world["export_id"]
    assert record["metrics"]["mismatches"] == 0 and record["metrics"]["tau"] >= 1.0
    assert verify.main([*common, "--export", "0123456789abcdef"]) == 2
    last = capsys.readouterr().err.splitlines()[-1]          # after the target's loading bar
    assert last.startswith("eaglenest verify: ") and "0123456789abcdef" in last and "--store" in last


def test_verify_also_measures_the_held_out_split_of_the_training_sources(world):
    cfg = world["cfg"]
    split = cfg.model_copy(update={"dataset": cfg.dataset.model_copy(update={"held_out": 2})})
    m = verify.run(split, world["store"], world["export_id"], world["target_id"])
    plain = verify.run(cfg, world["store"], world["export_id"], world["target_id"])
    assert m.id != plain.id and "tau_in_distribution" not in plain.metrics
    assert m.metrics["prompts_in_distribution"] == 2 and m.metrics["tau_in_distribution"] >= 1.0
    assert len(m.metrics["per_position_acceptance_in_distribution"]) == cfg.serve.num_steps
    assert m.metrics["tau"] == plain.metrics["tau"] and m.metrics["prompts"] == 2   # MT-bench as before
    report = json.loads(world["store"].fetch_file("verify", m.id, "report.json").read_text())
    held = [r for r in report["prompts"] if r.get("split") == "in_distribution"]
    assert len(held) == 2 and all(r["match"] for r in held) and not any(r["id"].startswith("mtbench") for r in held)


@pytest.fixture(scope="module")
def copying_world(tmp_path_factory):
    return bigram_world(tmp_path_factory.mktemp("verify-copying"), free_port())


def test_verify_measures_the_tau_worked_out_by_hand_for_the_copying_draft(copying_world):
    """The bigram target ignores context, so its greedy output is the path x -> B(x) from the prompt's last
    token; every held-out prompt ends with the same token ("\n" of "<|im_start|>assistant\n").

    Fixture facts (checked first): that path is nl -> y1 -> y2 -> y3 -> f with f = B(f), no eos on it.
    The copying draft's d_1 = B(x[n]) is always right and its chain repeats d_1, so a round accepts all
    k = 3 drafts if d_1 is a fixed point, else exactly 1. Per prompt (max_new_tokens 24): the prefill gives
    y1; round 1 (x[n] = y1) accepts d_1 = y2 but not d_2 = y2 != B(y2), and adds the bonus y3: 3 tokens;
    every later round has d_1 = f (from y3, then from f itself) and adds 4: 3 + 4·5 = 23 < 24 <= 3 + 4·6
    -> 6 more rounds. Per prompt histogram [0, 1, 0, 6]; three prompts [0, 3, 0, 18]:
    τ = (3·2 + 18·4) / 21 = 26/7, per-position acceptance [1, 18/21, 18/21]."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    w = copying_world
    tok = AutoTokenizer.from_pretrained(w["target_dir"])
    target = AutoModelForCausalLM.from_pretrained(w["target_dir"], dtype=torch.float32)
    with torch.no_grad():
        b = target(input_ids=torch.arange(target.config.vocab_size)[:, None]).logits[:, -1].argmax(-1).tolist()
    last = {ids[-1] for _, ids in held_out_prompts(w["cfg"], tok)}
    assert last == {tok.convert_tokens_to_ids("Ċ")}                       # byte-level "\n"
    path = [last.pop()]
    for _ in range(4):
        path.append(b[path[-1]])
    assert len(set(path)) == 5 and b[path[-1]] == path[-1] and tok.eos_token_id not in path, path

    m = verify.run(w["cfg"], w["store"], w["export_id"], w["target_id"])
    assert m.metrics["accept_histogram"] == [0, 3, 0, 18] and m.metrics["verify_steps"] == 21
    assert m.metrics["tau"] == pytest.approx(26 / 7, abs=1e-12)
    assert m.metrics["per_position_acceptance"] == pytest.approx([1.0, 18 / 21, 18 / 21], abs=1e-12)
    assert m.metrics["tokens"] == 3 * 24 and m.metrics["mismatches"] == 0
    report = json.loads(w["store"].fetch_file("verify", m.id, "report.json").read_text())
    assert [r["accept_histogram"] for r in report["prompts"]] == [[0, 1, 0, 6]] * 3


def test_held_out_prompts_are_chat_templated_mtbench_first_turns(world):
    from transformers import AutoTokenizer

    from steps.lib.artifacts import target_dir

    tok = AutoTokenizer.from_pretrained(target_dir(world["store"], world["target_id"]))
    prompts = held_out_prompts(world["cfg"], tok)
    assert [pid for pid, _ in prompts] == ["mtbench-81", "mtbench-91"]       # writing, then roleplay
    text = tok.decode(prompts[0][1])
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")


def test_layer_ids_are_read_back_the_way_sglang_captures_them(world):
    path = artifacts.export_dir(world["store"], world["export_id"], "sglang")
    assert formats.sglang.sglang_layer_ids(path) == LAYER_IDS          # eagle_config holds [0, 1, 2]; SGLang adds 1


class AcceptEverything(Engine):
    """A wrong engine: takes every draft without checking it against the target."""

    def speculative_step(self, s):
        d = self.draft_chain(s)
        _, g = self.target_forward([s.x[s.n]] + d, s.target_cache)
        s.feats, s.x = g, s.x + d + [d[-1]]
        return d + [d[-1]], self.k


def test_an_engine_that_changes_the_output_is_caught(world):
    from steps.lib.artifacts import load_target
    from steps.lib.formats.sglang_loader import load_sglang_draft

    target, tok = load_target(world["store"], world["target_id"])
    draft, _ = load_sglang_draft(artifacts.export_dir(world["store"], world["export_id"], "sglang"), target=target)
    engine = AcceptEverything(target, tok, draft, layer_ids=LAYER_IDS, num_steps=3)
    _, rows = verify.measure(engine, [("p", [5, 6, 7, 8])], 12, None)
    assert rows[0]["match"] is False and rows[0]["first_diff"] is not None


def with_verify(cfg, **changes):
    return cfg.model_copy(update={"verify": cfg.verify.model_copy(update=changes)})


def test_new_verify_fields_at_their_defaults_leave_the_verify_id_as_it_was(world):
    cfg = world["cfg"]
    # the section the id hashed before turns, chain lengths, batching, ties and intervals existed
    # (and the rule that picked a subset of MT-bench round its categories, where it picked other questions)
    assert set(verify.verify_section(cfg)) == {"num_prompts", "max_new_tokens", "categories",
                                               "in_distribution_prompts", "num_steps", "mtbench_selection"}
    assert "mtbench_selection" not in verify.verify_section(with_verify(cfg, num_prompts=1))
    assert verify.verify_section(with_verify(cfg, batch_size=8)) == verify.verify_section(cfg)
    assert verify.verify_section(with_verify(cfg, turns=2))["turns"] == 2


def engine_of(w, k=None):
    from steps.lib.artifacts import load_target
    from steps.lib.formats.sglang_loader import load_sglang_draft

    target, tok = load_target(w["store"], w["target_id"])
    draft, _ = load_sglang_draft(artifacts.export_dir(w["store"], w["export_id"], "sglang"), target=target)
    return Engine(target, tok, draft, layer_ids=LAYER_IDS, num_steps=k or w["cfg"].serve.num_steps), tok


def test_verify_reports_the_share_of_the_targets_answer_tokens_the_draft_vocab_holds(world, copying_world, tmp_path):
    """`draft_vocab_coverage`: the target's plain MT-bench answers against the target ids the exported draft can
    propose (its d2t read as SGLang reads it: hot id = i + d2t[i]). The random draft's 128 of 272 ids, counted
    here from the answers; the copying draft drafts every answer token right (its d_1 is always accepted), so all
    of them are in its vocab. Without a d2t, SGLang proposes draft ids as target ids."""
    import shutil

    from safetensors.torch import load_file, save_file

    from steps.lib.formats.common import WEIGHTS_FILE
    from steps.lib.formats.sglang_loader import draft_vocab

    sglang_dir = artifacts.export_dir(world["store"], world["export_id"], "sglang")
    d2t = load_file(str(sglang_dir / WEIGHTS_FILE))["d2t"]
    hot = draft_vocab(sglang_dir)
    assert hot == set((d2t + torch.arange(VD)).tolist()) and len(hot) == VD
    engine, tok = engine_of(world)
    plain = verify.local_decoding(engine, world["cfg"].verify.max_new_tokens, tok.eos_token_id).plain(
        held_out_prompts(world["cfg"], tok))
    answers = [t for out, _ in plain for t in out]
    expected = sum(t in hot for t in answers) / len(answers)
    m = verify.run(world["cfg"], world["store"], world["export_id"], world["target_id"])
    assert m.metrics["draft_vocab_coverage"] == pytest.approx(expected) and answers
    copying = verify.run(copying_world["cfg"], copying_world["store"], copying_world["export_id"],
                         copying_world["target_id"])
    assert copying.metrics["draft_vocab_coverage"] == 1.0

    bare = tmp_path / "no-d2t"
    shutil.copytree(sglang_dir, bare)
    weights = load_file(str(bare / WEIGHTS_FILE))
    del weights["d2t"]
    save_file(weights, str(bare / WEIGHTS_FILE))
    assert draft_vocab(bare) == set(range(VD))


def test_compare_counts_the_rejections_whose_token_the_draft_vocab_lacks():
    """Hand-worked, k = 3 (the walk of tests/unit/test_metrics.py): prompt a rejects drafts where 12 and 13 were
    right, prompt b where 13 was; with 12 in the vocab and 13 not, two of the three rejections are the vocab's.
    A served engine's counts have no order: its records carry no such count, and the share is left out."""
    from steps.lib.metrics import AcceptStats

    outputs = {"a": ([10, 11, 12, 13, 14, 15, 16, 17, 18], [1, 0, 3, 1]), "b": ([12, 13], [0])}

    def spec(prompts, k):
        out = []
        for pid, _ in prompts:
            tokens, rounds = outputs[pid]
            stats = AcceptStats(k)
            for n in rounds:
                stats.add(n)
            out.append((tokens, stats, 1.0))
        return out

    decoding = verify.Decoding(3, plain=lambda ps: [(outputs[pid][0], 1.0) for pid, _ in ps], spec=spec,
                               gap=lambda *_: 0.0)
    _, rows = verify.compare(decoding, [("a", [1]), ("b", [2])], 3, proposable={12, 20})
    assert [(r["rejections"], r["rejections_outside_draft_vocab"]) for r in rows] == [(2, 1), (1, 1)]
    assert verify.outside_vocab_share(rows) == {"rejections_outside_draft_vocab": 2 / 3}
    served = verify.Decoding(3, plain=decoding.plain, gap=decoding.gap,
                             spec=lambda ps, k: [(o[0], AcceptStats(k, o[1].histogram), 1.0) for o in spec(ps, k)])
    _, rows = verify.compare(served, [("a", [1])], 3, proposable={12})
    assert "rejections" not in rows[0] and verify.outside_vocab_share(rows) == {}


def test_verify_counts_the_rejections_the_draft_vocab_makes_unavoidable(world, copying_world):
    """Through the real engines: the random draft accepts nothing, so each answer token after the prefill's
    replaced a rejected draft, and this tiny target's answers are a token its exported draft vocab lacks (every
    rejection is the vocab's). The copying draft's vocab holds every answer token: none of its rejections is."""
    from steps.lib.formats.sglang_loader import draft_vocab

    hot = draft_vocab(artifacts.export_dir(world["store"], world["export_id"], "sglang"))
    engine, tok = engine_of(world)
    prompts = held_out_prompts(world["cfg"], tok)
    decoding = verify.local_decoding(engine, world["cfg"].verify.max_new_tokens, tok.eos_token_id)
    answers = [out for out, _ in decoding.plain(prompts)]
    _, rows = verify.compare(decoding, prompts, engine.k, proposable=hot)
    for r, answer in zip(rows, answers, strict=True):
        assert not any(r["accept_histogram"][1:]) and r["rejections"] == len(answer) - 1 > 0
        assert r["rejections_outside_draft_vocab"] == sum(t not in hot for t in answer[1:])
    m = verify.run(world["cfg"], world["store"], world["export_id"], world["target_id"])
    assert m.metrics["rejections_outside_draft_vocab"] == verify.outside_vocab_share(rows)[
        "rejections_outside_draft_vocab"] == 1.0
    copying = verify.run(copying_world["cfg"], copying_world["store"], copying_world["export_id"],
                         copying_world["target_id"])
    assert copying.metrics["rejections_outside_draft_vocab"] == 0.0 and copying.metrics["tau"] > 1.5


@pytest.mark.parametrize("which", ["world", "copying_world"])
def test_batched_verify_measures_what_the_one_prompt_at_a_time_path_measures(which, request):
    w = request.getfixturevalue(which)
    engine, tok = engine_of(w)
    prompts = held_out_prompts(w["cfg"], tok)
    one, one_rows = verify.measure(engine, prompts, 24, tok.eos_token_id)
    batched, rows = verify.measure(engine, prompts, 24, tok.eos_token_id, batch_size=len(prompts))
    assert batched.histogram == one.histogram and batched.tau == one.tau
    assert [r["accept_histogram"] for r in rows] == [r["accept_histogram"] for r in one_rows]
    assert all(r["match"] for r in rows)


def test_verify_measures_both_turns_with_the_targets_own_first_answer_as_history(copying_world):
    from steps.lib.data.prompts import chat_token_ids, load_mtbench, second_turn_prompts

    w = copying_world
    cfg = with_verify(w["cfg"], turns=2)
    m = verify.run(cfg, w["store"], w["export_id"], w["target_id"])
    report = json.loads(w["store"].fetch_file("verify", m.id, "report.json").read_text())
    second = [r for r in report["prompts"] if r["turn"] == 2]
    assert m.metrics["prompts"] == 6 and len(second) == 3 and all(r["match"] for r in report["prompts"])
    assert m.metrics["tau_turn1"] == pytest.approx(26 / 7) and m.metrics["tau_turn2"] >= 1.0
    # the second turn's prompt: turn 1, the target's own plain greedy answer to it, turn 2, in its template
    engine, tok = engine_of(w)
    answers = {}
    for (pid, ids), q in zip(held_out_prompts(cfg, tok), load_mtbench(None, 3), strict=True):
        answer = tok.decode(engine.generate_plain(ids, cfg.verify.max_new_tokens, tok.eos_token_id),
                            skip_special_tokens=True)
        expected = chat_token_ids(tok, [{"role": "user", "content": q["turns"][0]},
                                        {"role": "assistant", "content": answer},
                                        {"role": "user", "content": q["turns"][1]}])
        row = next(r for r in second if r["id"] == f"{pid}-turn2")
        assert row["prompt_tokens"] == len(expected) and answer
        answers[pid] = (answer, expected)
    built = second_turn_prompts(cfg, tok, {pid: a for pid, (a, _) in answers.items()})
    assert built == [(f"{pid}-turn2", ids) for pid, (_, ids) in answers.items()]
    assert verify.verify_section(cfg) != verify.verify_section(w["cfg"])


def test_verify_decodes_in_the_served_dtype_when_asked(copying_world):
    """verify.dtype bfloat16: target and draft decode in bf16 (read off their weights, not the config), the id
    changes, and the bigram target's margins survive the rounding, so the hand-worked τ of 26/7 holds."""
    w = copying_world
    fp32 = verify.run(w["cfg"], w["store"], w["export_id"], w["target_id"])
    cfg = with_verify(w["cfg"], dtype="bfloat16", tie_tolerance=1.0)
    m = verify.run(cfg, w["store"], w["export_id"], w["target_id"])
    assert fp32.meta["dtype"] == {"target": "float32", "draft": "float32"}
    assert m.meta["dtype"] == {"target": "bfloat16", "draft": "bfloat16"} and m.id != fp32.id
    assert m.metrics["tau"] == pytest.approx(26 / 7) and m.metrics["mismatches"] == 0
    assert verify.verify_section(with_verify(w["cfg"], dtype="float32")) == verify.verify_section(w["cfg"])


def test_verify_gives_each_mtbench_category_its_tau_over_both_turns(copying_world):
    """Every prompt of the copying world ends in the same token, so each has the hand-worked histogram
    [0, 1, 0, 6] (first turns); each category pools its questions' two turns, 10 questions apiece."""
    w = copying_world
    cfg = with_verify(w["cfg"], categories=["roleplay", "math"], num_prompts=None, turns=2)
    m = verify.run(cfg, w["store"], w["export_id"], w["target_id"])
    report = json.loads(w["store"].fetch_file("verify", m.id, "report.json").read_text())
    by_cat = m.metrics["tau_by_category"]
    assert set(by_cat) == {"math", "roleplay"} and [c["prompts"] for c in by_cat.values()] == [20, 20]
    for name, c in by_cat.items():
        ids = {q["id"] for q in load_mtbench([name])}
        rows = [r["accept_histogram"] for r in report["prompts"] if r["id"].removesuffix("-turn2") in ids]
        assert len(rows) == 20 and c["tau"] == pytest.approx(pooled_tau(rows))
        assert c["tau_interval"][0] <= c["tau"] <= c["tau_interval"][1]
    first = [r for r in report["prompts"] if r["turn"] == 1]
    assert all(r["accept_histogram"] == [0, 1, 0, 6] for r in first)


def test_verify_gives_each_chain_length_its_tau_and_the_served_one_as_headline(copying_world):
    w = copying_world
    k = w["cfg"].serve.num_steps
    cfg = with_verify(w["cfg"], chain_lengths=[k, 1])
    m = verify.run(cfg, w["store"], w["export_id"], w["target_id"])
    by_k = m.metrics["by_chain_length"]
    assert set(by_k) == {str(k), "1"} and by_k[str(k)]["tau"] == m.metrics["tau"] == pytest.approx(26 / 7)
    assert by_k["1"]["num_steps"] == 1 and by_k["1"]["tau"] == pytest.approx(2.0)   # d_1 = B(x[n]) always right
    with pytest.raises(ValueError, match="serve.num_steps"):
        type(cfg).model_validate({**cfg.model_dump(), "verify": {**cfg.verify.model_dump(), "chain_lengths": [1]}})


def test_verify_measures_humaneval_only_where_the_draft_never_saw_it(copying_world):
    """`verify.code_prompts`: HumanEval's stubs, chat-templated, one turn at the served k. Their prompts end in the
    template's "\n" like MT-bench's, so the copying draft gives each the hand-worked histogram [0, 1, 0, 6]. The
    config refuses the figure where HumanEval is a training source or the other sources are not decontaminated."""
    w = copying_world
    cfg = type(w["cfg"]).model_validate({**w["cfg"].model_dump(), "dataset": {"decontaminate": True},
                                         "verify": {**w["cfg"].verify.model_dump(), "code_prompts": 2}})
    m = verify.run(cfg, w["store"], w["export_id"], w["target_id"])
    plain = verify.run(w["cfg"], w["store"], w["export_id"], w["target_id"])
    assert m.id != plain.id and "tau_humaneval" not in plain.metrics
    assert m.metrics["prompts_humaneval"] == 2 and m.metrics["tau_humaneval"] == pytest.approx(26 / 7, abs=1e-12)
    assert m.metrics["per_position_acceptance_humaneval"] == pytest.approx([1.0, 12 / 14, 12 / 14], abs=1e-12)
    lo, hi = m.metrics["tau_interval_humaneval"]
    assert lo <= m.metrics["tau_humaneval"] <= hi
    assert m.metrics["tau"] == plain.metrics["tau"] and m.metrics["prompts"] == plain.metrics["prompts"]
    report = json.loads(w["store"].fetch_file("verify", m.id, "report.json").read_text())
    code = [r for r in report["prompts"] if r.get("split") == "humaneval"]
    assert [r["id"] for r in code] == ["humaneval-0", "humaneval-1"] and all(r["match"] for r in code)
    assert [r["accept_histogram"] for r in code] == [[0, 1, 0, 6]] * 2

    data = cfg.model_dump()
    trained_on_it = {**data, "dataset": {**data["dataset"], "sources": [{"kind": "humaneval"}]}}
    with pytest.raises(ValueError, match=r"verify.code_prompts=2 measures τ on HumanEval, which dataset.sources"):
        type(cfg).model_validate(trained_on_it)
    with pytest.raises(ValueError, match=r"dataset.decontaminate: true"):
        type(cfg).model_validate({**data, "dataset": {**data["dataset"], "decontaminate": False}})


def test_verify_reports_a_seeded_bootstrap_interval_that_holds_tau(world):
    m = verify.run(world["cfg"], world["store"], world["export_id"], world["target_id"])
    lo, hi = m.metrics["tau_interval"]
    assert lo <= m.metrics["tau"] <= hi


def test_a_near_tie_within_the_tolerance_is_reported_not_failed(world):
    engine, _ = engine_of(world)
    engine = AcceptEverything(engine.target, engine.tokenizer, engine.draft, layer_ids=LAYER_IDS, num_steps=3)
    _, strict = verify.measure(engine, [("p", [5, 6, 7, 8])], 12, None)
    gap = strict[0]["logit_gap"]
    assert strict[0]["match"] is False and strict[0]["near_tie"] is False and gap > 0
    _, tolerant = verify.measure(engine, [("p", [5, 6, 7, 8])], 12, None, tie_tolerance=gap)
    assert tolerant[0]["match"] is True and tolerant[0]["near_tie"] is True


def test_verify_through_the_reference_server_measures_the_in_process_tau(copying_world):
    """verify.engine: server decodes through served engines (the reference server here, started from the
    export one at a time) and must measure what the in-process engine measures, exactly: the reference engine
    is float32 on both sides, so no tie tolerance is needed. Both turns cover the second-turn prompts built
    from the baseline server's own answers, and a HumanEval stub the served decoding must hold too."""
    from steps.lib.checks.tau import compare_tau

    w = copying_world
    local = verify.run(with_verify(w["cfg"], turns=2, code_prompts=1), w["store"], w["export_id"], w["target_id"])
    served_cfg = with_verify(w["cfg"], turns=2, engine="server", code_prompts=1)
    m = verify.run(served_cfg, w["store"], w["export_id"], w["target_id"])
    assert m.id != local.id and m.meta["engine"] == "server" and m.meta["server"]["engine"] == "reference"
    for key in ("tau", "per_position_acceptance", "accept_histogram", "verify_steps", "accepted_drafts", "prompts",
                "tokens", "mismatches", "near_ties", "tau_turn1", "tau_turn2", "tau_interval", "tau_humaneval",
                "prompts_humaneval"):
        assert m.metrics[key] == local.metrics[key], key
    assert m.metrics["tau_turn1"] == pytest.approx(26 / 7) and m.metrics["prompts"] == 6
    assert m.meta["layer_ids"] == local.meta["layer_ids"] and m.meta["dropped_keys"] == []
    rows = {r["id"]: r for r in json.loads(w["store"].fetch_file("verify", m.id, "report.json").read_text())["prompts"]}
    mine = json.loads(w["store"].fetch_file("verify", local.id, "report.json").read_text())["prompts"]
    assert {r["id"]: r["accept_histogram"] for r in mine} == {i: r["accept_histogram"] for i, r in rows.items()}
    assert compare_tau(m.metrics["tau"], m.metrics["tau"], []).status == "pass"     # F9 reads the same field


def test_a_target_that_does_not_fit_one_device_is_told_to_verify_through_the_server(world):
    data = world["cfg"].model_dump()
    with pytest.raises(ValueError, match="set verify.engine: server"):
        type(world["cfg"]).model_validate({**data, "target": {**data["target"], "tensor_parallel_size": 8}})
    served = type(world["cfg"]).model_validate({**data, "target": {**data["target"], "tensor_parallel_size": 8},
                                                "verify": {**data["verify"], "engine": "server"}})
    assert verify.verify_section(served)["served_by"]["engine"] == served.serve.engine
    assert "engine" not in verify.verify_section(world["cfg"])        # the default leaves existing ids as they were


def test_the_served_logit_gap_is_the_in_process_one(copying_world):
    """A near tie through a server is told by the baseline server's logprobs of both tokens (SGLang's
    `token_ids_logprob`, which the reference server answers in SGLang's shape)."""
    from steps.lib.serving import client, offline

    w = copying_world
    engine, tok = engine_of(w)
    ids = held_out_prompts(w["cfg"], tok)[0][1]
    with offline.one_server(w["cfg"], w["store"], w["export_id"], w["target_id"], baseline=True) as (url, _):
        served = client.logit_gap(url, ids, 5, 9)
    assert served == pytest.approx(verify.logit_gap(engine, ids, 5, 9), abs=1e-4) and served != 0.0


def test_dtype_flips_counts_where_bf16_greedy_leaves_float32_greedy(world, capsys):
    """benchmarks/dtype_flips.py: every flip's float32 gap is ≥ 0 (float32's own argmax is the top), and the
    positions are the answer tokens it decoded (prompt's last position included)."""
    from benchmarks import dtype_flips

    assert dtype_flips.main(["--store", world["store"].uri, "--target", world["target_id"], "--config", "tiny",
                             "--prompts", "2", "--tokens", "12"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 2 <= out["positions"] <= 2 * 13 and out["flips"] == len(out["float32_gaps"]) <= out["positions"]
    assert all(g >= 0 for g in out["float32_gaps"]) and out["flip_share"] == out["flips"] / out["positions"]
