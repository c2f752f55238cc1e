"""Verify: offline τ of the exported SGLang directory with the reference engine, end to end on tiny artifacts.

The world is the one of tests/unit/test_export.py (tests/builders.py), exported once per module.
"""

from __future__ import annotations

import json

import pytest

from steps import export, verify
from steps.engine import Engine
from steps.store import open_store
from tests.builders import put_random_draft, tiny_pipeline_config, tiny_target_dir

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
    k = world["cfg"].verify.num_steps
    assert m.kind == "verify" and m.inputs == {"export": world["export_id"], "target": world["target_id"]}
    assert m.metrics["mismatches"] == 0 and m.metrics["prompts"] == 2
    assert 1.0 <= m.metrics["acceptance_length"] <= k + 1
    assert len(m.metrics["per_position_acceptance"]) == k
    assert sum(m.metrics["accept_histogram"]) == m.metrics["verify_steps"] > 0
    assert m.metrics["spec_tokens_per_s"] > 0 and m.metrics["plain_tokens_per_s"] > 0 and m.metrics["speedup"] > 0
    assert m.meta["layer_ids"] == LAYER_IDS and m.meta["dropped_keys"] == [] and m.meta["missing_params"] == []
    report = json.loads(world["store"].fetch_file("verify", m.id, "report.json").read_text())
    assert [r["match"] for r in report["prompts"]] == [True, True]
    assert report["load_report"]["embed_from_target"] is True
    assert verify.run(world["cfg"], world["store"], world["export_id"], world["target_id"]).id == m.id


def test_held_out_prompts_are_chat_templated_mtbench_first_turns(world):
    from transformers import AutoTokenizer

    from steps.target import target_dir

    tok = AutoTokenizer.from_pretrained(target_dir(world["store"], world["target_id"]))
    prompts = verify.held_out_prompts(world["cfg"], tok)
    assert [pid for pid, _ in prompts] == ["mtbench-81", "mtbench-82"]
    text = tok.decode(prompts[0][1])
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")


def test_layer_ids_are_read_back_the_way_sglang_captures_them(world):
    path = export.export_dir(world["store"], world["export_id"], "sglang")
    assert verify.sglang_layer_ids(path) == LAYER_IDS          # eagle_config holds [0, 1, 2]; SGLang adds 1


class AcceptEverything(Engine):
    """A wrong engine: takes every draft without checking it against the target."""

    def speculative_step(self, s):
        d = self.draft_chain(s)
        _, g = self.target_forward([s.x[s.n]] + d, s.target_cache)
        s.feats, s.x = g, s.x + d + [d[-1]]
        return d + [d[-1]], self.k


def test_an_engine_that_changes_the_output_is_caught(world):
    from steps.formats import load_sglang_draft
    from steps.target import load_target

    target, tok = load_target(world["store"], world["target_id"])
    draft, _ = load_sglang_draft(export.export_dir(world["store"], world["export_id"], "sglang"), target=target)
    engine = AcceptEverything(target, tok, draft, layer_ids=LAYER_IDS, num_steps=3)
    _, rows = verify.measure(engine, [("p", [5, 6, 7, 8])], 12, None)
    assert rows[0]["match"] is False and rows[0]["first_diff"] is not None
