"""speculators 0.9.0 (vLLM's draft trainer) is the judge of our vLLM export and of our draft's forward.

`tests/integration/speculators_judge.py` runs inside `.venv-speculators` (the main venv cannot import
speculators). A seeded random draft (every weight random, norms included; tests/integration/
test_sglang_forward.py's) is exported to the vLLM layout by the export's own writer
(`formats.write_engine_dir(..., "vllm", ...)` with `formats.speculators.build_config`, as steps/export.py
calls them). speculators loads it with its own `Eagle3SpeculatorConfig` and `Eagle3DraftModel.from_pretrained`
(initialisation replaced by a NaN sentinel): every parameter must come from a checkpoint key with the same
values, no key may be left over, only the verifier's two tensors (never saved) stay unfilled. Then its own
`forward` (the TTT unroll it trains with) runs on the same inputs as ours.

Step 0 (what serving runs on real positions) must agree with our `Eagle3Draft`, and every step of
speculators' TTT unroll with ours (steps/lib/training/ttt.py `ttt_unroll`), within `ATOL` (float32;
measured: step 0 exactly equal, steps 1-2 7e-7).

A missing `.venv-speculators` FAILS this test, never skips it (scripts/setup-speculators-venv.sh builds it).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from steps import convert
from steps.lib import formats
from steps.lib.formats.sglang_loader import load_sglang_draft
from steps.lib.training.plan import Batch
from steps.lib.training.ttt import ttt_unroll
from tests.builders import CATALOGUE_LAYER_IDS
from tests.integration.test_sglang_forward import H, V, randomized, target_dir

ROOT = Path(__file__).resolve().parents[2]
SPECULATORS_PYTHON = Path(os.environ.get("EAGLENEST_SPECULATORS_PYTHON",
                                         ROOT / ".venv-speculators" / "bin" / "python"))
JUDGE = Path(__file__).with_name("speculators_judge.py")
L, K = 12, 3
ATOL = 1e-5
pytestmark = pytest.mark.usefixtures("one_thread")


def run_judge(draft: Path, inputs: Path, out: Path, save: Path) -> dict:
    if not SPECULATORS_PYTHON.exists():
        pytest.fail(f"{SPECULATORS_PYTHON} is missing: run scripts/setup-speculators-venv.sh first. speculators' "
                    "own classes judge our vLLM export here.")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}
    request = {"draft": str(draft), "inputs": str(inputs), "out": str(out), "ttt_steps": K, "save": str(save)}
    proc = subprocess.run([str(SPECULATORS_PYTHON), str(JUDGE)], input=json.dumps(request), capture_output=True,
                          text=True, env=env, timeout=900)
    assert proc.returncode == 0, f"the speculators judge crashed:\n{proc.stderr[-4000:]}"
    verdict = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "error" not in verdict, verdict["error"]
    return {**verdict, **load_file(str(out))}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("speculators")
    tdir = target_dir(root)
    # the verifier's own embedding and head, unlike the draft's: speculators reads them at load time and
    # must keep the checkpoint's (values_differ would name a tensor it replaced)
    g = torch.Generator().manual_seed(3)
    save_file({"model.embed_tokens.weight": torch.randn(V, H, generator=g),
               "lm_head.weight": torch.randn(V, H, generator=g), "model.norm.weight": 1 + torch.rand(H, generator=g)},
              str(tdir / "model.safetensors"))
    draft = randomized(0)
    config = formats.speculators.build_config(
        draft.cfg.to_dict(), layer_ids=CATALOGUE_LAYER_IDS, max_position_embeddings=512, dtype="float32",
        verifier_name_or_path=str(tdir), verifier_architectures=["LlamaForCausalLM"], speculative_tokens=K)
    vllm = formats.write_engine_dir(root / "vllm", "vllm", draft.state_dict(), config, dtype="float32")
    g.manual_seed(7)
    inputs = {"input_ids": torch.randint(0, V, (1, L), generator=g),
              "hidden_states": torch.randn(1, L, len(CATALOGUE_LAYER_IDS) * H, generator=g),
              "position_ids": torch.arange(L)[None], "document_ids": torch.zeros(1, L, dtype=torch.long)}
    save_file(inputs, str(root / "inputs.safetensors"))
    judged = run_judge(vllm, root / "inputs.safetensors", root / "out.safetensors", root / "saved")
    return {"draft": draft, "dir": vllm, "inputs": inputs, "judged": judged, "saved": root / "saved", "root": root}


def our_ttt_logits(world, position_step: int = 1) -> list[torch.Tensor]:
    """Our TTT unroll (steps/lib/training/ttt.py) on speculators' inputs: step j's logits [L, Vd].

    speculators' row holds token x[p+1] beside the aux states of p; ours holds x[p] (the unroll shifts),
    so our row is one longer: [pad, its tokens], its aux states and positions with one more at the end.
    """
    x = world["inputs"]
    one = torch.zeros(1, 1, dtype=torch.long)
    batch = Batch(input_ids=torch.cat([one, x["input_ids"]], 1), loss_mask=torch.ones(1, L + 1, dtype=torch.bool),
                  doc=torch.zeros(1, L + 1, dtype=torch.long), pos=torch.arange(L + 1)[None],
                  aux=torch.cat([x["hidden_states"], torch.zeros(1, 1, x["hidden_states"].shape[-1])], 1),
                  final=torch.zeros(1, L + 1, H))
    with torch.no_grad():
        return [world["draft"].compute_logits(out)[0, :L] for out, _ in ttt_unroll(world["draft"], batch, K,
                                                                                  attention="sdpa")]


def test_speculators_loads_our_vllm_export_completely(world):
    v = world["judged"]
    assert v["version"] == "0.9.0"
    assert (v["model_class"], v["config_class"]) == ("Eagle3DraftModel", "Eagle3SpeculatorConfig")
    assert v["ignored_file_keys"] == []                       # no key of ours left over
    assert v["values_differ"] == []
    # the verifier's two tensors, never saved, come from the verifier; nothing else is outside the file
    assert v["not_in_file"] == sorted(("verifier_norm.weight", "verifier_lm_head.weight"))
    assert v["left_sentinel"] == []


def test_step_0_logits_equal_ours(world):
    x = world["inputs"]
    with torch.no_grad():
        logits, _ = world["draft"](x["input_ids"], x["hidden_states"], x["position_ids"])
    gap = (logits[0] - world["judged"]["logits_0"]).abs().max().item()
    print(f"step 0: max |ours - speculators| {gap:.2e}")
    assert gap <= ATOL


def test_the_ttt_unroll_equals_speculators_step_by_step(world):
    """Every TTT step: teacher-forced tokens, the draft's own hidden fed back, chain keys in the cache."""
    ours = our_ttt_logits(world)
    for j in range(K):
        # step j's token at p is x[p+1+j]: past the row's end speculators feeds 0, ours the padding rule
        rows = L - j
        gap = (ours[j][:rows] - world["judged"][f"logits_{j}"][:rows]).abs().max().item()
        print(f"TTT step {j}: max |ours - speculators| {gap:.2e}")
        assert gap <= ATOL, j


def test_convert_of_speculators_own_save_serves_speculators_logits(world):
    """speculators' `save_pretrained` → `eaglenest convert --to sglang` → the reference engine's loader: the
    same step-0 logits as speculators' forward. A same-shaped swap in convert's key table fails here."""
    out = world["root"] / "converted"
    assert convert.main([str(world["saved"]), str(out), "--to", "sglang"]) == 0
    draft, _ = load_sglang_draft(out)
    x = world["inputs"]
    with torch.no_grad():
        logits, _ = draft.float()(x["input_ids"], x["hidden_states"], x["position_ids"])
    assert (logits[0] - world["judged"]["logits_0"]).abs().max().item() <= ATOL
