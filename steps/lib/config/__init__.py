"""The one config for an eaglenest pipeline (`configs/*.yaml`).

- `schema`: one strict pydantic model a section; a typo names the file and the field.
- `derive`: values derived from the config and the target (aux layer ids, the draft's shape, F5's
  context length), derived once.
- `load`: YAML + dotted overrides → the schema; the canonical hash that goes into manifests.

Callers import from `steps.lib.config`.
"""

from steps.lib.config.derive import (
    resolve_aux_layer_ids,
    resolve_draft_shape,
    resolve_draft_vocab_size,
    resolve_max_position_embeddings,
)
from steps.lib.config.load import (
    CONFIGS_DIR,
    apply_overrides,
    config_dict,
    find_config,
    load_config,
    parse_config,
    section_hash,
    shipped_configs,
)
from steps.lib.config.schema import (
    SIZE_UNITS,
    BenchmarkConfig,
    DatagenConfig,
    DatasetConfig,
    DraftLayerConfig,
    ExportConfig,
    ExtractConfig,
    GateConfig,
    MappingConfig,
    PipelineConfig,
    PromptSource,
    Section,
    ServeConfig,
    SyntheticConfig,
    TargetConfig,
    TinyTarget,
    TrainConfig,
    VerifyConfig,
    parse_size,
)
from steps.lib.errors import ConfigError, InputError
from steps.lib.layer_ids import default_aux_layer_ids

__all__ = [
    "BenchmarkConfig",
    "CONFIGS_DIR",
    "ConfigError",
    "DatagenConfig",
    "DatasetConfig",
    "DraftLayerConfig",
    "ExportConfig",
    "ExtractConfig",
    "GateConfig",
    "InputError",
    "MappingConfig",
    "PipelineConfig",
    "PromptSource",
    "SyntheticConfig",
    "SIZE_UNITS",
    "Section",
    "ServeConfig",
    "TargetConfig",
    "TinyTarget",
    "TrainConfig",
    "VerifyConfig",
    "apply_overrides",
    "config_dict",
    "default_aux_layer_ids",
    "find_config",
    "load_config",
    "parse_config",
    "parse_size",
    "resolve_aux_layer_ids",
    "resolve_draft_shape",
    "resolve_draft_vocab_size",
    "resolve_max_position_embeddings",
    "section_hash",
    "shipped_configs",
]
