"""Layer-id conventions (F4): the one place that converts between them.

Internal ids index HF `hidden_states` (0 = embeddings, i = input of decoder layer i; the residual
stream SGLang captures at the entry of layer i). SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids`
name "the output of decoder layer k" and the server adds +1 before capturing, so they are the
internal ids minus one. vLLM passes its ids through unchanged, so they equal the internal ids.
The offsets are data here, keyed by the engine names of `steps/lib/formats/` ENGINES (a test pins
the two key sets equal), so the formats import this module and never the other way round.
"""

from __future__ import annotations

#: engine → (id written into that engine's draft config) − (internal id).
ENGINE_ID_OFFSETS: dict[str, int] = {"sglang": -1, "vllm": 0}


def _offset(engine: str) -> int:
    if engine not in ENGINE_ID_OFFSETS:
        raise KeyError(f"unknown engine {engine!r}; known: {', '.join(ENGINE_ID_OFFSETS)}")
    return ENGINE_ID_OFFSETS[engine]


def to_engine(layer_ids: list[int], engine: str) -> list[int]:
    """Internal ids → the ids written into `engine`'s draft config."""
    return [i + _offset(engine) for i in layer_ids]


def from_engine(engine_ids: list[int], engine: str) -> list[int]:
    """Ids read from `engine`'s draft config → internal ids."""
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
