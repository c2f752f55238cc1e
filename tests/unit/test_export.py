"""Export: one draft artifact → strictly checked SGLang and vLLM directories, or no artifact at all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from steps import export, formats
from steps.config import parse_config
from steps.draft import DraftConfig, Eagle3Draft
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


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from steps import target

    root = tmp_path_factory.mktemp("export")
    tdir = hf_target_dir(root)
    store = open_store(f"file://{root}/store")
    cfg = pipeline_config(tdir)
    return {"root": root, "tdir": tdir, "store": store, "cfg": cfg, "target_id": target.run(cfg, store).id,
            "draft_id": put_draft(store, tdir)}


def test_export_writes_both_engines_with_their_layer_ids_and_passes_the_checker(world):
    m = export.run(world["cfg"], world["store"], world["draft_id"], world["target_id"])
    assert m.kind == "export" and m.inputs == {"draft": world["draft_id"], "target": world["target_id"]}
    assert m.meta["engines"]["sglang"]["layer_ids"] == [0, 1, 2]
    assert m.meta["engines"]["vllm"]["layer_ids"] == [1, 2, 3]
    assert m.metrics["num_keys"] == {"sglang": 16, "vllm": 16}
    assert {f["path"] for f in m.files} == {"sglang/config.json", "sglang/model.safetensors",
                                            "vllm/config.json", "vllm/model.safetensors"}
    for engine in ("sglang", "vllm"):
        path = export.export_dir(world["store"], m.id, engine)
        assert formats.check_engine_dir(path, engine, expect={"layer_ids": LAYER_IDS, "vocab_size": V}) == []
        weights = load_file(str(path / "model.safetensors"))
        assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    assert export.run(world["cfg"], world["store"], world["draft_id"], world["target_id"]).id == m.id


def test_an_exported_sglang_dir_serves_the_trained_weights(world):
    from steps.train import load_draft

    m = export.run(world["cfg"], world["store"], world["draft_id"], world["target_id"])
    draft, _ = load_draft(world["store"], world["draft_id"])
    loaded, report = formats.load_sglang_draft(export.export_dir(world["store"], m.id, "sglang"))
    assert report.dropped == [] and report.missing == []
    ids, hidden = torch.randint(0, V, (1, 5)), torch.randn(1, 5, 3 * H)
    with torch.no_grad():
        assert torch.equal(loaded(ids, hidden, torch.arange(5)[None])[0], draft(ids, hidden, torch.arange(5)[None])[0])


def test_max_position_embeddings_comes_from_the_target_context_not_the_draft(world):
    cfg = pipeline_config(world["tdir"], target={"source": "hf_dir", "path": str(world["tdir"]),
                                                 "context_length": 4096})
    m = export.run(cfg, world["store"], world["draft_id"], world["target_id"])
    sg = json.loads((export.export_dir(world["store"], m.id, "sglang") / "config.json").read_text())
    vl = json.loads((export.export_dir(world["store"], m.id, "vllm") / "config.json").read_text())
    assert sg["max_position_embeddings"] == vl["transformer_layer_config"]["max_position_embeddings"] == 4096
    assert m.meta["draft_max_position_embeddings"] == 512


def test_a_draft_whose_fc_width_disagrees_with_its_layer_ids_leaves_no_artifact(world):
    bad = put_draft(world["store"], world["tdir"], num_aux=2, seed=1)       # fc reads 2 aux, ids name 3
    with pytest.raises(formats.FormatError, match="fc.weight"):
        export.run(world["cfg"], world["store"], bad, world["target_id"])
    exported_inputs = [world["store"].manifest("export", i).inputs["draft"] for i in world["store"].list("export")]
    assert bad not in exported_inputs


def test_layer_ids_the_engines_cannot_capture_are_refused(world):
    bad = put_draft(world["store"], world["tdir"], layer_ids=[1, 2, 4], seed=2)   # 4 = the last layer's output
    with pytest.raises(ValueError, match="cannot be captured"):
        export.run(world["cfg"], world["store"], bad, world["target_id"])


def test_export_dir_names_the_missing_engine(world):
    cfg = pipeline_config(world["tdir"], export={"engines": ["sglang"], "dtype": "float32"})
    m = export.run(cfg, world["store"], world["draft_id"], world["target_id"])
    with pytest.raises(KeyError, match="vllm"):
        export.export_dir(world["store"], m.id, "vllm")


def test_the_cli_prints_the_export_id(world, tmp_path, capsys):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump(world["cfg"].model_dump(mode="json")))
    rc = export.main(["--config", str(cfg_file), "--store", world["store"].uri, "--draft", world["draft_id"],
                      "--target", world["target_id"]])
    out = capsys.readouterr().out.strip()
    assert rc == 0 and world["store"].exists("export", out)
