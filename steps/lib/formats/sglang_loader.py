"""A LENIENT loader that applies SGLang 0.5.23's own key rules (substring renames, optional `model.`
prefix, unknown keys silently dropped, `d2t` → hot token ids, `t2d` ignored, the draft's embedding
replaced by the target's), so that the reference engine sees exactly what SGLang would serve and every
catalogue row can be reproduced, then shown to be caught.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from steps.lib.formats.common import CONFIG_FILE, WEIGHTS_FILE, read_json
from steps.lib.formats.sglang import layer_ids, resolve


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
    ids = layer_ids(config)
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


def hot_ids(d2t: torch.Tensor) -> torch.Tensor:
    """SGLang's hot token ids from a `d2t` tensor: draft id i proposes target id i + d2t[i] (a float d2t gives
    float ids, truncated when used)."""
    return (d2t + torch.arange(d2t.shape[0])).to(torch.int64)


def draft_vocab(path: str | Path) -> set[int]:
    """The target ids an SGLang draft directory can propose, as SGLang reads them: its `d2t` as hot ids, or,
    with none, draft ids as target ids (0 .. draft_vocab_size - 1). Reads the one tensor, not the weights."""
    path = Path(path)
    with safe_open(str(path / WEIGHTS_FILE), "pt") as f:
        key = next((k for k in f.keys() if resolve(k).action == "hot_token_id"), None)   # noqa: SIM118
        if key is not None:
            return set(hot_ids(f.get_tensor(key)).tolist())
    dcfg = sglang_draft_config(read_json(path / CONFIG_FILE), str(path / CONFIG_FILE))
    return set(range(dcfg["draft_vocab_size"]))


def load_sglang_draft(path: str | Path, *, target: torch.nn.Module | None = None) -> tuple[Any, LoadReport]:
    """Load an SGLang draft directory the way SGLang 0.5.23 does; returns (Eagle3Draft, LoadReport).

    Unknown keys are dropped (recorded, not raised), params never loaded keep their random init,
    `d2t` becomes the hot-token map (missing: draft ids are used as target ids), `t2d` is ignored,
    and with a `target` the embedding (and, for `draft_vocab_size: null`, the head) is the target's.
    """
    from steps.lib.model.draft import DraftConfig, Eagle3Draft

    path = Path(path)
    config = read_json(path / CONFIG_FILE)
    dcfg = sglang_draft_config(config, str(path / CONFIG_FILE))
    with torch.random.fork_rng():      # params SGLang never loads stay "random", but reproducibly so
        torch.manual_seed(0)
        draft = Eagle3Draft(DraftConfig(**dcfg)).float().eval()
    params = dict(draft.named_parameters())
    report = LoadReport()
    d2t = torch.zeros(dcfg["draft_vocab_size"], dtype=torch.int64)
    for key, tensor in load_file(str(path / WEIGHTS_FILE)).items():
        res = resolve(key)
        if res.action == "dropped":
            report.dropped.append(key)
        elif res.action == "ignored":
            report.ignored.append(key)
        elif res.action == "hot_token_id":
            d2t = hot_ids(tensor) - torch.arange(tensor.shape[0])
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
