"""Draft layouts: recognise any EAGLE-3 draft directory, read it back to eaglenest's canonical form, convert it.

Layouts: `sglang` (eaglenest's or SpecForge's `LlamaForCausalLMEagle3` export), `eagle-official`
(EAGLE's own `LlamaForCausalLM` + `midlayer.*` release), `speculators` (`Eagle3Speculator`, what vLLM
serves). The layout comes from an explicit rules table over config.json and the weight keys, never
from the path. `convert` writes DST in the target engine's exact key set and config (the builders of
`steps/lib/formats/`), strict-checked (`steps/lib/checks/strict.py`), refusing what it cannot carry
faithfully (F2: keys renamed by a table; F4: aux ids converted through `steps/lib/layer_ids.py`; F7:
`LlamaForCausalLMEagle3` / `draft_vocab_size` written explicitly). `eaglenest convert` is its CLI and
`eaglenest doctor` converts a non-SGLang layout with it to measure offline τ with SGLang's rules.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from steps.lib import formats
from steps.lib.checks.algorithm import draft_architecture
from steps.lib.checks.strict import assert_engine_dir, tensor_meta
from steps.lib.layer_ids import default_aux_layer_ids, from_engine

#: how the layout is recognised: (name, engine whose loader serves it, rule in words, predicate on
#: (config, weight keys)). First match wins; the order puts the most specific marker first.
LAYOUT_RULES: tuple[tuple[str, str, str, Any], ...] = (
    ("speculators", "vllm", "speculators_model_type == 'eagle3' (speculators Eagle3SpeculatorConfig)",
     lambda c, k: c.get("speculators_model_type") == "eagle3"),
    ("sglang", "sglang", "architectures[0] == 'LlamaForCausalLMEagle3' (eaglenest / SpecForge SGLang export)",
     lambda c, k: draft_architecture(c) == "LlamaForCausalLMEagle3"),
    ("eagle-official", "sglang", "architectures[0] == 'LlamaForCausalLM' and a `midlayer.*` key (EAGLE release)",
     lambda c, k: draft_architecture(c) == "LlamaForCausalLM" and any(x.startswith("midlayer.") for x in k)),
)
LAYOUT_ENGINE = {name: engine for name, engine, _, _ in LAYOUT_RULES}


def detect_layout(config: dict[str, Any], keys: list[str]) -> str:
    """The first rule of LAYOUT_RULES that matches, or 'unknown'."""
    for name, _, _, rule in LAYOUT_RULES:
        if rule(config, keys):
            return name
    return "unknown"


#: draft flags whose `true` changes the math; the layouts eaglenest writes cannot carry them.
UNCONVERTIBLE_FLAGS: dict[str, str] = {
    "norm_before_residual": "the residual would be taken after hidden_norm; SGLang's layer 0 always keeps the "
                            "pre-norm residual, so the converted draft would compute something else",
    "norm_before_fc": "an RMSNorm over the concatenated aux features; eaglenest's layouts have no input_norm key",
    "fc_norm": "per-aux-chunk RMSNorms before fc ('eagle3.1'); eaglenest's layouts have no fc_norm keys",
    "use_aux_norm": "legacy name of fc_norm; eaglenest's layouts have no fc_norm keys",
    "norm_output": "the post-norm hidden is fed to the next step; eaglenest's layouts assume the pre-norm one",
    "bias": "fc / o_proj biases; eaglenest's layouts have no bias keys",
}

#: source layout → the engine whose key map and config convention it follows.
SOURCE_ENGINE = {"sglang": "sglang", "eagle-official": "sglang", "speculators": "vllm"}


class ConvertError(ValueError):
    """The source cannot be converted faithfully; the message names the field and why."""


@dataclass
class Draft:
    """A draft read back to eaglenest's canonical form: tensors, Llama-layer fields, internal layer ids."""
    state: dict[str, torch.Tensor]
    fields: dict[str, Any]                 # DraftConfig-like fields for formats.CONFIG_BUILDERS
    layer_ids: list[int]                   # internal convention
    max_position_embeddings: int
    dtype: str
    rope_extra: dict[str, Any]             # rope_scaling / rope_parameters carried over unchanged
    source_config: dict[str, Any]


# --- reading ---------------------------------------------------------------------------------------

def renamed(tensors: dict[str, torch.Tensor], renames: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """Keys starting with OLD get NEW in its place (`decoder.` → `midlayer.`, `draft_model.` → ``), the first
    matching rename per key: what doctor's F2 fix names for keys a loader would drop."""
    out = {}
    for key, value in tensors.items():
        old, new = next(((o, n) for o, n in renames if key.startswith(o)), ("", ""))
        out[new + key[len(old):]] = value
    if len(out) != len(tensors):
        raise ConvertError(f"--rename {renames}: two keys end up with one name; name the prefixes exactly")
    return out


def read_draft(src: str | Path, *, num_target_layers: int | None = None,
               renames: list[tuple[str, str]] | None = None) -> tuple[str, Draft]:
    """(layout, Draft) of any known layout, its keys renamed first; raises ConvertError on anything not carried
    faithfully. A missing or null `draft_vocab_size` is read from the weights (lm_head.weight's rows: F7)."""
    src = Path(src)
    config = formats.read_config(src)
    weights = formats.draft_file(src, formats.WEIGHTS_FILE)
    tensor_meta(weights)        # a truncated or corrupt file is named before it is read whole
    tensors = renamed(load_file(str(weights)), renames or [])
    layout = detect_layout(config, list(tensors))
    if layout not in SOURCE_ENGINE:
        raise ConvertError(f"{src}/{formats.CONFIG_FILE}: layout not recognised (architectures="
                           f"{config.get('architectures')!r}); known: {', '.join(SOURCE_ENGINE)}. "
                           "Run `eaglenest doctor` on it for details")
    engine = SOURCE_ENGINE[layout]
    refuse_unconvertible(config, engine, src)
    state = canonical_state(tensors, engine, src)
    fields = layer_fields(config, engine, src, draft_vocab_rows=int(state["lm_head.weight"].shape[0]))
    ids = source_layer_ids(config, layout, num_target_layers, src)
    lc = formats.layer_config(config, engine)
    dtype = str(state["fc.weight"].dtype).removeprefix("torch.")
    rope_extra = {k: lc[k] for k in ("rope_scaling", "rope_parameters") if lc.get(k)}
    return layout, Draft(state, fields, ids, int(lc.get("max_position_embeddings") or 0), dtype, rope_extra,
                         config)


def refuse_unconvertible(config: dict[str, Any], engine: str, src: Path) -> None:
    where = f"{src}/{formats.CONFIG_FILE}"
    lc = formats.layer_config(config, engine)
    eagle_config = config.get("eagle_config") or {}
    for flag, why in UNCONVERTIBLE_FLAGS.items():
        if config.get(flag) or eagle_config.get(flag):
            raise ConvertError(f"{where}: {flag} is true: {why}. Not converted (it would be served wrongly "
                               "without an error)")
    layers = lc.get("num_hidden_layers", 1)
    if layers != 1:
        raise ConvertError(f"{where}: num_hidden_layers={layers}; eaglenest's layouts hold one draft layer "
                           "(extra layers would be dropped)")
    if lc.get("tie_word_embeddings"):
        raise ConvertError(f"{where}: tie_word_embeddings is true; eaglenest's layouts write an untied "
                           "lm_head of draft_vocab_size rows")


def canonical_state(tensors: dict[str, torch.Tensor], engine: str, src: Path) -> dict[str, torch.Tensor]:
    """Source keys → canonical names by the engine's exact key map (+ SGLang's `layers.0.` spelling)."""
    to_canonical = {v: k for k, v in formats.KEY_MAPS[engine].items()}
    if engine == "sglang":   # SGLang (and SpecForge's trainer) also spell the layer `layers.0.`
        to_canonical |= {k.replace("midlayer.", "layers.0.", 1): k for k in formats.CANONICAL_KEYS}
    unknown = sorted(k for k in tensors if k not in to_canonical)
    if unknown:
        raise ConvertError(f"{src}/{formats.WEIGHTS_FILE}: unknown keys {unknown[:6]}{' …' if len(unknown) > 6 else ''}"
                           f"; not in the {engine} key map of steps/lib/formats/, so converting would drop them. "
                           "Run `eaglenest doctor` on the source to see what they are")
    state = {to_canonical[k]: v for k, v in tensors.items()}
    missing = [k for k in formats.CANONICAL_KEYS if k not in state and k not in formats.OPTIONAL_KEYS
               and k != "d2t"]
    if missing:
        raise ConvertError(f"{src}/{formats.WEIGHTS_FILE}: missing {missing}; the draft is incomplete")
    return state


def layer_fields(config: dict[str, Any], engine: str, src: Path, *, draft_vocab_rows: int) -> dict[str, Any]:
    """The fields engine formats' `build_config` build from, read from either layout. `draft_vocab_size` missing
    or null is repaired from the weights: the head has one row per draft token (`draft_vocab_rows`)."""
    lc = formats.layer_config(config, engine)
    try:
        heads, hidden = int(lc["num_attention_heads"]), int(lc["hidden_size"])
        draft_vocab = config.get("draft_vocab_size")
        draft_vocab = draft_vocab_rows if draft_vocab is None else draft_vocab
        if not isinstance(draft_vocab, int) or isinstance(draft_vocab, bool):
            raise TypeError(f"draft_vocab_size={draft_vocab!r}")
        theta = lc.get("rope_theta") or (lc.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        return {"hidden_size": hidden, "intermediate_size": int(lc["intermediate_size"]),
                "num_attention_heads": heads, "num_key_value_heads": int(lc.get("num_key_value_heads") or heads),
                "head_dim": int(lc.get("head_dim") or hidden // heads),
                "rms_norm_eps": float(lc.get("rms_norm_eps", 1e-6)), "rope_theta": float(theta),
                "vocab_size": int(lc["vocab_size"]), "draft_vocab_size": draft_vocab,
                "target_hidden_size": int(config.get("target_hidden_size") or hidden)}
    except (KeyError, TypeError, ValueError) as err:
        raise ConvertError(f"{src}/{formats.CONFIG_FILE}: {err!r} missing or invalid; an explicit integer "
                           "draft_vocab_size and the Llama layer fields are needed (F7)") from err


def source_layer_ids(config: dict[str, Any], layout: str, num_target_layers: int | None, src: Path) -> list[int]:
    """Internal aux ids: SGLang `eagle_config` + 1, speculators unchanged, EAGLE official = its defaults."""
    engine = SOURCE_ENGINE[layout]
    ids = formats.engine_layer_ids(config, engine)
    if ids:
        return from_engine(ids, engine)
    if num_target_layers is None:
        raise ConvertError(f"{src}/{formats.CONFIG_FILE}: no aux layer ids recorded (the server would capture "
                           "its defaults [2, N//2, N-3]); pass --num-target-layers N to write them explicitly")
    return default_aux_layer_ids(num_target_layers)


# --- writing ---------------------------------------------------------------------------------------

def build_config(draft: Draft, to: str, *, verifier: str | None, verifier_architectures: list[str] | None,
                 speculative_tokens: int) -> dict[str, Any]:
    """The target engine's config.json from the formats builders, rope extras carried over."""
    spec = draft.source_config.get("speculators_config") or {}
    verifier = verifier or (spec.get("verifier") or {}).get("name_or_path")
    if to == "vllm" and not verifier:
        raise ConvertError("--to vllm needs --verifier NAME_OR_PATH (speculators_config.verifier.name_or_path: "
                           "the target model vLLM serves this draft with)")
    methods = spec.get("proposal_methods") or [{}]
    config = formats.CONFIG_BUILDERS[to](
        draft.fields, layer_ids=draft.layer_ids, max_position_embeddings=draft.max_position_embeddings,
        dtype=draft.dtype, verifier_name_or_path=verifier or "",
        verifier_architectures=verifier_architectures or (spec.get("verifier") or {}).get("architectures") or [],
        speculative_tokens=methods[0].get("speculative_tokens") or speculative_tokens)
    target = config if to == "sglang" else config["transformer_layer_config"]
    target.update(draft.rope_extra)
    return config


def write_dir(out: Path, to: str, state: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Tensors under the engine's exact names, dtypes unchanged (index maps int64 / bool)."""
    key_map = formats.KEY_MAPS[to]
    tensors = {key_map[k]: (v.to(formats.INDEX_DTYPES[k]) if k in formats.INDEX_DTYPES else v).contiguous()
               for k, v in state.items()}
    out.mkdir(parents=True)
    save_file(tensors, str(out / formats.WEIGHTS_FILE), metadata={"format": "pt"})
    (out / formats.CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def convert(src: str | Path, dst: str | Path, to: str, *, num_target_layers: int | None = None,
            verifier: str | None = None, verifier_architectures: list[str] | None = None,
            speculative_tokens: int = 3, renames: list[tuple[str, str]] | None = None) -> Path:
    """SRC (any known layout, keys renamed by `renames`) → DST in `to`'s layout, strict-checked; DST appears only
    when it passes."""
    if to not in formats.ENGINES:
        raise ConvertError(f"--to {to!r}; known: {', '.join(formats.ENGINES)}")
    dst = Path(dst)
    if dst.exists():
        raise ConvertError(f"{dst} already exists; conversions never overwrite a directory")
    _, draft = read_draft(src, num_target_layers=num_target_layers, renames=renames)
    config = build_config(draft, to, verifier=verifier, verifier_architectures=verifier_architectures,
                          speculative_tokens=speculative_tokens)
    tmp = dst.parent / f".{dst.name}.converting-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write_dir(tmp, to, draft.state, config)
        assert_engine_dir(tmp, to, expect={"layer_ids": draft.layer_ids,
                                                   "draft_vocab_size": draft.fields["draft_vocab_size"]})
        tmp.rename(dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


