"""Engine checkpoint formats, as data: the one place that knows each serving engine's draft layout.

Reads: a draft's canonical state dict (names of `steps/draft.py`) or an engine draft directory
(`config.json` + `model.safetensors`). Writes: engine draft directories. Prevents F2 (keys the engine
drops without a word), F3 (d2t dtype / presence), F4 (aux layer ids in the wrong convention), F5
(`max_position_embeddings` shorter than the target's context) and F7 (missing `draft_vocab_size`,
wrong architecture), by a STRICT checker that accounts for every key, shape, dtype and config field.

It also holds a LENIENT loader, `load_sglang_draft`, that applies SGLang 0.5.23's own key rules
(substring renames, optional `model.` prefix, unknown keys silently dropped, `d2t` → hot token ids,
`t2d` ignored, the draft's embedding replaced by the target's), so that the reference engine sees
exactly what SGLang would serve and every catalogue row can be reproduced, then shown to be caught.

Sources the tables below were read from (cite when changing them):
- SGLang 0.5.23 wheel, `python/sglang/srt/models/llama_eagle3.py`: `LlamaModel.__init__` (parameter
  names, fc width), `LlamaForCausalLMEagle3.__init__` (`draft_vocab_size`, tied head) and
  `load_weights` (`legacy_name_map`, d2t/t2d, `stacked_params_mapping`, `model.` fallback).
  Same logic at sgl-project/sglang@03d5a7771f6082e7737a5f19cae7d1e863087013 minus `legacy_name_map`.
- vllm-project/speculators@c05b95b303f7d4f21e8d7624e0ffa1c2d9b4d73b:
  `src/speculators/models/eagle3/config.py` (`Eagle3SpeculatorConfig` fields),
  `src/speculators/models/eagle3/core.py` (`Eagle3DraftModel` parameter names, `verifier_*` not saved),
  `src/speculators/convert/eagle/eagle3_converter.py` (`midlayer.` → `layers.0.`, speculators_config),
  `src/speculators/config.py` (`SpeculatorsConfig`, `VerifierConfig`), `src/speculators/proposals/greedy.py`.
- vllm-project/vllm@00bd1493b3e82d6c13c68ee8a0e1c5a96707e190 `vllm/model_executor/models/llama_eagle3.py`
  (`Eagle3LlamaForCausalLM.load_weights`: t2d skipped, d2t → `draft_id_to_target_id`, `model.` prefix).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from steps.layers import from_engine, to_engine

ENGINES = ("sglang", "vllm")
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
#: the speculators release whose format the vLLM directory follows.
SPECULATORS_VERSION = "0.9.0"

# --- canonical names (steps/draft.py) and the per-engine key maps ------------------------------------

#: decoder-layer parameters of the one draft layer, relative to the layer.
LAYER_PARAMS = (
    "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)
#: every tensor of a trained draft, canonical (SGLang) names; d2t/t2d are buffers.
CANONICAL_KEYS = ("embed_tokens.weight", "fc.weight", *(f"midlayer.{p}" for p in LAYER_PARAMS),
                  "norm.weight", "lm_head.weight", "d2t", "t2d")

#: canonical name → the name written for each engine. SGLang keeps the official EAGLE-3 layout
#: (`midlayer.*`): every SGLang version loads it (0.5.23 also renames it to `layers.0`, older ones
#: only know `midlayer`). speculators/vLLM name the layer `layers.0.*` (Eagle3DraftModel.layers).
KEY_MAPS: dict[str, dict[str, str]] = {
    "sglang": {k: k for k in CANONICAL_KEYS},
    "vllm": {k: k.replace("midlayer.", "layers.0.", 1) for k in CANONICAL_KEYS},
}
#: keys an engine loads when present but serves without: the embedding is replaced by / shared with
#: the target's (SGLang `set_embed`, vLLM skips `embed_tokens` when absent); t2d is training-only.
OPTIONAL_KEYS = frozenset({"embed_tokens.weight", "t2d"})
INDEX_DTYPES = {"d2t": torch.int64, "t2d": torch.bool}

ARCHITECTURES = {"sglang": ["LlamaForCausalLMEagle3"], "vllm": ["Eagle3Speculator"]}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
#: safetensors dtype tags (safe_open get_slice().get_dtype()).
ST_DTYPES = {"BF16": "bfloat16", "F32": "float32", "F16": "float16", "I64": "int64", "BOOL": "bool",
             "I32": "int32", "F64": "float64"}

# --- SGLang 0.5.23 LlamaForCausalLMEagle3.load_weights, as data --------------------------------------

#: `legacy_name_map`: substring renames applied to every key first.
SGLANG_LEGACY_NAME_MAP = {"midlayer": "layers.0", "aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1",
                          "aux_norm_high": "fc_norm.2"}
#: `stacked_params_mapping`: (fused param, checkpoint substring, shard id).
SGLANG_STACKED = ((".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
                  (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))
#: (SGLang parameter, shard) → canonical name, for a 1-layer draft without fc bias or fc norms.
SGLANG_PARAMS: dict[tuple[str, Any], str] = {
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
SGLANG_PARAM_NAMES = frozenset(p for p, _ in SGLANG_PARAMS)


@dataclass(frozen=True)
class Resolution:
    """What an engine's loader does with one checkpoint key."""
    action: str                     # "param" | "hot_token_id" | "ignored" | "dropped"
    param: str | None = None        # the engine parameter it lands in
    shard: Any = None
    canonical: str | None = None    # the eaglenest name of that parameter (shard)


def sglang_resolve(name: str) -> Resolution:
    """SGLang 0.5.23 `load_weights` for one key: where it lands, or that it is dropped without a word."""
    for legacy, new in SGLANG_LEGACY_NAME_MAP.items():
        if legacy in name:
            name = name.replace(legacy, new)
    if "d2t" in name:
        return Resolution("hot_token_id", canonical="d2t")
    if "t2d" in name:
        return Resolution("ignored", canonical="t2d")
    shard = None
    for fused, part, shard_id in SGLANG_STACKED:
        if part in name:
            name, shard = name.replace(part, fused), shard_id
            break
    param = name if name in SGLANG_PARAM_NAMES else f"model.{name}"
    if (param, shard) in SGLANG_PARAMS:
        return Resolution("param", param, shard, SGLANG_PARAMS[(param, shard)])
    return Resolution("dropped")


#: vLLM Eagle3LlamaForCausalLM parameters (speculators format is converted to this) → canonical.
VLLM_PARAMS: dict[tuple[str, Any], str] = {
    # same module names as SGLang's (LlamaModel under `model.`, fused qkv / gate_up, top-level lm_head)
    **SGLANG_PARAMS,
    ("draft_id_to_target_id", None): "d2t",
}


def vllm_resolve(name: str) -> Resolution:
    """vLLM `Eagle3LlamaForCausalLM.load_weights` for one key (unknown names raise there, loudly)."""
    if "t2d" in name:
        return Resolution("ignored", canonical="t2d")
    if "d2t" in name:
        return Resolution("param", "draft_id_to_target_id", None, "d2t")
    if "lm_head" not in name:
        name = "model." + name
    name = name.replace("midlayer.", "layers.0.")
    shard = None
    for fused, part, shard_id in SGLANG_STACKED:   # vLLM's stacked_params_mapping is the same table
        if part in name:
            name, shard = name.replace(part, fused), shard_id
            break
    if (name, shard) in VLLM_PARAMS:
        return Resolution("param", name, shard, VLLM_PARAMS[(name, shard)])
    return Resolution("dropped")


RESOLVERS = {"sglang": sglang_resolve, "vllm": vllm_resolve}


# --- shapes ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DraftShape:
    """The numbers that fix every tensor shape of a one-layer EAGLE-3 draft."""
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int            # the target's
    draft_vocab_size: int
    target_hidden_size: int
    num_aux: int


def expected_shapes(s: DraftShape) -> dict[str, tuple[int, ...]]:
    """Canonical name → shape (q/k/v read the 2H concatenation of embedding and hidden)."""
    h, d = s.hidden_size, s.head_dim
    layer = {
        "input_layernorm.weight": (h,), "hidden_norm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (s.num_attention_heads * d, 2 * h),
        "self_attn.k_proj.weight": (s.num_key_value_heads * d, 2 * h),
        "self_attn.v_proj.weight": (s.num_key_value_heads * d, 2 * h),
        "self_attn.o_proj.weight": (h, s.num_attention_heads * d),
        "mlp.gate_proj.weight": (s.intermediate_size, h), "mlp.up_proj.weight": (s.intermediate_size, h),
        "mlp.down_proj.weight": (h, s.intermediate_size),
    }
    return {"embed_tokens.weight": (s.vocab_size, h), "fc.weight": (h, s.num_aux * s.target_hidden_size),
            **{f"midlayer.{k}": v for k, v in layer.items()},
            "norm.weight": (h,), "lm_head.weight": (s.draft_vocab_size, h),
            "d2t": (s.draft_vocab_size,), "t2d": (s.vocab_size,)}


# --- config.json builders ------------------------------------------------------------------------------

def _llama_layer_fields(draft: dict[str, Any], *, max_position_embeddings: int, dtype: str) -> dict[str, Any]:
    """The Llama decoder-layer fields both engines read (one draft layer, no biases, untied head)."""
    theta = float(draft["rope_theta"])
    return {
        "model_type": "llama", "hidden_act": "silu", "num_hidden_layers": 1,
        "hidden_size": draft["hidden_size"], "intermediate_size": draft["intermediate_size"],
        "num_attention_heads": draft["num_attention_heads"], "num_key_value_heads": draft["num_key_value_heads"],
        "head_dim": draft["head_dim"], "rms_norm_eps": draft["rms_norm_eps"],
        # transformers 5 reads rope_parameters; older readers (and SGLang's fallback) read rope_theta.
        "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "max_position_embeddings": int(max_position_embeddings),
        "vocab_size": draft["vocab_size"], "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype,
    }


def sglang_config(draft: dict[str, Any], *, layer_ids: list[int], max_position_embeddings: int,
                  dtype: str, **_: Any) -> dict[str, Any]:
    """`LlamaForCausalLMEagle3` config.json; aux ids in SGLang's convention inside `eagle_config` (F4, F7)."""
    return {
        "architectures": ARCHITECTURES["sglang"],
        **_llama_layer_fields(draft, max_position_embeddings=max_position_embeddings, dtype=dtype),
        # explicit: missing → AttributeError at startup, null → the target's head replaces ours (F7).
        "draft_vocab_size": draft["draft_vocab_size"],
        "target_hidden_size": draft["target_hidden_size"],
        "bias": False,
        # only eagle_config is read for target capture; SGLang adds +1 to these ids.
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": to_engine(layer_ids, "sglang"),
                         "use_aux_hidden_state": True},
    }


def vllm_config(draft: dict[str, Any], *, layer_ids: list[int], max_position_embeddings: int, dtype: str,
                verifier_name_or_path: str, verifier_architectures: list[str], speculative_tokens: int,
                **_: Any) -> dict[str, Any]:
    """speculators `Eagle3SpeculatorConfig` config.json (vLLM auto-detects it); ids unchanged (F4)."""
    return {
        "architectures": ARCHITECTURES["vllm"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": _llama_layer_fields(draft, max_position_embeddings=max_position_embeddings,
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


CONFIG_BUILDERS = {"sglang": sglang_config, "vllm": vllm_config}


def engine_key_map(engine: str) -> dict[str, str]:
    """canonical name → the engine's key name; an unknown engine is an error naming the known ones."""
    if engine not in KEY_MAPS:
        raise KeyError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    return KEY_MAPS[engine]


def write_engine_dir(path: str | Path, engine: str, state_dict: dict[str, torch.Tensor],
                     config: dict[str, Any], *, dtype: str) -> Path:
    """Write `config.json` + `model.safetensors` with the engine's key names: floats in `dtype`,
    d2t int64, t2d bool. Every canonical key must be present (nothing is silently left out)."""
    key_map = engine_key_map(engine)
    missing = [k for k in CANONICAL_KEYS if k not in state_dict]
    unknown = sorted(set(state_dict) - set(CANONICAL_KEYS))
    if missing or unknown:
        raise KeyError(f"draft state dict does not match the canonical names of steps/draft.py: "
                       f"missing {missing}, unknown {unknown}")
    tensors = {}
    for k in CANONICAL_KEYS:
        t = state_dict[k].detach().cpu()
        t = t.to(INDEX_DTYPES[k]) if k in INDEX_DTYPES else t.to(DTYPES[dtype])
        tensors[key_map[k]] = t.contiguous()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


# --- reading engine configs ------------------------------------------------------------------------------

def layer_config(config: dict[str, Any], engine: str) -> dict[str, Any]:
    """The Llama layer fields of an engine config (top level for SGLang, nested for speculators)."""
    return config if engine == "sglang" else dict(config.get("transformer_layer_config") or {})


def engine_layer_ids(config: dict[str, Any], engine: str) -> list[int] | None:
    """The aux ids as written in an engine config (engine convention), or None."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") if engine == "sglang" \
        else config.get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if isinstance(ids, list) else None


def sglang_layer_ids(sglang_dir: Path) -> list[int]:
    """The layers SGLang would capture for this draft directory, internal convention (its +1 applied)."""
    config = json.loads((Path(sglang_dir) / CONFIG_FILE).read_text())
    ids = engine_layer_ids(config, "sglang")
    if not ids:
        raise ValueError(f"{Path(sglang_dir) / CONFIG_FILE}: no eagle_config.eagle_aux_hidden_state_layer_ids; "
                         "SGLang would capture its defaults, not the trained layers (F4)")
    return from_engine(ids, "sglang")


def draft_shape(config: dict[str, Any], engine: str) -> DraftShape:
    """Tensor-shape numbers from an engine config.json (raises KeyError/TypeError if absent)."""
    lc = layer_config(config, engine)
    heads = int(lc["num_attention_heads"])
    ids = engine_layer_ids(config, engine)
    num_aux = config.get("num_aux_hidden_states") or (len(ids) if ids else 3)
    return DraftShape(hidden_size=int(lc["hidden_size"]), intermediate_size=int(lc["intermediate_size"]),
                      num_attention_heads=heads, num_key_value_heads=int(lc.get("num_key_value_heads") or heads),
                      head_dim=int(lc.get("head_dim") or int(lc["hidden_size"]) // heads),
                      vocab_size=int(lc["vocab_size"]), draft_vocab_size=int(config["draft_vocab_size"]),
                      target_hidden_size=int(config.get("target_hidden_size") or lc["hidden_size"]),
                      num_aux=int(num_aux))


# --- the lenient loader: what SGLang 0.5.23 would actually serve ------------------------------------------

@dataclass
class LoadReport:
    """What SGLang's rules did with a checkpoint: loaded, silently dropped, never set."""
    loaded: dict[str, str] = field(default_factory=dict)     # checkpoint key → canonical name
    dropped: list[str] = field(default_factory=list)        # keys SGLang ignores without a word
    ignored: list[str] = field(default_factory=list)        # t2d (by design)
    missing: list[str] = field(default_factory=list)        # canonical params never set (stay random)
    hot_token_ids: bool = False                             # d2t found
    embed_from_target: bool = False
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


#: config flags SGLang implements that the reference draft does not (refused, never ignored).
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "use_aux_norm", "norm_output", "bias")


def sglang_draft_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    """DraftConfig fields from an SGLang config.json, with SGLang's defaults and failures."""
    if "model_type" not in config:
        raise ValueError(f"{where}: Unrecognized model ... Should have a model_type key (SGLang's error: "
                         "a speculators-format directory is not an SGLang draft)")
    arch = (config.get("architectures") or [None])[0]
    if arch != "LlamaForCausalLMEagle3":
        raise ValueError(f"{where}: architectures[0] = {arch!r}; SGLang would not load it as an EAGLE-3 draft "
                         "(AttributeError ... hot_token_id at startup)")
    if not config.get("tie_word_embeddings", False) and "draft_vocab_size" not in config:
        raise AttributeError(f"{where}: 'LlamaConfig' object has no attribute 'draft_vocab_size' (SGLang fails "
                             "the same way at startup; write draft_vocab_size explicitly)")
    bad = [f for f in UNSUPPORTED_FLAGS if config.get(f) or (config.get("eagle_config") or {}).get(f)]
    if bad or int(config.get("num_hidden_layers", 1)) != 1:
        raise NotImplementedError(f"{where}: the reference draft implements one plain EAGLE-3 layer; this "
                                  f"config sets {bad or ['num_hidden_layers=' + str(config['num_hidden_layers'])]}")
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    ids = engine_layer_ids(config, "sglang")
    draft_vocab = config["draft_vocab_size"] if config["draft_vocab_size"] is not None else config["vocab_size"]
    rope = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    return {"hidden_size": hidden, "intermediate_size": int(config["intermediate_size"]),
            "num_attention_heads": heads, "num_key_value_heads": int(config.get("num_key_value_heads") or heads),
            "head_dim": int(config.get("head_dim") or hidden // heads),
            "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)), "rope_theta": float(rope),
            "max_position_embeddings": int(config.get("max_position_embeddings", 2048)),
            "vocab_size": int(config["vocab_size"]), "draft_vocab_size": int(draft_vocab),
            "target_hidden_size": int(config.get("target_hidden_size") or hidden),
            "num_aux": int(config.get("num_aux_hidden_states") or (len(ids) if ids else 3))}


def load_sglang_draft(path: str | Path, *, target: torch.nn.Module | None = None) -> tuple[Any, LoadReport]:
    """Load an SGLang draft directory the way SGLang 0.5.23 does; returns (Eagle3Draft, LoadReport).

    Unknown keys are dropped (recorded, not raised), params never loaded keep their random init,
    `d2t` becomes the hot-token map (missing: draft ids are used as target ids), `t2d` is ignored,
    and with a `target` the embedding (and, for `draft_vocab_size: null`, the head) is the target's.
    """
    from steps.draft import DraftConfig, Eagle3Draft

    path = Path(path)
    config = json.loads((path / CONFIG_FILE).read_text())
    dcfg = sglang_draft_config(config, str(path / CONFIG_FILE))
    with torch.random.fork_rng():      # params SGLang never loads stay "random", but reproducibly so
        torch.manual_seed(0)
        draft = Eagle3Draft(DraftConfig(**dcfg)).float().eval()
    params = dict(draft.named_parameters())
    report = LoadReport()
    d2t = torch.zeros(dcfg["draft_vocab_size"], dtype=torch.int64)
    for key, tensor in load_file(str(path / WEIGHTS_FILE)).items():
        res = sglang_resolve(key)
        if res.action == "dropped":
            report.dropped.append(key)
        elif res.action == "ignored":
            report.ignored.append(key)
        elif res.action == "hot_token_id":
            # SGLang: hot_token_id = d2t + arange; a float d2t gives float ids (truncated when used).
            hot = tensor + torch.arange(tensor.shape[0])
            d2t = (hot.to(torch.int64) - torch.arange(tensor.shape[0])).to(torch.int64)
            report.hot_token_ids = True
            if tensor.dtype != torch.int64:
                report.notes.append(f"{key} has dtype {tensor.dtype}: SGLang's hot token ids are not int64")
        else:
            _copy_param(params[res.canonical], tensor, key, path)
            report.loaded[key] = res.canonical
    draft.d2t.copy_(d2t)
    _use_target_weights(draft, config, dcfg, target, report)
    loaded = set(report.loaded.values()) | ({"embed_tokens.weight"} if report.embed_from_target else set())
    report.missing = sorted(k for k in params if k not in loaded)
    return draft, report


def _copy_param(param: torch.nn.Parameter, tensor: torch.Tensor, key: str, path: Path) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        # SGLang's weight loaders assert on shape: a loud failure there too.
        raise ValueError(f"{path}/{WEIGHTS_FILE}:{key}: shape {list(tensor.shape)}, the model built from "
                         f"config.json expects {list(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))


def _use_target_weights(draft: Any, config: dict[str, Any], dcfg: dict[str, Any],
                        target: torch.nn.Module | None, report: LoadReport) -> None:
    """SGLang's init_lm_head: the target's embedding replaces the draft's when widths match."""
    if target is None:
        return
    if dcfg["target_hidden_size"] != dcfg["hidden_size"]:
        report.notes.append("target_hidden_size != hidden_size: SGLang keeps the draft's own embedding")
        return
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.get_input_embeddings().weight.to(draft.embed_tokens.weight.dtype))
        report.embed_from_target = True
        if config.get("draft_vocab_size", 0) is None:
            draft.lm_head.weight.copy_(target.get_output_embeddings().weight)
            report.notes.append("draft_vocab_size is null: SGLang replaced the draft's lm_head by the target's")
