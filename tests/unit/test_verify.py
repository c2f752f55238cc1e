"""Verify: offline τ of the exported SGLang directory with the reference engine, end to end on tiny artifacts.

The builders below mirror tests/unit/test_export.py (a test file cannot import another's fixtures).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from steps import export, verify
from steps.config import parse_config
from steps.draft import DraftConfig, Eagle3Draft
from steps.engine import Engine
from steps.store import open_store

V, H, VD, LAYERS = 272, 64, 128, 4
LAYER_IDS = [1, 2, 3]


def hf_target_dir(root: Path) -> Path:
    """A seeded tiny Llama + a byte-level ChatML tokenizer, saved as a Hugging Face directory."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from steps.target import CHATML_TEMPLATE

    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}, merges=[]))
    tk.pre_tokenizer, tk.decoder = ByteLevel(add_prefix_space=False, use_regex=False), decoders.ByteLevel()
    tk.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = CHATML_TEMPLATE
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=LAYERS,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                         eos_token_id=tok.eos_token_id, tie_word_embeddings=True))
    out = root / "target"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def pipeline_config(target_dir: Path, **sections):
    return parse_config({"name": "t", "target": {"source": "hf_dir", "path": str(target_dir)},
                         "extract": {"aux_layer_ids": LAYER_IDS}, "mapping": {"draft_vocab_size": VD},
                         "export": {"dtype": "float32"},
                         "verify": {"num_steps": 3, "num_prompts": 2, "max_new_tokens": 10}, **sections})


def put_draft(store, target_dir: Path, *, num_aux: int = 3, layer_ids=LAYER_IDS, seed: int = 0) -> str:
    """A draft artifact as train writes it: canonical fp32 weights + draft_config.json."""
    from safetensors.torch import load_file as load

    torch.manual_seed(seed)
    cfg = DraftConfig(hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512, vocab_size=V,
                      draft_vocab_size=VD, target_hidden_size=H, num_aux=num_aux)
    draft = Eagle3Draft(cfg)
    ids = torch.randperm(V)[:VD].sort().values
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(load(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"])
        draft.d2t.copy_(ids - torch.arange(VD))
        draft.t2d[ids] = True
    draft_id = f"d{seed}{num_aux}{''.join(map(str, layer_ids))}"
    writer = store.begin("draft", draft_id, step="train")
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, str(writer.path("model.safetensors")))
    meta = {**cfg.to_dict(), "layer_ids": list(layer_ids),
            "target": {"num_hidden_layers": LAYERS, "hidden_size": H, "vocab_size": V,
                       "max_position_embeddings": 512, "name": "tiny"}}
    writer.path("draft_config.json").write_text(json.dumps(meta))
    writer.commit(meta=meta)
    return draft_id


@pytest.fixture(autouse=True)
def one_thread():
    # tiny matmuls: thread hand-off costs more than it saves on a shared 2-core machine
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from steps import target

    root = tmp_path_factory.mktemp("verify")
    tdir = hf_target_dir(root)
    store = open_store(f"file://{root}/store")
    cfg = pipeline_config(tdir)
    target_id = target.run(cfg, store).id
    export_id = export.run(cfg, store, put_draft(store, tdir), target_id).id
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
