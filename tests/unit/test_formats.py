"""Engine formats: exact key sets per engine, the strict checker, and SGLang's lenient loading rules.

Key sets are pinned against the loaders they were read from:
- SGLang 0.5.23 wheel `python/sglang/srt/models/llama_eagle3.py` (`LlamaForCausalLMEagle3.load_weights`,
  `LlamaModel.__init__`); same file at sgl-project/sglang@03d5a7771f6082e7737a5f19cae7d1e863087013.
- vllm-project/speculators@c05b95b303f7d4f21e8d7624e0ffa1c2d9b4d73b `src/speculators/models/eagle3/core.py`
  (`Eagle3DraftModel` parameters; `verifier_norm` / `verifier_lm_head` are not saved) and
  vllm-project/vllm@00bd1493b3e82d6c13c68ee8a0e1c5a96707e190 `vllm/model_executor/models/llama_eagle3.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from steps.lib import formats
from steps.lib.checks import strict
from steps.lib.formats.sglang_loader import load_sglang_draft
from steps.lib.model.draft import DraftConfig, Eagle3Draft
from tests.builders import CANONICAL_DRAFT_KEYS, SPECULATORS_DRAFT_KEYS

V, VD, H = 96, 48, 64
LAYER_IDS = [1, 2, 3]          # internal convention
CONTEXT = 512
EXPECT = {"layer_ids": LAYER_IDS, "vocab_size": V, "hidden_size": H, "context_length": CONTEXT,
          "draft_vocab_size": VD, "dtype": "float32"}

#: what SGLang's EAGLE-3 drafts (SpecForge, EAGLE official) and eaglenest write: the `midlayer.` layout.
SGLANG_KEYS = CANONICAL_DRAFT_KEYS
#: speculators `Eagle3DraftModel.state_dict()` minus `_keys_to_ignore_on_save` (verifier_*), one Llama layer
#: (written out in tests/builders.py, not derived from SGLANG_KEYS).
SPECULATORS_KEYS = SPECULATORS_DRAFT_KEYS

#: where SGLang 0.5.23's `LlamaForCausalLMEagle3.load_weights` puts each key eaglenest writes
#: (shared/reference/sglang.md §1.3: `midlayer` -> `layers.0`; q/k/v -> `qkv_proj` shards "q"/"k"/"v";
#: gate/up -> `gate_up_proj` shards 0/1; `model.` prefix except the top-level lm_head; d2t -> hot_token_id;
#: t2d ignored), written out by hand from the loader, not from steps/lib/formats.py's tables.
SGLANG_LANDS = {
    "embed_tokens.weight": ("param", "model.embed_tokens.weight", None),
    "fc.weight": ("param", "model.fc.weight", None),
    "norm.weight": ("param", "model.norm.weight", None),
    "lm_head.weight": ("param", "lm_head.weight", None),
    "midlayer.input_layernorm.weight": ("param", "model.layers.0.input_layernorm.weight", None),
    "midlayer.hidden_norm.weight": ("param", "model.layers.0.hidden_norm.weight", None),
    "midlayer.post_attention_layernorm.weight": ("param", "model.layers.0.post_attention_layernorm.weight", None),
    "midlayer.self_attn.q_proj.weight": ("param", "model.layers.0.self_attn.qkv_proj.weight", "q"),
    "midlayer.self_attn.k_proj.weight": ("param", "model.layers.0.self_attn.qkv_proj.weight", "k"),
    "midlayer.self_attn.v_proj.weight": ("param", "model.layers.0.self_attn.qkv_proj.weight", "v"),
    "midlayer.self_attn.o_proj.weight": ("param", "model.layers.0.self_attn.o_proj.weight", None),
    "midlayer.mlp.gate_proj.weight": ("param", "model.layers.0.mlp.gate_up_proj.weight", 0),
    "midlayer.mlp.up_proj.weight": ("param", "model.layers.0.mlp.gate_up_proj.weight", 1),
    "midlayer.mlp.down_proj.weight": ("param", "model.layers.0.mlp.down_proj.weight", None),
    "d2t": ("hot_token_id", None, None),
    "t2d": ("ignored", None, None),
}
#: the same for vLLM's `Eagle3LlamaForCausalLM.load_weights` on the speculators names (trainers.md §6.2: same
#: module tree under `model.`, stacked q/k/v and gate/up; `d2t` -> `draft_id_to_target_id`; t2d skipped).
VLLM_LANDS = {
    "embed_tokens.weight": ("param", "model.embed_tokens.weight", None),
    "fc.weight": ("param", "model.fc.weight", None),
    "norm.weight": ("param", "model.norm.weight", None),
    "lm_head.weight": ("param", "lm_head.weight", None),
    "layers.0.input_layernorm.weight": ("param", "model.layers.0.input_layernorm.weight", None),
    "layers.0.hidden_norm.weight": ("param", "model.layers.0.hidden_norm.weight", None),
    "layers.0.post_attention_layernorm.weight": ("param", "model.layers.0.post_attention_layernorm.weight", None),
    "layers.0.self_attn.q_proj.weight": ("param", "model.layers.0.self_attn.qkv_proj.weight", "q"),
    "layers.0.self_attn.k_proj.weight": ("param", "model.layers.0.self_attn.qkv_proj.weight", "k"),
    "layers.0.self_attn.v_proj.weight": ("param", "model.layers.0.self_attn.qkv_proj.weight", "v"),
    "layers.0.self_attn.o_proj.weight": ("param", "model.layers.0.self_attn.o_proj.weight", None),
    "layers.0.mlp.gate_proj.weight": ("param", "model.layers.0.mlp.gate_up_proj.weight", 0),
    "layers.0.mlp.up_proj.weight": ("param", "model.layers.0.mlp.gate_up_proj.weight", 1),
    "layers.0.mlp.down_proj.weight": ("param", "model.layers.0.mlp.down_proj.weight", None),
    "d2t": ("param", "draft_id_to_target_id", None),
    "t2d": ("ignored", None, None),
}


def draft_config(**kw) -> DraftConfig:
    base = dict(hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=CONTEXT, vocab_size=V,
                draft_vocab_size=VD, target_hidden_size=H, num_aux=len(LAYER_IDS))
    return DraftConfig(**{**base, **kw})


def random_draft(seed: int = 0) -> Eagle3Draft:
    """Every tensor random (norms too, so a weight that fails to load shows in the logits)."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(draft_config()).eval()
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
        ids = torch.randperm(V)[:VD].sort().values
        draft.d2t.copy_(ids - torch.arange(VD))
        draft.t2d.zero_()
        draft.t2d[ids] = True
    return draft


def write(tmp: Path, engine: str, draft: Eagle3Draft, dtype: str = "float32") -> Path:
    fields = draft.cfg.to_dict()
    cfg = formats.CONFIG_BUILDERS[engine](fields, layer_ids=LAYER_IDS, max_position_embeddings=CONTEXT, dtype=dtype,
                                          verifier_name_or_path="tiny-target",
                                          verifier_architectures=["LlamaForCausalLM"], speculative_tokens=3)
    return formats.write_engine_dir(tmp / engine, engine, draft.state_dict(), cfg, dtype=dtype)


def rewrite(path: Path, *, tensors=None, config=None) -> Path:
    """Apply a fault to an engine directory in place."""
    if tensors is not None:
        t = load_file(str(path / formats.WEIGHTS_FILE))
        save_file(tensors(t) or t, str(path / formats.WEIGHTS_FILE))
    if config is not None:
        c = json.loads((path / formats.CONFIG_FILE).read_text())
        (path / formats.CONFIG_FILE).write_text(json.dumps(config(c) or c))
    return path


def draft_logits(draft: Eagle3Draft, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (1, 6), generator=g)
    hidden = torch.randn(1, 6, len(LAYER_IDS) * H, generator=g)
    with torch.no_grad():
        return draft(ids, hidden, torch.arange(6)[None])[0]


# --- exact key sets --------------------------------------------------------------------------------------

def test_key_maps_write_the_midlayer_layout_for_sglang_and_layers0_for_vllm():
    assert set(formats.KEY_MAPS["sglang"].values()) == SGLANG_KEYS
    assert set(formats.KEY_MAPS["vllm"].values()) == SPECULATORS_KEYS
    assert set(formats.KEY_MAPS["sglang"]) == set(formats.CANONICAL_KEYS) == set(random_draft().state_dict())


def test_sglang_export_keys_are_exactly_what_sglang_0_5_23_load_weights_accepts(tmp_path):
    """Derived from sglang 0.5.23 python/sglang/srt/models/llama_eagle3.py load_weights: every written key
    lands in a parameter (shard) or the hot-token map, and every parameter (shard) receives one key."""
    keys = set(load_file(str(write(tmp_path, "sglang", random_draft()) / formats.WEIGHTS_FILE)))
    assert keys == SGLANG_KEYS
    res = {k: formats.sglang.resolve(k) for k in keys}
    assert {k: (r.action, r.param, r.shard) for k, r in res.items()} == SGLANG_LANDS   # each shard exactly once
    assert res["midlayer.self_attn.k_proj.weight"] == formats.Resolution(
        "param", "model.layers.0.self_attn.qkv_proj.weight", "k", "midlayer.self_attn.k_proj.weight")


def test_vllm_export_keys_are_exactly_the_speculators_eagle3_keys_vllm_loads(tmp_path):
    """Derived from speculators src/speculators/models/eagle3/core.py (Eagle3DraftModel) and vLLM
    vllm/model_executor/models/llama_eagle3.py Eagle3LlamaForCausalLM.load_weights."""
    keys = set(load_file(str(write(tmp_path, "vllm", random_draft()) / formats.WEIGHTS_FILE)))
    assert keys == SPECULATORS_KEYS
    res = {k: formats.speculators.resolve(k) for k in keys}
    assert {k: (r.action, r.param, r.shard) for k, r in res.items()} == VLLM_LANDS


@pytest.mark.parametrize("key,expected", [
    ("midlayer.mlp.up_proj.weight", ("model.layers.0.mlp.gate_up_proj.weight", 1)),
    ("layers.0.mlp.up_proj.weight", ("model.layers.0.mlp.gate_up_proj.weight", 1)),
    ("model.midlayer.hidden_norm.weight", ("model.layers.0.hidden_norm.weight", None)),
    ("model.fc.weight", ("model.fc.weight", None)),
    ("lm_head.weight", ("lm_head.weight", None)),
    ("model.lm_head.weight", None), ("draft_model.fc.weight", None), ("transformer.norm.weight", None),
    ("model.model.fc.weight", None), ("midlayer.self_attn.q_norm.weight", None),
])
def test_sglang_rules_accept_midlayer_layers0_and_model_prefix_and_drop_everything_else(key, expected):
    r = formats.sglang.resolve(key)
    assert (None if r.action == "dropped" else (r.param, r.shard)) == expected


# --- config.json builders -----------------------------------------------------------------------------------

def test_sglang_config_has_explicit_vocab_sizes_and_sglang_layer_ids(tmp_path):
    from transformers import LlamaConfig

    cfg = json.loads((write(tmp_path, "sglang", random_draft()) / formats.CONFIG_FILE).read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert (cfg["draft_vocab_size"], cfg["vocab_size"], cfg["target_hidden_size"]) == (VD, V, H)
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True}
    assert cfg["tie_word_embeddings"] is False and cfg["num_hidden_layers"] == 1
    hf = LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})   # what SGLang builds from it
    assert hf.draft_vocab_size == VD and hf.max_position_embeddings == CONTEXT


def test_vllm_config_is_the_speculators_format_with_vllm_layer_ids(tmp_path):
    cfg = json.loads((write(tmp_path, "vllm", random_draft()) / formats.CONFIG_FILE).read_text())
    assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["speculators_model_type"] == "eagle3"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == LAYER_IDS
    assert cfg["transformer_layer_config"]["vocab_size"] == V and cfg["draft_vocab_size"] == VD
    sc = cfg["speculators_config"]
    assert sc["proposal_methods"][0] == {"proposal_type": "greedy", "speculative_tokens": 3,
                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}
    assert sc["default_proposal_method"] == "greedy" and sc["verifier"]["name_or_path"] == "tiny-target"
    assert cfg["norm_before_residual"] is False


# --- the strict checker -------------------------------------------------------------------------------------

@pytest.mark.parametrize("engine", formats.ENGINES)
def test_written_directories_pass_the_strict_checker(tmp_path, engine):
    path = write(tmp_path, engine, random_draft())
    assert strict.check_engine_dir(path, engine, expect=EXPECT) == []
    strict.assert_engine_dir(path, engine, expect=EXPECT)


def _without(key):
    def drop(d):
        d.pop(key)
    return drop


def _prefix(t):
    return {f"draft_model.{k}": v for k, v in t.items()}


FAULTS = {
    "unknown_prefix": (dict(tensors=_prefix), "draft_model.fc.weight", "F2"),
    "missing_key": (dict(tensors=_without("fc.weight")), "fc.weight", "F2"),
    "wrong_shape": (dict(tensors=lambda t: t.update({"fc.weight": t["fc.weight"][:, :2 * H].contiguous()})),
                    "fc.weight", "F2"),
    "float_d2t": (dict(tensors=lambda t: t.update({"d2t": t["d2t"].float()})), ":d2t", "F3"),
    "absolute_d2t": (dict(tensors=lambda t: t.update({"d2t": t["d2t"] + torch.arange(VD)})), ":d2t", "F3"),
    "missing_draft_vocab_size": (dict(config=_without("draft_vocab_size")), "draft_vocab_size",
                                 "F7"),
    "wrong_architectures": (dict(config=lambda c: c.update(architectures=["LlamaForCausalLM"])), "architectures",
                            "F7"),
    "layer_ids_off_by_one": (dict(config=lambda c: c["eagle_config"].update(
        eagle_aux_hidden_state_layer_ids=LAYER_IDS)), "eagle_aux_hidden_state_layer_ids", "F4"),
    "short_context": (dict(config=lambda c: c.update(max_position_embeddings=CONTEXT // 2)),
                      "max_position_embeddings", "F5"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_the_strict_checker_names_each_fault_with_its_catalogue_row(tmp_path, fault):
    change, where, row = FAULTS[fault]
    path = rewrite(write(tmp_path, "sglang", random_draft()), **change)
    findings = strict.check_engine_dir(path, "sglang", expect=EXPECT)
    assert any(where in f.where and f.id == row for f in findings), [str(f) for f in findings]
    with pytest.raises(strict.FormatError, match=row):
        strict.assert_engine_dir(path, "sglang", expect=EXPECT)


def test_vllm_layer_ids_in_sglang_convention_are_caught(tmp_path):
    path = rewrite(write(tmp_path, "vllm", random_draft()),
                   config=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 2]))
    findings = strict.check_engine_dir(path, "vllm", expect=EXPECT)
    assert [f.id for f in findings] == ["F4"] and "internal [0, 1, 2]" in findings[0].evidence


def test_sglang_names_in_a_vllm_directory_are_unknown_keys(tmp_path):
    path = rewrite(write(tmp_path, "vllm", random_draft()),
                   tensors=lambda t: {k.replace("layers.0.", "midlayer."): v for k, v in t.items()})
    findings = strict.check_engine_dir(path, "vllm", expect=EXPECT)
    assert {f.id for f in findings} == {"F2"}
    assert sum("unknown" in f.evidence or "not the exact name" in f.evidence for f in findings) == 10


# --- the lenient loader (SGLang's rules) -------------------------------------------------------------------

def test_an_fp32_sglang_export_reloads_to_the_same_logits(tmp_path):
    draft = random_draft()
    loaded, report = load_sglang_draft(write(tmp_path, "sglang", draft))
    assert report.dropped == [] and report.missing == [] and report.hot_token_ids
    assert report.ignored == ["t2d"]
    assert torch.equal(loaded.d2t, draft.d2t)
    assert torch.equal(draft_logits(loaded), draft_logits(draft))


def test_a_bf16_sglang_export_reloads_to_the_bf16_rounded_drafts_logits(tmp_path):
    draft = random_draft()
    loaded, _ = load_sglang_draft(write(tmp_path, "sglang", draft, dtype="bfloat16"))
    rounded = random_draft()
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    assert torch.allclose(draft_logits(loaded), draft_logits(rounded), atol=1e-5)
    assert not torch.allclose(draft_logits(loaded), draft_logits(draft), atol=1e-5)   # rounding is visible


def test_an_unknown_prefixed_key_is_dropped_silently_but_reported(tmp_path):
    draft = random_draft()
    path = rewrite(write(tmp_path, "sglang", draft),
                   tensors=lambda t: t.update({"draft_model.fc.weight": torch.zeros_like(t["fc.weight"])}))
    loaded, report = load_sglang_draft(path)          # no error, as in SGLang
    assert report.dropped == ["draft_model.fc.weight"] and report.missing == []
    assert torch.equal(draft_logits(loaded), draft_logits(draft))


def test_a_fully_prefixed_checkpoint_leaves_a_random_draft_and_says_so(tmp_path):
    draft = random_draft()
    path = rewrite(write(tmp_path, "sglang", draft), tensors=_prefix)
    loaded, report = load_sglang_draft(path)
    # every key dropped but d2t and t2d, which SGLang matches by substring ("d2t" in name, "t2d" in name)
    assert sorted(report.dropped) == sorted(f"draft_model.{k}" for k in SGLANG_KEYS - {"d2t", "t2d"})
    assert report.hot_token_ids
    assert "midlayer.self_attn.q_proj.weight" in report.missing and "fc.weight" in report.missing
    assert not torch.allclose(draft_logits(loaded), draft_logits(draft), atol=1e-3)


def test_layers0_and_model_prefixed_keys_load_as_in_sglang_0_5_23(tmp_path):
    draft = random_draft()
    path = rewrite(write(tmp_path, "sglang", draft), tensors=lambda t: {
        ("model." + k.replace("midlayer.", "layers.0.") if k != "lm_head.weight" else k): v for k, v in t.items()})
    loaded, report = load_sglang_draft(path)
    assert report.dropped == [] and report.missing == []
    assert torch.equal(draft_logits(loaded), draft_logits(draft))


def test_missing_d2t_makes_draft_ids_target_ids(tmp_path):
    path = rewrite(write(tmp_path, "sglang", random_draft()), tensors=_without("d2t"))
    loaded, report = load_sglang_draft(path)
    assert not report.hot_token_ids and torch.equal(loaded.d2t, torch.zeros(VD, dtype=torch.int64))


def test_missing_draft_vocab_size_fails_like_sglang(tmp_path):
    path = rewrite(write(tmp_path, "sglang", random_draft()), config=_without("draft_vocab_size"))
    with pytest.raises(AttributeError, match="draft_vocab_size"):
        load_sglang_draft(path)


def test_a_speculators_directory_is_refused_like_sglang_does(tmp_path):
    with pytest.raises(ValueError, match="model_type"):
        load_sglang_draft(write(tmp_path, "vllm", random_draft()))


def test_the_targets_embedding_replaces_the_drafts(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2))
    path = rewrite(write(tmp_path, "sglang", random_draft()), tensors=_without("embed_tokens.weight"))
    loaded, report = load_sglang_draft(path, target=target)
    assert report.embed_from_target and report.missing == []
    assert torch.equal(loaded.embed_tokens.weight, target.get_input_embeddings().weight)
