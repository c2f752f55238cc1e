"""Checkpoint key quirks of served targets that the Hugging Face causal-LM class does not resolve by itself.

Kimi-K2.5 (the founding target: a DeepSeek-V3 text model inside a multimodal wrapper) stores its text
weights as `language_model.model.layers.…` / `language_model.lm_head.…`. `from_pretrained` of the text
class finds none of its keys under those names and initialises every weight at random with only a
load report, never an error: hidden states of a random model would be extracted for days. Reading
the safetensors headers (no tensor data) names the prefix; `from_pretrained(key_mapping=…)` strips it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

#: prefixes a wrapper puts before the text model's own `model.` / `lm_head.` names.
WRAPPER_PREFIXES = ("language_model.",)
TEXT_ROOTS = ("model.", "lm_head.")


def checkpoint_keys(path: str | Path) -> list[str]:
    """Every tensor name of a model directory's safetensors files, from the index or the file headers."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted(json.loads(index.read_text()).get("weight_map", {}))
    from safetensors import safe_open

    keys: list[str] = []
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            keys += list(st.keys())
    return keys


def text_prefix(keys: list[str]) -> str:
    """The wrapper prefix before the text model's keys (`language_model.`), or "" when the checkpoint names them
    as the causal-LM class does."""
    if any(k.startswith(TEXT_ROOTS) for k in keys):
        return ""
    return next((p for p in WRAPPER_PREFIXES if any(k.startswith(p + r) for k in keys for r in TEXT_ROOTS)), "")


def key_mapping(path: str | Path) -> dict[str, str] | None:
    """`from_pretrained(key_mapping=…)` that strips a wrapper prefix from the text model's keys, or None when
    there is none (other keys, e.g. a vision tower, stay unexpected and are not loaded)."""
    prefix = text_prefix(checkpoint_keys(path))
    return {f"^{re.escape(prefix)}": ""} if prefix else None
