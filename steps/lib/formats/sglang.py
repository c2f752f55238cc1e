"""The SGLang draft directory: `LlamaForCausalLMEagle3`, the official EAGLE-3 key layout (`midlayer.*`),
aux layer ids in `eagle_config` in SGLang's convention (internal − 1), and SGLang 0.5.23's own key rules
as data (`resolve`), so that a checker can say which keys SGLang would drop without a word.

Sources the tables below were read from (cite when changing them):
- SGLang 0.5.23 wheel, `python/sglang/srt/models/llama_eagle3.py`: `LlamaModel.__init__` (parameter
  names, fc width), `LlamaForCausalLMEagle3.__init__` (`draft_vocab_size`, tied head) and
  `load_weights` (`legacy_name_map`, d2t/t2d, `stacked_params_mapping`, `model.` fallback).
  Same logic at sgl-project/sglang@03d5a7771f6082e7737a5f19cae7d1e863087013 minus `legacy_name_map`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from steps.lib.formats.common import (
    CANONICAL_KEYS,
    CONFIG_FILE,
    STACKED_PARAMS,
    EngineFormat,
    Resolution,
    llama_layer_fields,
)
from steps.lib.layer_ids import from_engine, to_engine

#: canonical name → key: SGLang keeps the official EAGLE-3 layout (`midlayer.*`): every SGLang version
#: loads it (0.5.23 also renames it to `layers.0`, older ones only know `midlayer`).
KEY_MAP = {k: k for k in CANONICAL_KEYS}
#: the chain length SGLang 0.5.23 chooses when a launch names none (`_auto_choose_speculative_params`: 3/1/4
#: for most targets); what the reference server and doctor assume for a server that does not say.
AUTO_NUM_STEPS = 3
ARCHITECTURES = ["LlamaForCausalLMEagle3"]

# --- SGLang 0.5.23 LlamaForCausalLMEagle3.load_weights, as data --------------------------------------

#: `legacy_name_map`: substring renames applied to every key first.
LEGACY_NAME_MAP = {"midlayer": "layers.0", "aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1",
                          "aux_norm_high": "fc_norm.2"}
#: (SGLang parameter, shard) → canonical name, for a 1-layer draft without fc bias or fc norms.
PARAMS: dict[tuple[str, Any], str] = {
    ("model.embed_tokens.weight", None): "embed_tokens.weight",
    ("model.fc.weight", None): "fc.weight",
    ("model.layers.0.input_layernorm.weight", None): "midlayer.input_layernorm.weight",
    ("model.layers.0.hidden_norm.weight", None): "midlayer.hidden_norm.weight",
    ("model.layers.0.post_attention_layernorm.weight", None): "midlayer.post_attention_layernorm.weight",
    ("model.layers.0.self_attn.qkv_proj.weight", "q"): "midlayer.self_attn.q_proj.weight",
    ("model.layers.0.self_attn.qkv_proj.weight", "k"): "midlayer.self_attn.k_proj.weight",
    ("model.layers.0.self_attn.qkv_proj.weight", "v"): "midlayer.self_attn.v_proj.weight",
    ("model.layers.0.self_attn.o_proj.weight", None): "midlayer.self_attn.o_proj.weight",
    ("model.layers.0.mlp.gate_up_proj.weight", 0): "midlayer.mlp.gate_proj.weight",
    ("model.layers.0.mlp.gate_up_proj.weight", 1): "midlayer.mlp.up_proj.weight",
    ("model.layers.0.mlp.down_proj.weight", None): "midlayer.mlp.down_proj.weight",
    ("model.norm.weight", None): "norm.weight",
    ("lm_head.weight", None): "lm_head.weight",
}
PARAM_NAMES = frozenset(p for p, _ in PARAMS)


def resolve(name: str) -> Resolution:
    """SGLang 0.5.23 `load_weights` for one key: where it lands, or that it is dropped without a word."""
    for legacy, new in LEGACY_NAME_MAP.items():
        if legacy in name:
            name = name.replace(legacy, new)
    if "d2t" in name:
        return Resolution("hot_token_id", canonical="d2t")
    if "t2d" in name:
        return Resolution("ignored", canonical="t2d")
    shard = None
    for fused, part, shard_id in STACKED_PARAMS:
        if part in name:
            name, shard = name.replace(part, fused), shard_id
            break
    param = name if name in PARAM_NAMES else f"model.{name}"
    if (param, shard) in PARAMS:
        return Resolution("param", param, shard, PARAMS[(param, shard)])
    return Resolution("dropped")


# --- config.json ------------------------------------------------------------------------------------

def build_config(draft: dict[str, Any], *, layer_ids: list[int], max_position_embeddings: int,
                  dtype: str, verifier_architectures: list[str] | None = None, **_: Any) -> dict[str, Any]:
    """`LlamaForCausalLMEagle3` config.json; aux ids in SGLang's convention inside `eagle_config` (F4, F7)."""
    return {
        "architectures": ARCHITECTURES,
        **llama_layer_fields(draft, max_position_embeddings=max_position_embeddings, dtype=dtype),
        # explicit: missing → AttributeError at startup, null → the target's head replaces ours (F7).
        "draft_vocab_size": draft["draft_vocab_size"],
        "target_hidden_size": draft["target_hidden_size"],
        "bias": False,
        # only eagle_config is read for target capture; SGLang adds +1 to these ids (for some target
        # families only when the first is 1: the conversion is per the target's architecture).
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": to_engine(layer_ids, "sglang",
                                                                       (verifier_architectures or [None])[0]),
                         "use_aux_hidden_state": True},
    }


def layer_config(config: dict[str, Any]) -> dict[str, Any]:
    """SGLang's Llama layer fields sit at the top level of config.json."""
    return config


def layer_ids(config: dict[str, Any]) -> list[int] | None:
    """`eagle_config.eagle_aux_hidden_state_layer_ids` (the only place SGLang reads capture ids), or None."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if isinstance(ids, list) else None


def sglang_layer_ids(sglang_dir: Path, target_arch: str | None = None) -> list[int]:
    """The layers SGLang would capture for this draft directory on a `target_arch` target, internal
    convention (its +1 applied as that target's model class applies it)."""
    config = json.loads((Path(sglang_dir) / CONFIG_FILE).read_text())
    ids = layer_ids(config)
    if not ids:
        raise ValueError(f"{Path(sglang_dir) / CONFIG_FILE}: no eagle_config.eagle_aux_hidden_state_layer_ids; "
                         "SGLang would capture its defaults, not the trained layers (F4)")
    return from_engine(ids, "sglang", target_arch)


#: config fields checked for exact equality (F7): (dotted field, value, what goes wrong otherwise,
#: whether the engine's loader itself needs it — all doctor asks of a draft trained elsewhere).
FIXED_FIELDS: list[tuple[str, Any, str, bool]] = [
    ("architectures", ["LlamaForCausalLMEagle3"], "SGLang would load another class (crash at startup on "
     "hot_token_id, or a plain Llama)", True),
    ("model_type", "llama", "SGLang builds the config class from it", True),
    ("num_hidden_layers", 1, "eaglenest drafts have one layer; more would add random layers", False),
    ("tie_word_embeddings", False, "a tied head would replace the trained lm_head by the embedding", True),
]
#: fields that must exist with a value of the right type (eaglenest writes them all).
REQUIRED_FIELDS: list[tuple[str, type | tuple[type, ...]]] = [
    ("draft_vocab_size", int), ("vocab_size", int), ("hidden_size", int), ("intermediate_size", int),
    ("num_attention_heads", int), ("num_key_value_heads", int), ("head_dim", int), ("rms_norm_eps", (int, float)),
    ("max_position_embeddings", int), ("target_hidden_size", int), ("torch_dtype", str),
]

FORMAT = EngineFormat(name="sglang", key_map=KEY_MAP, architectures=ARCHITECTURES, resolve=resolve,
                      build_config=build_config, layer_config=layer_config, layer_ids=layer_ids,
                      fixed_fields=FIXED_FIELDS, required_fields=REQUIRED_FIELDS)
