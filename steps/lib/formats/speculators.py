"""The vLLM draft directory: the speculators format (`Eagle3Speculator`), which vLLM auto-detects. The
draft layer is `layers.0.*`, the Llama fields nest under `transformer_layer_config`, and aux layer ids sit
at the top level in the internal convention (vLLM adds nothing).

Sources the tables below were read from (cite when changing them):
- vllm-project/speculators@c05b95b303f7d4f21e8d7624e0ffa1c2d9b4d73b:
  `src/speculators/models/eagle3/config.py` (`Eagle3SpeculatorConfig` fields),
  `src/speculators/models/eagle3/core.py` (`Eagle3DraftModel` parameter names, `verifier_*` not saved),
  `src/speculators/convert/eagle/eagle3_converter.py` (`midlayer.` → `layers.0.`, speculators_config),
  `src/speculators/config.py` (`SpeculatorsConfig`, `VerifierConfig`), `src/speculators/proposals/greedy.py`.
- vllm-project/vllm@00bd1493b3e82d6c13c68ee8a0e1c5a96707e190 `vllm/model_executor/models/llama_eagle3.py`
  (`Eagle3LlamaForCausalLM.load_weights`: t2d skipped, d2t → `draft_id_to_target_id`, `model.` prefix).
"""

from __future__ import annotations

from typing import Any

from steps.lib.formats import sglang
from steps.lib.formats.common import CANONICAL_KEYS, STACKED_PARAMS, EngineFormat, Resolution, llama_layer_fields
from steps.lib.layer_ids import to_engine

#: the speculators release whose format the vLLM directory follows.
SPECULATORS_VERSION = "0.9.0"
#: canonical name → key: speculators/vLLM name the layer `layers.0.*` (Eagle3DraftModel.layers).
KEY_MAP = {k: k.replace("midlayer.", "layers.0.", 1) for k in CANONICAL_KEYS}
ARCHITECTURES = ["Eagle3Speculator"]

#: vLLM Eagle3LlamaForCausalLM parameters (speculators format is converted to this) → canonical.
PARAMS: dict[tuple[str, Any], str] = {
    # same module names as SGLang's (LlamaModel under `model.`, fused qkv / gate_up, top-level lm_head)
    **sglang.PARAMS,
    ("draft_id_to_target_id", None): "d2t",
}


def resolve(name: str) -> Resolution:
    """vLLM `Eagle3LlamaForCausalLM.load_weights` for one key (unknown names raise there, loudly)."""
    if "t2d" in name:
        return Resolution("ignored", canonical="t2d")
    if "d2t" in name:
        return Resolution("param", "draft_id_to_target_id", None, "d2t")
    if "lm_head" not in name:
        name = "model." + name
    name = name.replace("midlayer.", "layers.0.")
    shard = None
    for fused, part, shard_id in STACKED_PARAMS:   # vLLM's stacked_params_mapping is the same table
        if part in name:
            name, shard = name.replace(part, fused), shard_id
            break
    if (name, shard) in PARAMS:
        return Resolution("param", name, shard, PARAMS[(name, shard)])
    return Resolution("dropped")


# --- config.json ------------------------------------------------------------------------------------

def build_config(draft: dict[str, Any], *, layer_ids: list[int], max_position_embeddings: int, dtype: str,
                verifier_name_or_path: str, verifier_architectures: list[str], speculative_tokens: int,
                **_: Any) -> dict[str, Any]:
    """speculators `Eagle3SpeculatorConfig` config.json (vLLM auto-detects it); ids unchanged (F4)."""
    return {
        "architectures": ARCHITECTURES,
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": llama_layer_fields(draft, max_position_embeddings=max_position_embeddings,
                                                        dtype=dtype),
        "draft_vocab_size": draft["draft_vocab_size"],
        "target_hidden_size": draft["target_hidden_size"],
        "eagle_aux_hidden_state_layer_ids": to_engine(layer_ids, "vllm"),
        # our draft keeps the pre-norm hidden as the residual (SGLang layer 0 does the same).
        "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
        "embed_requires_grad": False,
        "torch_dtype": dtype,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": list(verifier_architectures)},
        },
    }


def layer_config(config: dict[str, Any]) -> dict[str, Any]:
    """speculators nests the Llama layer fields under `transformer_layer_config`."""
    return dict(config.get("transformer_layer_config") or {})


def layer_ids(config: dict[str, Any]) -> list[int] | None:
    """The top-level `eagle_aux_hidden_state_layer_ids` vLLM reads, or None."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if isinstance(ids, list) else None


#: config fields checked for exact equality (F7): (dotted field, value, what goes wrong otherwise,
#: whether the engine's loader itself needs it — all doctor asks of a draft trained elsewhere).
FIXED_FIELDS: list[tuple[str, Any, str, bool]] = [
    ("architectures", ["Eagle3Speculator"], "vLLM would not detect the speculators format", False),
    ("speculators_model_type", "eagle3", "vLLM picks the algorithm from it", True),
    ("transformer_layer_config.model_type", "llama", "the draft layer is a Llama layer", False),
    ("transformer_layer_config.num_hidden_layers", 1, "eaglenest drafts have one layer", False),
    ("transformer_layer_config.tie_word_embeddings", False, "a tied head drops the trained lm_head", True),
    ("norm_before_residual", False, "the residual would be taken after hidden_norm, unlike training", False),
    ("speculators_config.algorithm", "eagle3", "vLLM would run another algorithm", False),
    ("speculators_config.default_proposal_method", "greedy", "must name a proposal method", False),
]
#: fields that must exist with a value of the right type (eaglenest writes them all).
REQUIRED_FIELDS: list[tuple[str, type | tuple[type, ...]]] = [
    ("draft_vocab_size", int), ("target_hidden_size", int), ("transformer_layer_config.vocab_size", int),
    ("transformer_layer_config.hidden_size", int), ("transformer_layer_config.intermediate_size", int),
    ("transformer_layer_config.num_attention_heads", int), ("transformer_layer_config.num_key_value_heads", int),
    ("transformer_layer_config.head_dim", int), ("transformer_layer_config.rms_norm_eps", (int, float)),
    ("transformer_layer_config.max_position_embeddings", int), ("speculators_config.proposal_methods", list),
    ("speculators_config.verifier.name_or_path", str), ("speculators_config.verifier.architectures", list),
    ("speculators_version", str), ("transformer_layer_config.torch_dtype", str),
]

def config_problems(config: dict[str, Any]) -> list[tuple[str, str]]:
    """What a field-by-field check cannot see: vLLM needs a greedy proposal method with ≥ 1 token."""
    methods = (config.get("speculators_config") or {}).get("proposal_methods")
    if isinstance(methods, list) and not any(isinstance(m, dict) and m.get("proposal_type") == "greedy"
                                             and isinstance(m.get("speculative_tokens"), int)
                                             and m["speculative_tokens"] >= 1 for m in methods):
        return [("speculators_config.proposal_methods",
                 f"needs a greedy method with speculative_tokens ≥ 1, got {methods!r}")]
    return []


FORMAT = EngineFormat(name="vllm", key_map=KEY_MAP, architectures=ARCHITECTURES, resolve=resolve,
                      build_config=build_config, layer_config=layer_config, layer_ids=layer_ids,
                      fixed_fields=FIXED_FIELDS, required_fields=REQUIRED_FIELDS,
                      config_problems=config_problems)
