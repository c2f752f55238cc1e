"""What every engine format shares: eaglenest's canonical tensor names (those of `steps/lib/model/draft.py`), the
file names of an engine draft directory, tensor shapes from a handful of numbers, the Llama layer fields
both engines' config.json carry, and `EngineFormat`, the record each engine module fills in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from steps.lib.draft_config import DraftConfig
from steps.lib.errors import InputError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

#: decoder-layer parameters of the one draft layer, relative to the layer.
LAYER_PARAMS = (
    "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)
#: every tensor of a trained draft, canonical (SGLang) names; d2t/t2d are buffers.
CANONICAL_KEYS = ("embed_tokens.weight", "fc.weight", *(f"midlayer.{p}" for p in LAYER_PARAMS),
                  "norm.weight", "lm_head.weight", "d2t", "t2d")
#: keys an engine loads when present but serves without: the embedding is replaced by / shared with
#: the target's (SGLang `set_embed`, vLLM skips `embed_tokens` when absent); t2d is training-only.
OPTIONAL_KEYS = frozenset({"embed_tokens.weight", "t2d"})
#: the vocab map's tensors are indices, never cast to the float dtype.
INDEX_DTYPES = {"d2t": torch.int64, "t2d": torch.bool}
#: an export's float dtype (`export.dtype`) → torch's.
FLOAT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
#: safetensors dtype tags (safe_open get_slice().get_dtype()).
ST_DTYPES = {"BF16": "bfloat16", "F32": "float32", "F16": "float16", "I64": "int64", "BOOL": "bool",
             "I32": "int32", "F64": "float64"}

#: the loaders' `stacked_params_mapping` (SGLang's and vLLM's are the same table): (fused param, checkpoint
#: substring, shard id).
STACKED_PARAMS = ((".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
                  (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))


@dataclass(frozen=True)
class Resolution:
    """What an engine's loader does with one checkpoint key."""
    action: str                     # "param" | "hot_token_id" | "ignored" | "dropped"
    param: str | None = None        # the engine parameter it lands in
    shard: Any = None
    canonical: str | None = None    # the eaglenest name of that parameter (shard)


def expected_shapes(s: DraftConfig) -> dict[str, tuple[int, ...]]:
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


# --- config.json ------------------------------------------------------------------------------------

def llama_layer_fields(draft: dict[str, Any], *, max_position_embeddings: int, dtype: str) -> dict[str, Any]:
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



@dataclass(frozen=True)
class EngineFormat:
    """One engine's draft directory format: a module in steps/lib/formats/ fills it in, ENGINES lists it."""
    name: str
    #: canonical name → the exact key this engine's directory holds (F2).
    key_map: dict[str, str]
    architectures: list[str]
    #: what the engine's own loader does with one checkpoint key (doctor's F2 view).
    resolve: Callable[[str], Resolution]
    #: config.json from the draft fields: `(draft, *, layer_ids, max_position_embeddings, dtype, **extra)`.
    build_config: Callable[..., dict[str, Any]]
    #: the Llama layer fields of a config (top level, or nested).
    layer_config: Callable[[dict[str, Any]], dict[str, Any]]
    #: the aux ids as written in a config (engine convention), or None.
    layer_ids: Callable[[dict[str, Any]], list[int] | None]
    #: F7: config fields that must equal a value (field, value, consequence, the loader needs it).
    fixed_fields: list[tuple[str, Any, str, bool]]
    #: F7: config fields that must exist with a value of this type.
    required_fields: list[tuple[str, type | tuple[type, ...]]]
    #: F7: (field, problem) for what a field-by-field check cannot express.
    config_problems: Callable[[dict[str, Any]], list[tuple[str, str]]] = lambda config: []


def draft_file(directory: Any, name: str) -> Any:
    """`directory/name` of a draft or model directory, refused (`InputError`) when it is a symlink that leads
    out of the directory (a draft from elsewhere must not make us read /etc/passwd or another user's files);
    `FileNotFoundError` naming it when missing."""
    from pathlib import Path

    directory = Path(directory)
    path = directory / name
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; a draft directory holds {CONFIG_FILE} and {WEIGHTS_FILE}")
    real = path.resolve()
    if not real.is_relative_to(directory.resolve()):
        raise InputError(f"{path}: a symlink out of the draft directory (to {real}); copy the file into "
                         f"{directory} instead")
    return path


def read_config(directory: Any) -> dict[str, Any]:
    """The config.json of a draft directory as a JSON object (`draft_file`'s checks; a list or null refused)."""
    path = draft_file(directory, CONFIG_FILE)
    config = read_json(path)
    if not isinstance(config, dict):
        raise InputError(f"{path}: a JSON {type(config).__name__}, not an object of config fields; re-save it "
                         "(save_pretrained, or re-run the step that wrote it)")
    return config


def read_json(path: Any) -> Any:
    """A JSON file of a draft or model directory (config.json); a corrupt one is an `InputError` naming it."""
    import json
    from pathlib import Path

    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: not valid JSON ({err}); re-save it (save_pretrained, or re-run the step "
                         "that wrote it)") from None
