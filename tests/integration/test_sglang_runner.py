"""`extract.backend: sglang_runner`, as far as SGLang 0.5.23's classes run on a CPU (sglang_runner_judge.py).

- The runner's `ServerArgs` (`runner_server_args`) resolve, in SGLang's own resolution, to capture-only aux
  mode with no draft, no radix cache and no chunked prefill; ModelRunner's own aux config derives eagle ids
  from them, and the target's model class (`set_eagle3_layers_to_capture`) then captures exactly the
  internal layers extract records — Llama (the class built) and DeepSeek-V3 (its +1-only-if-first-is-1
  rule), ids starting at 2 and at 3.
- SGLang's `LogitsProcessor` output for full capture (its own methods pick the aux and the post-norm
  final rows) goes through `SGLangRunnerBackend` and `steps.extract.extract_shard` into a shard whose every
  row is the one its token and position produced; aux capture off, or last-token capture, is refused.
- On this GPU-less machine the backend refuses in one line naming CUDA.
Not run here: `SGLangEngine` (ModelRunner on CUDA, the prefill, TP over NCCL); docs/CLUSTER.md.
A missing `.venv-sglang` FAILS, never skips.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from steps.lib.data.shards import iter_sequences, read_shard
from tests.builders import TINY_DEEPSEEK
from tests.integration.test_sglang_loader import SGLANG_PYTHON

ROOT = Path(__file__).resolve().parents[2]
JUDGE = Path(__file__).with_name("sglang_runner_judge.py")
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
         "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 512, "rope_theta": 10000.0,
         "tie_word_embeddings": False, "torch_dtype": "float32"}
DEEPSEEK = {**TINY_DEEPSEEK, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "torch_dtype": "float32"}
#: (name, target, internal layer ids, build the class): the DeepSeek ids start at 2 and at 3 (F4's two branches)
CASES = [("llama", LLAMA, [2, 4, 5], True), ("deepseek-from-2", DEEPSEEK, [2, 3, 4], False),
         ("deepseek-from-3", DEEPSEEK, [3, 4], False)]
SEQUENCES = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [70, 3], [100, 101, 102, 103]]
ROWS = {"layer_ids": [2, 4, 5], "hidden_size": 8, "storage_dtype": "bfloat16"}


@pytest.fixture(scope="module")
def judged(tmp_path_factory) -> dict:
    if not SGLANG_PYTHON.exists():
        pytest.fail(f"{SGLANG_PYTHON} is missing: run scripts/setup-sglang-venv.sh first")
    root = tmp_path_factory.mktemp("runner")
    capture = []
    for name, config, ids, build in CASES:
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        capture.append({"name": name, "target": str(root / name), "layer_ids": ids, "full_build": build})
    (root / "rows").mkdir()
    request = {"capture": capture, "rows": {"dir": str(root / "rows"), "sequences": SEQUENCES, **ROWS}}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([str(SGLANG_PYTHON), str(JUDGE)], input=json.dumps(request), capture_output=True,
                          text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def case(judged: dict, name: str) -> dict:
    v = judged["capture"][name]
    assert "error" not in v, v.get("traceback")
    return v


def test_the_judge_is_sglang_0_5_23(judged):
    assert judged["version"] == "0.5.23"


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_sglang_resolves_the_runner_args_to_capture_only(judged, name):
    r = case(judged, name)["resolved"]
    assert r["aux_hidden_state_capture"] == "eagle3" and r["speculative_algorithm"] is None
    assert r["speculative_draft_model_path"] is None and r["disable_radix_cache"] is True
    assert r["chunked_prefill_size"] == -1 and r["context_length"] == 64 and r["mem_fraction_static"] == 0.5


@pytest.mark.parametrize("name,ids", [(c[0], c[2]) for c in CASES])
def test_sglangs_model_class_captures_the_layers_extract_records(judged, name, ids):
    v = case(judged, name)
    assert v["eagle_use_aux_hidden_state"] is True
    assert v["captured"] == ids, v["server_args"]["return_aux_hidden_state_layer_ids"]
    if "built" in v:                                   # the real class, built by SGLang's loader on a CPU
        assert v["built"]["captured"] == ids and v["built"]["capture_aux_hidden_states"] is True


def test_rows_of_sglangs_logits_output_land_in_the_shard_in_order(judged):
    assert "error" not in judged["rows"], judged["rows"].get("traceback")
    shard = read_shard(judged["rows"]["shard"])
    seqs = list(iter_sequences(shard))
    assert [s["input_ids"].tolist() for s in seqs] == SEQUENCES
    h, j = ROWS["hidden_size"], torch.arange(ROWS["hidden_size"]) / 4
    for want, got in zip(SEQUENCES, seqs, strict=True):
        t, p = torch.tensor(want, dtype=torch.float32), torch.arange(len(want), dtype=torch.float32)
        aux = torch.cat([((t % 64) + k)[:, None] + j for k in range(len(ROWS["layer_ids"]))], dim=-1)
        assert torch.equal(got["aux_hidden"].float(), aux) and got["aux_hidden"].shape[-1] == 3 * h
        assert torch.equal(got["final_hidden"].float(), p[:, None] + j)


def test_an_output_without_the_post_norm_final_state_is_refused(judged):
    refused = judged["rows"]["refused"]
    assert all(refused.values()) and all("\n" not in m for m in refused.values()), refused
    assert "last_hidden_states" in refused["aux_capture_off"]


def test_without_cuda_the_backend_refuses_in_one_line_naming_it(judged):
    msg = judged["check_available"]
    assert msg and "\n" not in msg and "needs CUDA GPUs" in msg and "extract.backend=" in msg
