"""Engine checkpoint formats: the one place that knows each serving engine's draft directory.

Reads: a draft's canonical state dict (names of `steps/lib/model/draft.py`) or an engine draft directory
(`config.json` + `model.safetensors`). Writes: engine draft directories, each with the engine's exact
key set and config (F2 keys, F4 aux-id convention, F5 context, F7 schema; the strict checker that judges
them is `steps/lib/checks/strict.py`).

One module per engine (`sglang.py`, `speculators.py` for vLLM), each filling in an `EngineFormat`, and
one registry, ENGINES: a new export format is one module plus one row here. `common.py` holds what they
share; `sglang_loader.py` loads a directory the way SGLang does (the reference engine's draft loader).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from steps.lib.draft_config import DraftConfig
from steps.lib.formats import sglang, speculators
from steps.lib.formats.common import (
    CANONICAL_KEYS,
    CONFIG_FILE,
    FLOAT_DTYPES,
    INDEX_DTYPES,
    OPTIONAL_KEYS,
    ST_DTYPES,
    WEIGHTS_FILE,
    EngineFormat,
    Resolution,
    draft_file,
    expected_shapes,
    read_config,
    read_json,
)

#: engine name (as `export.engines` and `--to` spell it) → its format.
ENGINES: dict[str, EngineFormat] = {"sglang": sglang.FORMAT, "vllm": speculators.FORMAT}
#: views of the registry, by what callers look up.
KEY_MAPS = {name: f.key_map for name, f in ENGINES.items()}
RESOLVERS = {name: f.resolve for name, f in ENGINES.items()}
CONFIG_BUILDERS = {name: f.build_config for name, f in ENGINES.items()}
ARCHITECTURES = {name: f.architectures for name, f in ENGINES.items()}


def engine_format(engine: str) -> EngineFormat:
    """The format of `engine`; an unknown engine is an error naming the known ones."""
    if engine not in ENGINES:
        raise KeyError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    return ENGINES[engine]


def engine_key_map(engine: str) -> dict[str, str]:
    """canonical name → the engine's key name."""
    return engine_format(engine).key_map


def layer_config(config: dict[str, Any], engine: str) -> dict[str, Any]:
    """The Llama layer fields of an engine config (top level for SGLang, nested for speculators)."""
    return engine_format(engine).layer_config(config)


def engine_layer_ids(config: dict[str, Any], engine: str) -> list[int] | None:
    """The aux ids as written in an engine config (engine convention), or None."""
    return engine_format(engine).layer_ids(config)


def write_engine_dir(path: str | Path, engine: str, state_dict: dict[str, torch.Tensor],
                     config: dict[str, Any], *, dtype: str) -> Path:
    """Write `config.json` + `model.safetensors` with the engine's key names: floats in `dtype`,
    d2t int64, t2d bool. Every canonical key must be present (nothing is silently left out)."""
    key_map = engine_key_map(engine)
    missing = [k for k in CANONICAL_KEYS if k not in state_dict]
    unknown = sorted(set(state_dict) - set(CANONICAL_KEYS))
    if missing or unknown:
        raise KeyError(f"draft state dict does not match the canonical names of steps/lib/model/draft.py: "
                       f"missing {missing}, unknown {unknown}")
    tensors = {}
    for k in CANONICAL_KEYS:
        t = state_dict[k].detach().cpu()
        t = t.to(INDEX_DTYPES[k]) if k in INDEX_DTYPES else t.to(FLOAT_DTYPES[dtype])
        tensors[key_map[k]] = t.contiguous()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def draft_config(config: dict[str, Any], engine: str) -> DraftConfig:
    """The draft's numbers from an engine config.json (raises KeyError/TypeError if a shape field is absent).
    rms_norm_eps, rope_theta and max_position_embeddings shape no tensor: absent, they take the values
    SGLang's LlamaConfig reads then (F5 and F7 judge the fields themselves)."""
    lc = layer_config(config, engine)
    heads, hidden = int(lc["num_attention_heads"]), int(lc["hidden_size"])
    ids = engine_layer_ids(config, engine)
    num_aux = config.get("num_aux_hidden_states") or (len(ids) if ids else 3)
    rope = lc.get("rope_theta") or (lc.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    return DraftConfig(hidden_size=hidden, intermediate_size=int(lc["intermediate_size"]),
                       num_attention_heads=heads, num_key_value_heads=int(lc.get("num_key_value_heads") or heads),
                       head_dim=int(lc.get("head_dim") or hidden // heads),
                       rms_norm_eps=float(lc.get("rms_norm_eps", 1e-6)), rope_theta=float(rope),
                       max_position_embeddings=int(lc.get("max_position_embeddings") or 2048),
                       vocab_size=int(lc["vocab_size"]), draft_vocab_size=int(config["draft_vocab_size"]),
                       target_hidden_size=int(config.get("target_hidden_size") or hidden), num_aux=int(num_aux))


__all__ = ["ARCHITECTURES", "CANONICAL_KEYS", "CONFIG_BUILDERS", "CONFIG_FILE", "ENGINES", "FLOAT_DTYPES",
           "INDEX_DTYPES", "KEY_MAPS", "OPTIONAL_KEYS", "RESOLVERS", "ST_DTYPES", "WEIGHTS_FILE", "EngineFormat",
           "Resolution", "draft_config", "engine_format", "engine_key_map", "engine_layer_ids", "expected_shapes",
           "draft_file", "layer_config", "read_config", "read_json", "write_engine_dir"]
