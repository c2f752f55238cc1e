"""Tiny, seeded builders shared by the test files: a free port, the byte-level ChatML tokenizer, tiny Llama
targets (random or "bigram"), EAGLE-3 drafts (random or copying), the artifacts the steps read, and one
tiny draft in each producer's checkpoint layout (for doctor and convert).

Plain functions, not fixtures: each test file picks its own sizes and wraps them in its own fixtures, so
what a test builds stays visible where it is asserted on (the checkpoint layouts excepted: one draft at
fixed sizes, `LAYOUT_*`, which doctor's and convert's tests both check). Every builder seeds torch itself, so the same
call gives the same weights in every file.

The "bigram" target: decoder layers add nothing (o_proj and down_proj zero) and the embeddings are
orthonormal, so every hidden state is the token's embedding and the next token is a fixed map B(x).
A copying draft knows B∘B through `fc`, so its first drafted token is always right: it accepts tokens
for real (τ well above 1), and stops accepting when `fc` is skipped (F1).
"""

from __future__ import annotations

import errno
import json
import os
import random
import socket
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from steps.lib import artifacts, formats
from steps.lib.config import parse_config
from steps.lib.model.draft import DraftConfig, Eagle3Draft
from steps.lib.store import open_store

#: the draft's canonical names, what SGLang's EAGLE-3 drafts (SpecForge, EAGLE official) and eaglenest write: the
#: `midlayer.` layout (pinned against SGLang 0.5.23's loader: see tests/unit/test_formats.py).
CANONICAL_DRAFT_KEYS = {
    "embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
}
#: the same draft as vLLM loads it in the speculators format (`Eagle3DraftModel.state_dict()` minus the unsaved
#: `verifier_*`; shared/reference/trainers.md §6.2): the one decoder layer is `layers.0.` (pinned in
#: tests/unit/test_formats.py). Written out, not derived from the SGLang names.
SPECULATORS_DRAFT_KEYS = {
    "embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    "layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight", "layers.0.post_attention_layernorm.weight",
    "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight", "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
}
LAYER_IDS = (1, 2, 3)          # internal convention; SGLang's eagle_config holds [0, 1, 2]


def ephemeral_ports() -> range:
    """The kernel's range for outgoing connections and bind(0) (Linux: /proc; elsewhere its default)."""
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999
    return range(lo, hi + 1)


_HANDED_OUT: set[int] = set()
_PORTS = random.Random()


def free_port() -> int:
    """A port a test server can bind a moment later, outside the ephemeral range.

    bind(0) hands out an ephemeral port, the range every outgoing connection on the machine (HTTP clients,
    the Prefect server's, other engineers' tests) also draws from: between our check and the server's own
    bind, one of those could take it. A random port below the range is taken only by another explicit bind.
    Never the same port twice in one test process."""
    below = range(20000, ephemeral_ports().start)
    for _ in range(200):
        port = _PORTS.choice(below) if len(below) > 1000 else _bound_port(0)   # a low range: the kernel's pick
        if port in _HANDED_OUT:
            continue
        try:
            _bound_port(port)
        except OSError:
            continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free port after 200 tries")


def _bound_port(port: int) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        return s.getsockname()[1]


def load_factor(cap: float = 5.0) -> float:
    """How much busier this machine is than one runnable process per core: the 1-minute load average over
    the cores, at least 1, at most `cap`. A wall-clock limit a test must set (a server's start-up deadline
    that one attempt is meant to meet) is its quiet-machine value times this."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1.0
    return min(cap, max(1.0, load / (os.cpu_count() or 1)))


def cli_record(capsys, main, *argv: str) -> tuple[int, dict]:
    """Run a step's `main(argv + --json)`; (exit code, the one JSON line it printed on stdout)."""
    capsys.readouterr()
    code = main([*argv, "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out
    return code, json.loads(out[0])


def record_of(store, manifest) -> dict:
    """What `--json` must print for `manifest` (`steps.registry.record`): the step, kind, id, the URI as
    ARCHITECTURE.md lays it out, metrics and meta; `seconds` is whatever run() took."""
    from unittest.mock import ANY

    return {"step": manifest.step, "kind": manifest.kind, "id": manifest.id, "seconds": ANY,
            "uri": f"{store.uri.rstrip('/')}/artifacts/{manifest.kind}/{manifest.id}",
            "metrics": manifest.metrics, "meta": manifest.meta}

# --- targets -------------------------------------------------------------------------------------------

def byte_tokenizer():
    """A byte-level BPE tokenizer without merges (256 byte tokens + 3 specials) and the ChatML template."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    from steps.target import CHATML_TEMPLATE

    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}, merges=[]))
    tk.pre_tokenizer, tk.decoder = ByteLevel(add_prefix_space=False, use_regex=False), decoders.ByteLevel()
    tk.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = CHATML_TEMPLATE
    return tok


def tiny_llama(*, vocab_size: int, hidden_size: int, intermediate_size: int, num_hidden_layers: int = 4,
               seed: int = 0, **config):
    """A seeded random tiny Llama (4 heads, 2 KV heads, context 512) in eval mode; `config` adds LlamaConfig fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                                        intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                        **config)).eval()


def make_bigram(model, *, mlp_layer: int | None = None, mlp_scale: float = 400.0):
    """Turn `model` into a bigram target in place (see the module docstring) and return it.

    `mlp_layer` keeps that decoder layer's MLP, scaled by `mlp_scale`, so the hidden states after it
    differ from the ones before it (the next token still depends on x only: attention stays off).
    """
    h, v = model.config.hidden_size, model.config.vocab_size
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.o_proj.weight.zero_()
            if i == mlp_layer:
                layer.mlp.down_proj.weight.mul_(mlp_scale)
            else:
                layer.mlp.down_proj.weight.zero_()
        q, _ = torch.linalg.qr(torch.randn(h, h))
        model.model.embed_tokens.weight.copy_(q[:v] * 3.0)
    return model


def save_hf_dir(model, tok, root: Path) -> Path:
    out = root / "target"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def tiny_target_dir(root: Path, *, vocab_size: int, hidden_size: int, intermediate_size: int,
                    num_hidden_layers: int = 4) -> Path:
    """A seeded random tiny Llama (tied embeddings) + the byte-level ChatML tokenizer, saved as an HF directory."""
    tok = byte_tokenizer()
    model = tiny_llama(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                       num_hidden_layers=num_hidden_layers, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    return save_hf_dir(model, tok, root)


def tiny_hf_config(root: Path, *, vocab_size: int, extract: dict | None = None, train: dict | None = None) -> Path:
    """configs/tiny.yaml with a seeded 64-wide hf_dir target (`tiny_target_dir`) and sizes that make several
    shards and training steps in seconds; `extract`/`train` update those sections. Returns the YAML's path
    (for step processes: `python -m steps.<step> --config PATH`)."""
    import yaml

    tdir = tiny_target_dir(root, vocab_size=vocab_size, hidden_size=64, intermediate_size=128)
    data = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs/tiny.yaml").read_text())
    data["target"] = {"source": "hf_dir", "path": str(tdir)}
    data["extract"].update({"shard_tokens": 200, "batch_size": 4, "max_length": 128, "disk_budget": "1MB",
                            **(extract or {})})
    data["mapping"] = {"draft_vocab_size": 128}
    data["train"].update({"ttt_steps": 2, "epochs": 3, "batch_tokens": 128, "max_length": 128,
                          "checkpoint_every": 4, **(train or {})})
    path = root / "tiny-hf.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def bigram_target(root: Path, *, vocab_size: int | None = None, hidden_size: int = 288, intermediate_size: int = 256,
                  num_hidden_layers: int = 4, mlp_layer: int | None = None):
    """A bigram target with the byte-level ChatML tokenizer, saved under root/target: (model, directory).

    `vocab_size` defaults to the tokenizer's length."""
    tok = byte_tokenizer()
    model = tiny_llama(vocab_size=vocab_size or len(tok), hidden_size=hidden_size,
                       intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
                       eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    make_bigram(model, mlp_layer=mlp_layer)
    return model, save_hf_dir(model, tok, root)


def bigram_target_dir(root: Path, **kw) -> Path:
    """`bigram_target`'s directory."""
    return bigram_target(root, **kw)[1]


# --- drafts --------------------------------------------------------------------------------------------

def draft_config(*, vocab_size: int, hidden_size: int, draft_vocab_size: int, intermediate_size: int = 256,
                 num_aux: int = 3) -> DraftConfig:
    """A tiny draft's config for a target of width `hidden_size` (4 heads, 2 KV heads, context 512)."""
    return DraftConfig(hidden_size=hidden_size, intermediate_size=intermediate_size, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=hidden_size // 4, rms_norm_eps=1e-6, rope_theta=10000.0,
                       max_position_embeddings=512, vocab_size=vocab_size, draft_vocab_size=draft_vocab_size,
                       target_hidden_size=hidden_size, num_aux=num_aux)


def random_draft(seed: int, *, vocab_size: int, hidden_size: int, draft_vocab_size: int,
                 intermediate_size: int = 256, num_aux: int = 3, embed: torch.Tensor | None = None) -> Eagle3Draft:
    """A seeded random draft over a random sorted reduced vocab; `embed` replaces its embedding (the target's)."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(draft_config(vocab_size=vocab_size, hidden_size=hidden_size, draft_vocab_size=draft_vocab_size,
                                     intermediate_size=intermediate_size, num_aux=num_aux)).eval()
    ids = torch.randperm(vocab_size)[:draft_vocab_size].sort().values
    with torch.no_grad():
        if embed is not None:
            draft.embed_tokens.weight.copy_(embed)
        draft.d2t.copy_(ids - torch.arange(draft_vocab_size))
        draft.t2d[ids] = True
    return draft


def copying_draft(target, *, bigram: torch.Tensor | None = None, intermediate_size: int = 256, num_aux: int = 3,
                  seed: int = 1) -> Eagle3Draft:
    """A draft for a bigram target (a model, or its HF directory): out_hidden = fc(aux) = Q·E[x_p]; lm_head
    scores B(B(x_p)); the reduced vocab is the image of B, so every generated token lies in it.

    Its d_1 is always right; later chain steps reuse the same hidden, so they are right only on fixed
    points. `bigram` is B[x] when the target computes it otherwise than lm_head(normed E[x]).
    """
    if isinstance(target, (str, Path)):
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    v, h = target.config.vocab_size, target.config.hidden_size
    emb = target.model.embed_tokens.weight.detach()
    normed = emb / emb.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    if bigram is None:
        bigram = (target.lm_head.weight.detach() @ normed.T).argmax(0)          # B[x]
    vocab = torch.unique(bigram)                                                # sorted target ids
    torch.manual_seed(seed)
    draft = Eagle3Draft(draft_config(vocab_size=v, hidden_size=h, draft_vocab_size=len(vocab),
                                     intermediate_size=intermediate_size, num_aux=num_aux)).eval()
    q, _ = torch.linalg.qr(torch.randn(h, h))
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(emb)
        draft.fc.weight.zero_()
        draft.fc.weight[:, :h] = q                                              # reads the first aux state
        draft.midlayer.self_attn.o_proj.weight.zero_()
        draft.midlayer.mlp.down_proj.weight.zero_()
        head = torch.zeros(len(vocab), h)
        for x in range(v):
            head[torch.searchsorted(vocab, bigram[bigram[x]])] += q @ normed[x]
        draft.lm_head.weight.copy_(head)
        draft.d2t.copy_(vocab - torch.arange(len(vocab)))
        draft.t2d[vocab] = True
    return draft


def scripted_chain_counts(x: list[int], prompt_len: int, k: int, max_new_tokens: int,
                          eos: int | None) -> tuple[int, int]:
    """(accepted drafts, verify steps) the copying draft must give on the target's greedy sequence `x`.

    The script (copying_draft above): after x[n] its chain is d_1 = ... = d_k = x[n+1] (d_1 is
    B∘B of the real feed; later steps reuse the same hidden), so d_j is accepted while x[n+j] == x[n+1];
    each round commits a + 1 tokens. Rounds run until max_new_tokens or an eos is out (Engine.stream).
    """
    n, accepted, steps = prompt_len, 0, 0
    while True:
        out = x[prompt_len:n + 1][:max_new_tokens]
        if len(out) >= max_new_tokens or (eos is not None and eos in out):
            return accepted, steps
        a = next((j - 1 for j in range(2, k + 1) if x[n + j] != x[n + 1]), k)
        accepted, steps, n = accepted + a, steps + 1, n + a + 1


def scripted_totals(target_dir: Path, prompts: list[list[int]], k: int, max_new_tokens: int,
                    eos: int | None) -> list[tuple[int, int]]:
    """scripted_chain_counts per prompt, on the target's own greedy continuation (k tokens past the end:
    a chain may look that far)."""
    from transformers import AutoModelForCausalLM

    from steps.lib.model.reference_engine import Engine

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    plain = Engine(target, None, None, layer_ids=[], num_steps=k)
    return [scripted_chain_counts(list(ids) + plain.generate_plain(ids, max_new_tokens + k + 1), len(ids), k,
                                  max_new_tokens, eos) for ids in prompts]


# --- artifacts -----------------------------------------------------------------------------------------

def put_draft(store, draft: Eagle3Draft, *, draft_id: str = "c09e1d2a0f7b3c11", layer_ids=LAYER_IDS,
              num_hidden_layers: int = 4, target_name: str = "bigram") -> str:
    """Write `draft` as train does: a `draft` artifact of canonical fp32 weights + draft_config.json."""
    writer = store.begin("draft", draft_id, step="train")
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, str(writer.path("model.safetensors")))
    meta = {**draft.cfg.to_dict(), "layer_ids": list(layer_ids),
            "target": {"num_hidden_layers": num_hidden_layers, "hidden_size": draft.cfg.target_hidden_size,
                       "vocab_size": draft.cfg.vocab_size, "max_position_embeddings": 512, "name": target_name}}
    writer.path("draft_config.json").write_text(json.dumps(meta))
    writer.commit(meta=meta)
    return draft_id


def put_random_draft(store, target_dir: Path, *, draft_vocab_size: int, intermediate_size: int, num_aux: int = 3,
                     layer_ids=LAYER_IDS, seed: int = 0) -> str:
    """A seeded random draft for the HF target in `target_dir` (its embedding copied), written by `put_draft`.

    The id names seed, num_aux and layer_ids (16 hex digits, as the CLI takes them), so variants of one store
    do not collide."""
    tcfg = json.loads((target_dir / "config.json").read_text())
    draft = random_draft(seed, vocab_size=tcfg["vocab_size"], hidden_size=tcfg["hidden_size"],
                         draft_vocab_size=draft_vocab_size, intermediate_size=intermediate_size, num_aux=num_aux,
                         embed=load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"])
    draft_id = f"d{seed}{num_aux}{''.join(map(str, layer_ids))}".ljust(16, "0")
    return put_draft(store, draft, draft_id=draft_id, layer_ids=layer_ids,
                     num_hidden_layers=tcfg["num_hidden_layers"], target_name="tiny")


def put_token_dataset(store, *, vocab_size: int, num_rows: int = 24, seed: int = 0, dataset_id: str = "tokens") -> str:
    """A `dataset` artifact as datagen writes it (`conversations/*.jsonl` rows with `input_ids` and `loss_mask`),
    of seeded random token ids in [3, vocab_size): the first third of each row is the prompt, the rest the answer
    that carries the loss. No tokenizer: for extract, mapping and train on a tiny target."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for k in range(num_rows):
        n = int(torch.randint(12, 48, (1,), generator=g))
        ids = torch.randint(3, vocab_size, (n,), generator=g).tolist()
        rows.append({"id": f"r{k}", "source": "builders", "messages": [], "input_ids": ids,
                     "loss_mask": [int(i >= n // 3) for i in range(n)]})
    writer = store.begin("dataset", dataset_id, step="datagen")
    writer.path("conversations/part-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    writer.commit(metrics={"ok": len(rows), "tokens": sum(len(r["input_ids"]) for r in rows)})
    return dataset_id


def tiny_pipeline_config(target_dir: Path, *, draft_vocab_size: int, layer_ids=LAYER_IDS, **sections):
    """The export/verify config for an HF-dir target; `sections` replace whole sections."""
    return parse_config({"name": "t", "target": {"source": "hf_dir", "path": str(target_dir)},
                         "extract": {"aux_layer_ids": list(layer_ids)},
                         "mapping": {"draft_vocab_size": draft_vocab_size}, "export": {"dtype": "float32"},
                         "verify": {"num_prompts": 2, "max_new_tokens": 10}, **sections})


def bigram_world(root: Path, port: int, *, num_steps: int = 3, layer_ids=LAYER_IDS, **sections) -> dict:
    """A bigram target and its copying draft, exported by steps.export for the reference server on `port`.

    `sections` add or replace config sections (e.g. `benchmark`)."""
    from steps import export, target

    tdir = bigram_target_dir(root)
    store = open_store(f"file://{root}/store")
    cfg = parse_config({"name": "t", "target": {"source": "hf_dir", "path": str(tdir)},
                        "extract": {"aux_layer_ids": list(layer_ids)}, "export": {"dtype": "float32"},
                        "verify": {"num_prompts": 3, "max_new_tokens": 24},
                        "serve": {"engine": "reference", "port": port, "num_steps": num_steps,
                                  "num_draft_tokens": num_steps + 1, "startup_timeout_s": 60}, **sections})
    target_id = target.run(cfg, store).id
    draft_id = put_draft(store, copying_draft(tdir), layer_ids=layer_ids)
    export_id = export.run(cfg, store, draft_id, target_id).id
    return {"store": store, "cfg": cfg, "target_id": target_id, "export_id": export_id, "target_dir": tdir,
            "draft_dir": artifacts.export_dir(store, export_id, "sglang")}


# --- checkpoint layouts: one tiny draft as each producer lays it out (doctor, convert) -------------------
#
# Each builder writes the same seeded draft (`layout_draft_state`) as one producer writes it; sources:
# - eaglenest `sglang/` and `vllm/`: `steps.lib.formats.write_engine_dir` with `sglang_config` / `vllm_config`.
# - SpecForge's SGLang export: config fields of sgl-project/SpecForge@82b62f6ebe950866925384d4c90f62aa3594934f
#   `configs/llama3-70B-ealge3.json` (architectures ["LlamaForCausalLMEagle3"], model_type llama,
#   num_hidden_layers 1, draft_vocab_size, tie_word_embeddings false, torch_dtype, rope_theta, no
#   eagle_config, no target_hidden_size); keys: SpecForge's draft names (`midlayer.*`, `fc`, `norm`,
#   `lm_head`, `d2t`, `t2d`); `specforge export --to sglang` drops `embed_tokens` (shared/reference/trainers.md §6.2).
# - speculators: vllm-project/speculators@11ecdd3385ed00258b89b0de8b55a0074ced9ec4
#   `src/speculators/models/eagle3/config.py` (`Eagle3SpeculatorConfig`: speculators_model_type "eagle3",
#   architectures ["Eagle3Speculator"], transformer_layer_config, draft_vocab_size, norm_before_residual,
#   target_hidden_size, eagle_aux_hidden_state_layer_ids, embed_requires_grad) and the `midlayer.` →
#   `layers.0.` rename of `convert/eagle/eagle3_converter.py` (as cited in steps/lib/formats.py).
# - EAGLE official (yuhuili/EAGLE3-*): SafeAILab/EAGLE `eagle/model/cnets.py` (`Model`: `embed_tokens`,
#   `fc`, `midlayer`, `norm`, `lm_head`, `d2t`/`t2d` buffers) and the released config.json with
#   architectures ["LlamaForCausalLM"] and no eagle_config (shared/reference/sglang.md §1.1, §5).

LAYOUT_V, LAYOUT_H, LAYOUT_VD, LAYOUT_N = 272, 64, 128, 8   # target vocab, hidden, draft vocab, target layers
LAYOUT_LAYER_IDS = [2, 4, 5]                                 # internal = the defaults [2, N//2, N-3] for N = 8
LAYOUT_DRAFT = dict(hidden_size=LAYOUT_H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
                    vocab_size=LAYOUT_V, draft_vocab_size=LAYOUT_VD, target_hidden_size=LAYOUT_H, num_aux=3)


def layout_draft_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """The canonical-named state dict of a seeded random draft of `LAYOUT_DRAFT`'s sizes."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(DraftConfig(**LAYOUT_DRAFT))
    ids = torch.randperm(LAYOUT_V)[:LAYOUT_VD].sort().values
    draft.d2t.copy_(ids - torch.arange(LAYOUT_VD))
    draft.t2d[ids] = True
    return {k: v.detach().clone() for k, v in draft.state_dict().items()}


def eaglenest_layout(root: Path, engine: str, **build) -> Path:
    """root/<engine>: eaglenest's own `sglang` or `vllm` export dir; `layer_ids` (internal) overrides the ids."""
    from steps.lib import formats

    fields = {k: v for k, v in LAYOUT_DRAFT.items() if k != "num_aux"}
    config = formats.CONFIG_BUILDERS[engine](
        fields, layer_ids=build.get("layer_ids", LAYOUT_LAYER_IDS), max_position_embeddings=512, dtype="float32",
        verifier_name_or_path="tiny", verifier_architectures=["LlamaForCausalLM"], speculative_tokens=3)
    return formats.write_engine_dir(root / engine, engine, layout_draft_state(), config, dtype="float32")


def write_checkpoint_dir(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """`path` with model.safetensors and config.json."""
    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def layout_llama_fields() -> dict:
    return {"hidden_act": "silu", "hidden_size": LAYOUT_H, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 512, "vocab_size": LAYOUT_V, "tie_word_embeddings": False,
            "num_hidden_layers": 1}


def specforge_layout(root: Path, *, prefix: str = "", config_edit=None, state_edit=None) -> Path:
    """root/specforge, as `specforge export --to sglang` writes it: LlamaForCausalLMEagle3 config, midlayer.* keys,
    no embed_tokens. `prefix` goes before every key; `config_edit` / `state_edit` change the dicts in place."""
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **layout_llama_fields(),
              "draft_vocab_size": LAYOUT_VD, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
              "pad_token_id": 0, "use_cache": True}
    state = {k: v for k, v in layout_draft_state().items() if k != "embed_tokens.weight"}
    if config_edit:
        config_edit(config)
    if state_edit:
        state_edit(state)
    return write_checkpoint_dir(root / "specforge", config, {prefix + k: v for k, v in state.items()})


def speculators_layout(root: Path) -> Path:
    """root/speculators: an Eagle3Speculator config and `layers.0.` keys."""
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "speculators_version": "0.3.0",
              "transformer_layer_config": {"model_type": "llama", **layout_llama_fields()},
              "draft_vocab_size": LAYOUT_VD, "norm_before_residual": False, "target_hidden_size": LAYOUT_H,
              "eagle_aux_hidden_state_layer_ids": LAYOUT_LAYER_IDS, "embed_requires_grad": False,
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                     "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}}}
    state = {k.replace("midlayer.", "layers.0.", 1): v for k, v in layout_draft_state().items()}
    return write_checkpoint_dir(root / "speculators", config, state)


def eagle_official_layout(root: Path) -> Path:
    """root/official, as yuhuili/EAGLE3-*: a Llama config with draft_vocab_size, EAGLE's cnets.Model state dict."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **layout_llama_fields(),
              "draft_vocab_size": LAYOUT_VD, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}
    return write_checkpoint_dir(root / "official", config, layout_draft_state())


# --- the failure catalogue's world (tests/integration/test_failure_catalogue.py, test_sglang_loader.py) -----

CATALOGUE_V, CATALOGUE_H, CATALOGUE_N = 272, 288, 4
CATALOGUE_LAYER_IDS = [1, 2, 3]              # internal; SGLang eagle_config [0, 1, 2]


def build_target(root: Path):
    """The bigram target whose decoder layer 1 keeps its MLP (×400): hidden_states[1] ≠ hidden_states[2]."""
    return bigram_target(root, vocab_size=CATALOGUE_V, hidden_size=CATALOGUE_H, intermediate_size=64,
                         num_hidden_layers=CATALOGUE_N, mlp_layer=1)


def next_token_map(target) -> torch.Tensor:
    """B[x], read off the target's own forward: layer 1's MLP moves the final hidden state away from E[x]."""
    with torch.no_grad():
        return target(input_ids=torch.arange(CATALOGUE_V)[:, None]).logits[:, 0].argmax(-1)


def export_sglang(out: Path, draft: Eagle3Draft, *, layer_ids=CATALOGUE_LAYER_IDS, **config_edits) -> Path:
    config = formats.sglang.build_config(draft.cfg.to_dict(), layer_ids=layer_ids, max_position_embeddings=512,
                                   dtype="float32")
    config.update(config_edits)
    return formats.write_engine_dir(out, "sglang", draft.state_dict(), config, dtype="float32")


def variant(world, name: str, *, rename=None, drop=(), edit=None, **config_edits) -> Path:
    """The healthy export with one thing wrong (weights renamed / dropped / edited, config fields edited)."""
    src, out = world["healthy"], world["export"] / name
    out.mkdir()
    tensors = {(rename(k) if rename else k): v for k, v in load_file(str(src / "model.safetensors")).items()
               if k not in drop}
    if edit:
        edit(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    for key, value in config_edits.items():
        if key == "eagle_ids":
            config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = value
        else:
            config[key] = value
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def misalign_d2t(tensors: dict[str, torch.Tensor]) -> None:
    ids = torch.arange(len(tensors["d2t"])) + tensors["d2t"]
    tensors["d2t"] = torch.roll(ids, 1) - torch.arange(len(ids))


# --- mapping's inputs ------------------------------------------------------------------------------------

#: the ids of `mapping_world`'s target and dataset
MAPPING_TARGET, MAPPING_DATASET = "7a7a000000000001", "da7a000000000001"


def mapping_world(tmp_path) -> dict:
    """A config file and a store holding a target and a dataset (mapping's inputs), nothing else: what a
    step CLI or a step process needs to run `mapping` for real in a test."""
    import yaml

    from steps.lib.store import open_store

    store = open_store(f"file://{tmp_path}/store")
    t = store.begin("target", MAPPING_TARGET, step="target")
    t.path("config.json").write_text(json.dumps({"vocab_size": 64, "hidden_size": 8}))
    t.commit(meta={"source": "tiny"})
    d = store.begin("dataset", MAPPING_DATASET, step="datagen")
    rows = [{"id": "a", "input_ids": [1, 5, 5, 9, 60], "loss_mask": [0, 1, 1, 1, 0]}]
    d.path("conversations/part-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    d.commit()
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"name": "t", "store": f"file://{tmp_path}/config-store",
                                      "target": {"source": "tiny"}, "mapping": {"draft_vocab_size": 2}}))
    return {"store": store, "config": str(config), "tmp": tmp_path}




class _FullDiskFile:
    """A file opened for writing on a disk with no space left: the file is created, every write fails with
    ENOSPC and names no file, as `f.write` does on a full disk."""

    def __init__(self, path: Any, mode: str):
        self._f = open(path, mode)  # noqa: SIM115  (closed by close / __exit__)

    def write(self, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> _FullDiskFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def full_disk_in(monkeypatch: Any, module: Any) -> None:
    """The disk is full for `module`'s own `open(..., "w"/"a")` calls (its reads still work)."""
    def open_on_a_full_disk(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if any(c in mode for c in "wax"):
            return _FullDiskFile(path, mode)
        return open(path, mode, *args, **kwargs)  # noqa: SIM115

    monkeypatch.setattr(module, "open", open_on_a_full_disk, raising=False)


# --- a tiny DeepSeek-V3-architecture target (the founding case's family) ----------------------------------

#: MLA (q/kv LoRA ranks, split rope/nope heads), 4 routed experts of which 2 per token + 1 shared expert,
#: the first layer dense as in the real checkpoint; untied lm_head.
TINY_DEEPSEEK = dict(vocab_size=272, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                     n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                     q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                     max_position_embeddings=512, tie_word_embeddings=False, rope_scaling=None)


def tiny_deepseek_dir(root: Path, *, prefix: str = "language_model.", seed: int = 0) -> Path:
    """A seeded random `DeepseekV3ForCausalLM` (`TINY_DEEPSEEK`) + the byte-level ChatML tokenizer, saved as an
    HF directory whose weight names carry `prefix` as Kimi-K2.5's text weights do (`language_model.model.…`)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    tok = byte_tokenizer()
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**TINY_DEEPSEEK, eos_token_id=tok.eos_token_id)).eval()
    out = save_hf_dir(model, tok, root)
    weights = out / "model.safetensors"
    state = load_file(str(weights))
    save_file({prefix + k: v for k, v in state.items()}, str(weights), metadata={"format": "pt"})
    return out
