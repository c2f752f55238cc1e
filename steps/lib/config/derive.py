"""Values derived from a config and the target's config.json, derived once here; call sites never
re-derive them (aux layer ids, the draft's shape, its `max_position_embeddings`)."""

from __future__ import annotations

from typing import Any

from steps.lib.config.schema import PipelineConfig
from steps.lib.errors import ConfigError
from steps.lib.layer_ids import check_capturable, check_expressible, default_aux_layer_ids


def resolve_aux_layer_ids(cfg: PipelineConfig, num_hidden_layers: int, target_arch: str | None = None) -> list[int]:
    """The aux layer ids actually captured (internal convention), validated against the target: capturable,
    and expressible in each exported engine's config for a target of architecture `target_arch` (F4)."""
    configured = cfg.extract.aux_layer_ids
    if configured is not None and not configured:
        raise ConfigError("extract.aux_layer_ids=[] captures nothing; leave it unset for the default "
                          "[2, N//2, N-3]")
    try:
        ids = list(configured) if configured is not None else default_aux_layer_ids(num_hidden_layers)
        check_capturable(ids, num_hidden_layers)
        for engine in cfg.export.engines:       # refused before hours of extraction, not at export
            check_expressible(ids, engine, target_arch)
    except ValueError as err:
        raise ConfigError(f"extract.aux_layer_ids: {err}") from None
    return ids


def resolve_draft_vocab_size(cfg: PipelineConfig, target_vocab: int, where: str) -> int:
    """`mapping.draft_vocab_size`, refused when the target (its config.json at `where`) has fewer tokens."""
    size = cfg.mapping.draft_vocab_size
    if size > target_vocab:
        raise ConfigError(f"mapping.draft_vocab_size={size} exceeds the target's vocab_size={target_vocab} "
                          f"({where}); set mapping.draft_vocab_size to at most {target_vocab}")
    return size


def resolve_draft_shape(cfg: PipelineConfig, target_config: dict[str, Any]) -> dict[str, int]:
    """The draft decoder layer's shape: configured values, else the target's."""
    d = cfg.train.draft
    heads = d.num_attention_heads or target_config["num_attention_heads"]
    hidden = target_config["hidden_size"]
    return {
        "hidden_size": hidden,
        "intermediate_size": d.intermediate_size or target_config["intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": d.num_key_value_heads or target_config.get("num_key_value_heads", heads),
        "head_dim": d.head_dim or target_config.get("head_dim") or hidden // heads,
    }


def resolve_max_position_embeddings(cfg: PipelineConfig, target_config: dict[str, Any]) -> int:
    """The draft's `max_position_embeddings`: the target's serving context (F5)."""
    return int(cfg.target.context_length or target_config["max_position_embeddings"])
