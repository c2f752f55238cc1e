"""The parity harness (benchmarks/quality_parity.py) on the tiny target: speculators 0.9.0 trains in its
side venv on eaglenest's batches, `eaglenest convert` turns its checkpoint into an SGLang directory,
and both drafts load with SGLang's rules and get a τ from the reference engine. Which one is better
is measured, not asserted (benchmarks/README.md).

The side venv (.venv-speculators) takes ~3 min and ~1.2 GB to build; it is built here on first use.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks.quality_parity import DEFAULT_VENV, ROOT, run_parity, speculators_batch
from steps.training.plan import Batch

pytestmark = pytest.mark.slow


def _venv() -> Path:
    if not (DEFAULT_VENV / ".installed").is_file():
        print(f"\nbuilding {DEFAULT_VENV} for the parity test (first use: ~3 min, ~1.2 GB; "
              "scripts/setup-speculators-venv.sh)", flush=True)
        subprocess.run([str(ROOT / "scripts" / "setup-speculators-venv.sh"), str(DEFAULT_VENV)], check=True)
    return DEFAULT_VENV


def test_speculators_batches_are_shifted_as_its_shift_batch_and_packed_by_document():
    ids = torch.tensor([[10, 11, 12, 20, 21], [30, 31, 32, 33, 0]])
    doc = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, -1]])
    aux = torch.arange(10.0).view(2, 5, 1).expand(2, 5, 3)
    final = -torch.arange(10.0).view(2, 5, 1)
    batch = Batch(ids, torch.ones_like(ids, dtype=torch.bool), doc, torch.zeros_like(ids), aux, final)
    out = speculators_batch(batch)
    assert out["input_ids"].tolist() == [[11, 12, 21, 31, 32, 33]]                 # x[1:]
    assert out["hidden_states"][0, :, 0].tolist() == [0, 1, 3, 5, 6, 7]            # aux[:-1]
    assert out["verifier_last_hidden_states"][0, :, 0].tolist() == [-1, -2, -4, -6, -7, -8]   # final[1:]
    assert out["position_ids"].tolist() == [[1, 2, 1, 1, 2, 3]]                    # from 1, per sequence
    assert out["document_ids"].tolist() == [[0, 0, 1, 2, 2, 2]]


def test_the_harness_trains_both_drafts_on_the_tiny_target_and_measures_both(tmp_path, monkeypatch):
    venv = _venv()
    monkeypatch.setenv("EAGLENEST_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "parity"
    result = run_parity("tiny", ["train.max_steps=4", "verify.num_prompts=2", "verify.max_new_tokens=16"],
                        f"file://{tmp_path / 'store'}", out, venv)
    ours, theirs = result["rows"]["eaglenest"], result["rows"]["speculators 0.9.0"]
    for row in (ours, theirs):
        assert 1.0 <= row["tau"] <= 5.0 and len(row["per_position_acceptance"]) == 4
        assert row["dropped_keys"] == [] and row["missing_params"] == []    # every weight loaded
        assert row["mismatches"] == 0 and row["train_s"] > 0
    assert theirs["steps"] == ours["steps"] and theirs["tokens_trained"] > 0
    raw = json.loads((out / "speculators-draft" / "config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3"                        # its own format, converted by us
    assert json.loads((out / "speculators-sglang" / "config.json").read_text())["architectures"] == \
        ["LlamaForCausalLMEagle3"]
    assert "| speculators 0.9.0 |" in (out / "parity.md").read_text()
