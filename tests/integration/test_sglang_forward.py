"""SGLang 0.5.23's own EAGLE-3 draft forward is the judge of ours (steps/lib/model/draft.py `Eagle3Draft`).

Every τ the pipeline reports (verify, the reference server, the catalogue, e2e) comes from our forward.
A changed concatenation order, residual or norm placement would keep those τ high while SGLang, serving
the same export, accepted nothing. Here a seeded random draft (every weight random, norms included, so a
swap of any two same-shaped tensors changes the output) is written by the export's own writer
(`formats.write_engine_dir` with `formats.sglang.build_config`, as steps/export.py calls them), loaded by
SGLang exactly as a server start loads it, and run through SGLang's `LlamaModel.forward`
(tests/integration/sglang_forward_judge.py: SGLang's layers on their torch paths; only the attention
kernel and the logits matmul are the judge's). Our draft as trained (in memory), and as the reference
engine's loader reads the directory back, must give the same logits and the same hidden for the next
chain step, within
`ATOL` (float32 throughout; measured gap 8e-7 on logits of std 1).

Negative controls: the same export with two same-shaped tensors swapped (gate_proj ↔ up_proj,
input_layernorm ↔ hidden_norm) — what a wrong key table in export or convert writes — gives other logits.

A missing `.venv-sglang` FAILS this test, never skips it (scripts/setup-sglang-venv.sh builds it).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from steps.lib.formats.sglang_loader import load_sglang_draft
from tests.builders import CATALOGUE_LAYER_IDS, export_sglang, random_draft
from tests.integration.test_sglang_loader import SGLANG_PYTHON

JUDGE = Path(__file__).with_name("sglang_forward_judge.py")
V, H, VD, S = 96, 64, 40, 12
#: float32 on both sides; the two differ only in summation order (SGLang's fused qkv / gate_up matmuls)
ATOL = 1e-5
#: same-shaped tensors a wrong key table could exchange without any shape error
SWAPS = {"gate-up": ("midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight"),
         "norms": ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight")}
pytestmark = pytest.mark.usefixtures("one_thread")


def target_dir(root: Path) -> Path:
    """A config.json-only Llama target: SGLang reads the target's config to publish its server args."""
    out = root / "target"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": H // 4,
        "vocab_size": V, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32"}))
    return out


def randomized(seed: int):
    """random_draft with every float tensor random, norm weights around 1 (not all ones)."""
    draft = random_draft(seed, vocab_size=V, hidden_size=H, draft_vocab_size=VD, intermediate_size=128)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1 + 0.5 * torch.rand(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return draft


def swapped(src: Path, out: Path, a: str, b: str) -> Path:
    out.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    tensors[a], tensors[b] = tensors[b], tensors[a]
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text((src / "config.json").read_text())
    return out


def sglang_forward(draft: Path, target: Path, inputs: Path, out: Path) -> dict:
    if not SGLANG_PYTHON.exists():
        pytest.fail(f"{SGLANG_PYTHON} is missing: run scripts/setup-sglang-venv.sh first. SGLang's own forward "
                    "judges our draft here.")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}
    request = {"draft": str(draft), "target": str(target), "inputs": str(inputs), "out": str(out)}
    proc = subprocess.run([str(SGLANG_PYTHON), str(JUDGE)], input=json.dumps(request), capture_output=True,
                          text=True, env=env, timeout=900)
    assert proc.returncode == 0, f"the SGLang forward judge crashed:\n{proc.stderr[-4000:]}"
    verdict = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "error" not in verdict, verdict["error"]
    return {**verdict, **load_file(str(out))}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("forward")
    tdir = target_dir(root)
    draft = randomized(0)
    healthy = export_sglang(root / "healthy", draft, layer_ids=CATALOGUE_LAYER_IDS)
    g = torch.Generator().manual_seed(7)
    inputs = {"input_ids": torch.randint(0, V, (S,), generator=g), "positions": torch.arange(S),
              "hidden_states": torch.randn(S, len(CATALOGUE_LAYER_IDS) * H, generator=g)}
    save_file(inputs, str(root / "inputs.safetensors"))
    dirs = {"healthy": healthy, **{name: swapped(healthy, root / name, *keys) for name, keys in SWAPS.items()}}
    judged = {name: sglang_forward(d, tdir, root / "inputs.safetensors", root / f"{name}.out.safetensors")
              for name, d in dirs.items()}
    return {"draft": draft, "dirs": dirs, "inputs": inputs, "judged": judged}


def ours(draft, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        logits, out = draft(inputs["input_ids"][None], inputs["hidden_states"][None], inputs["positions"][None])
    return logits[0], out[0]


def test_sglang_runs_its_own_eagle3_forward_with_no_stand_in_module(world):
    v = world["judged"]["healthy"]
    assert v["version"] == "0.5.23" and v["model_class"] == "LlamaForCausalLMEagle3"
    assert v["dtype"] == "torch.float32"
    assert v["stub_uses_during_forward"] == []
    assert {"RMSNorm", "SiluAndMul"} <= set(v["native_ops"]), v["native_ops"]


def test_our_forward_gives_sglangs_logits_and_next_step_hidden(world):
    """The draft in memory (what train saved) against SGLang serving its export: a key table that swapped
    two tensors on the way out would be invisible to our own loader, which reads the same names back."""
    v = world["judged"]["healthy"]
    logits, out = ours(world["draft"], world["inputs"])       # the draft as trained, not read back
    assert logits.shape == v["logits"].shape == (S, VD)
    gap_logits, gap_hidden = (logits - v["logits"]).abs().max().item(), (out - v["aux"]).abs().max().item()
    print(f"max |ours - SGLang|: logits {gap_logits:.2e}, hidden {gap_hidden:.2e} (logits std {logits.std():.2f})")
    assert gap_logits <= ATOL and gap_hidden <= ATOL
    assert torch.equal(logits.argmax(-1), v["logits"].argmax(-1))          # the drafted tokens themselves


@pytest.mark.parametrize("name", SWAPS)
def test_a_same_shape_swap_changes_sglangs_logits(world, name):
    healthy, broken = world["judged"]["healthy"]["logits"], world["judged"][name]["logits"]
    assert (healthy - broken).abs().max().item() > 100 * ATOL


def test_the_reference_engines_loader_reads_the_export_back_as_trained(world):
    """The reference engine (verify's τ, the reference server) runs what SGLang runs: the same logits."""
    draft, _ = load_sglang_draft(world["dirs"]["healthy"])
    logits, _ = ours(draft.float(), world["inputs"])
    assert (logits - world["judged"]["healthy"]["logits"]).abs().max().item() <= ATOL
