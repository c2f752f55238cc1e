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

from steps.formats import sglang
from steps.formats.common import CANONICAL_KEYS, STACKED_PARAMS, EngineFormat, Resolution, llama_layer_fields
from steps.layers import to_engine

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


FORMAT = EngineFormat(name="vllm", key_map=KEY_MAP, architectures=ARCHITECTURES, resolve=resolve,
                      build_config=build_config, layer_config=layer_config, layer_ids=layer_ids, id_offset=0)
