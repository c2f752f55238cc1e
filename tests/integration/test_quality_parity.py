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

from benchmarks import tau_curve
from benchmarks.quality_parity import DEFAULT_VENV, ROOT, speculators_batch
from steps.lib.training.plan import Batch

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


def test_the_curve_and_the_harness_train_both_drafts_on_the_tiny_target_and_measure_both(tmp_path, monkeypatch,
                                                                                            capsys):
    """benchmarks/tau_curve.py on one point (target → verify), then the parity harness on that point's data."""
    venv = _venv()
    monkeypatch.setenv("EAGLENEST_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "curve"
    common = ["--set", "train.max_steps=4", "--set", "verify.num_prompts=2", "--set", "verify.max_new_tokens=16"]
    assert tau_curve.main(["--config", "tiny", "--store", f"file://{tmp_path / 'store'}", "--out", str(out),
                           *common, "--point", "p=", "--parity", "p", "--venv", str(venv)]) == 0
    (row,) = [json.loads(line) for line in (out / "curve.jsonl").read_text().splitlines()]
    assert row["point"] == "p" and row["answers"] > 0 and row["answer_tokens"] > 0
    assert 1.0 <= row["tau"] <= 5.0 and row["mismatches"] == 0 and row["storage_dtype"] == "bfloat16"
    assert set(row["ids"]) == {"target", "dataset", "hidden", "vocab", "draft", "export", "verify"}
    assert 0 < row["draft_vocab_coverage"] <= 1 and 0 <= row["rejections_outside_draft_vocab"] <= 1
    assert row["verify_dtype"] == {"target": "float32", "draft": "float32"} and row["near_ties"] == 0
    assert sum(c["prompts"] for c in row["tau_by_category"].values()) == row["verify_prompts"]
    assert "| p |" in (out / "curve.md").read_text()
    # each MT-bench prompt's histogram is kept, so two points compare paired; a point against itself differs by 0
    k = 4
    assert len(row["mtbench_rows"]) == row["verify_prompts"] and {len(r["accept_histogram"]) for r in
                                                                   row["mtbench_rows"]} == {k + 1}
    assert tau_curve.main(["--out", str(out), "--compare", "p", "p"]) == 0
    assert f"| {k} | {row['tau']:.3f} | {row['tau']:.3f} | +0.000 [+0.000, +0.000] | 2 |" in capsys.readouterr().out

    parity = out / "parity-p"
    result = json.loads((parity / "parity.json").read_text())
    assert result["inputs"]["hidden"] == row["ids"]["hidden"]            # the curve point's data, reused
    ours, theirs = result["rows"]["eaglenest"], result["rows"]["speculators 0.9.0"]
    for r in (ours, theirs):
        assert 1.0 <= r["tau"] <= 5.0 and len(r["per_position_acceptance"]) == 4
        assert r["dropped_keys"] == [] and r["missing_params"] == []    # every weight loaded
        assert r["mismatches"] == 0 and r["train_s"] > 0
    assert theirs["steps"] == ours["steps"] == 4 and theirs["tokens_trained"] > 0
    # their difference, paired prompt by prompt, pools to the same two τ the rows report
    (diff,) = result["difference"].values()
    assert diff["tau"] == pytest.approx(ours["tau"] - theirs["tau"]) and diff["prompts"] == ours["prompts"]
    assert diff["interval"][0] <= diff["interval"][1]
    # the batches were streamed: each one read by speculators' trainer was removed, none is left behind
    assert not list((parity / "speculators-batches").glob("step-*.safetensors"))
    raw = json.loads((parity / "speculators-draft" / "config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3"                        # its own format, converted by us
    assert json.loads((parity / "speculators-sglang" / "config.json").read_text())["architectures"] == \
        ["LlamaForCausalLMEagle3"]
    assert "| speculators 0.9.0 |" in (parity / "parity.md").read_text()

    # run again (as after a run stopped in verify): both drafts are reused, not trained again
    log = parity / "speculators-draft.log"
    before = log.stat().st_mtime_ns
    assert tau_curve.main(["--config", "tiny", "--store", f"file://{tmp_path / 'store'}", "--out", str(out),
                           *common, "--point", "p=", "--parity", "p", "--venv", str(venv)]) == 0
    again = json.loads((parity / "parity.json").read_text())["rows"]
    assert log.stat().st_mtime_ns == before
    assert again["speculators 0.9.0"]["train_s"] == theirs["train_s"]
    assert again["speculators 0.9.0"]["tau"] == theirs["tau"] and again["eaglenest"]["tau"] == ours["tau"]
