"""Layer-id conventions (F4): the one place that converts between them.

Internal ids index HF `hidden_states` (0 = embeddings, i = input of decoder layer i; the residual
stream SGLang captures at the entry of layer i). SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids`
name "the output of decoder layer k" and the server adds +1 before capturing, so they are the
internal ids minus one. vLLM passes its ids through unchanged, so they equal the internal ids.
The offsets are data here, keyed by the engine names of `steps/lib/formats/` ENGINES (a test pins
the two key sets equal), so the formats import this module and never the other way round.

Some target families' model classes do not apply their engine's plain offset: SGLang's DeepSeek
V2/V3 family (`srt/models/deepseek_v2.py`, `set_eagle3_layers_to_capture`; also Kimi-K2.5, whose
wrapper delegates to it, and GLM-4-MoE-Lite) adds the +1 only when the first id is 1 and takes the
ids unshifted otherwise. Those rules are data too (ENGINE_FAMILY_RULES), keyed by the target's
`architectures[0]`; pass it as `arch` and the conversion is the one that engine applies to that target.
"""

from __future__ import annotations

#: engine → (id written into that engine's draft config) − (internal id).
ENGINE_ID_OFFSETS: dict[str, int] = {"sglang": -1, "vllm": 0}

#: the engine shifts the ids by its offset only when its first id is 1 (else it captures them as given).
SHIFT_ONLY_IF_FIRST_IS_ONE = "shift_only_if_first_is_one"
#: engine → target architecture → the rule its model class applies instead of the plain offset.
ENGINE_FAMILY_RULES: dict[str, dict[str, str]] = {
    "sglang": {arch: SHIFT_ONLY_IF_FIRST_IS_ONE for arch in (
        "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
        "KimiK25ForConditionalGeneration", "Glm4MoeLiteForCausalLM")},
}


class InexpressibleLayerIds(ValueError):
    """Internal ids that an engine cannot be told to capture for a target family."""


def target_architecture(target_config: dict) -> str | None:
    """A target config.json's `architectures[0]`: the engine model class whose layer-id rule applies."""
    return (target_config.get("architectures") or [None])[0]


def family_rule(engine: str, arch: str | None) -> str | None:
    """The rule `engine` applies to a target of architecture `arch`, or None for its plain offset."""
    return ENGINE_FAMILY_RULES.get(engine, {}).get(arch or "")


def check_expressible(layer_ids: list[int], engine: str, arch: str | None) -> None:
    """Raise InexpressibleLayerIds (one line) if `engine` cannot capture these internal ids on `arch`."""
    if family_rule(engine, arch) == SHIFT_ONLY_IF_FIRST_IS_ONE and layer_ids and layer_ids[0] == 1:
        # written as is, [1, …] is shifted; shifted by the offset, it no longer starts at 1 and is not
        raise InexpressibleLayerIds(
            f"aux layer ids {layer_ids} (internal) cannot be served by {engine} on a {arch} target: it shifts "
            f"the ids only when the first is 1, so no config makes it capture internal {layer_ids[0]} first; "
            f"start at internal {layer_ids[0] + 1} or later (the default [2, N//2, N-3])")


def _offset(engine: str) -> int:
    if engine not in ENGINE_ID_OFFSETS:
        raise KeyError(f"unknown engine {engine!r}; known: {', '.join(ENGINE_ID_OFFSETS)}")
    return ENGINE_ID_OFFSETS[engine]


def to_engine(layer_ids: list[int], engine: str, arch: str | None = None) -> list[int]:
    """Internal ids → the ids written into `engine`'s draft config for a target of architecture `arch`."""
    offset = _offset(engine)
    if family_rule(engine, arch) == SHIFT_ONLY_IF_FIRST_IS_ONE:
        check_expressible(layer_ids, engine, arch)
        # the shifted form when the engine will shift it back (first id 1), the ids themselves otherwise
        return [i + offset for i in layer_ids] if layer_ids and layer_ids[0] + offset == 1 else list(layer_ids)
    return [i + offset for i in layer_ids]


def from_engine(engine_ids: list[int], engine: str, arch: str | None = None) -> list[int]:
    """Ids read from `engine`'s draft config → the internal ids it captures on a target of `arch`."""
    if family_rule(engine, arch) == SHIFT_ONLY_IF_FIRST_IS_ONE and not (engine_ids and engine_ids[0] == 1):
        return list(engine_ids)
    return [i - _offset(engine) for i in engine_ids]


def default_aux_layer_ids(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's default capture points, internal convention: `[2, N//2, N-3]`.

    SGLang, vLLM and the EAGLE repo use the same loop indices when a draft names no ids, so this is
    also what a server captures for a draft whose config omits them.
    """
    n = num_hidden_layers
    ids = [2, n // 2, n - 3]
    if n < 4 or len(set(ids)) < 3:
        raise ValueError(f"a target with {n} layers is too shallow for the default EAGLE-3 aux layers "
                         f"{ids} (need 3 distinct ids, N ≥ 7); set extract.aux_layer_ids explicitly")
    return ids


def check_capturable(layer_ids: list[int], num_hidden_layers: int) -> None:
    """Raise if ids are unordered, repeated or not capturable (the last layer's output never is)."""
    if not layer_ids:
        raise ValueError("aux layer ids [] capture nothing")
    if layer_ids != sorted(set(layer_ids)):
        raise ValueError(f"aux layer ids {layer_ids} must be ascending and unique")
    bad = [i for i in layer_ids if not 1 <= i <= num_hidden_layers - 1]
    if bad:
        raise ValueError(f"aux layer ids {layer_ids}: {bad} out of range [1, {num_hidden_layers - 1}] "
                         f"(internal convention) for a {num_hidden_layers}-layer target; "
                         "the last layer's output cannot be captured")
