"""Layer-id conventions (F4): the one place that converts between them.

Internal ids index HF `hidden_states` (0 = embeddings, i = input of decoder layer i; the residual
stream SGLang captures at the entry of layer i). SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids`
name "the output of decoder layer k" and the server adds +1 before capturing, so they are the
internal ids minus one. vLLM passes its ids through unchanged, so they equal the internal ids.
"""

from __future__ import annotations

ENGINES = ("sglang", "vllm")


def to_engine(layer_ids: list[int], engine: str) -> list[int]:
    """Internal ids → the ids written into `engine`'s draft config."""
    if engine == "sglang":
        return [i - 1 for i in layer_ids]
    if engine == "vllm":
        return list(layer_ids)
    raise KeyError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")


def from_engine(engine_ids: list[int], engine: str) -> list[int]:
    """Ids read from `engine`'s draft config → internal ids."""
    if engine == "sglang":
        return [i + 1 for i in engine_ids]
    if engine == "vllm":
        return list(engine_ids)
    raise KeyError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")


def sglang_default_ids(num_hidden_layers: int) -> list[int]:
    """What SGLang captures when `eagle_config` names no ids (internal convention)."""
    n = num_hidden_layers
    return [2, n // 2, n - 3]


def check_capturable(layer_ids: list[int], num_hidden_layers: int) -> None:
    """Raise if an id cannot be captured by a serving engine (the last layer's output never is)."""
    if layer_ids != sorted(set(layer_ids)):
        raise ValueError(f"aux layer ids {layer_ids} must be ascending and unique")
    bad = [i for i in layer_ids if not 1 <= i <= num_hidden_layers - 1]
    if bad:
        raise ValueError(f"aux layer ids {bad} (internal convention) are outside [1, {num_hidden_layers - 1}] "
                         f"for a {num_hidden_layers}-layer target; the last layer's output cannot be captured")
