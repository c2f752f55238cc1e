"""`eaglenest convert`: SGLang/official ↔ speculators layouts, faithful or refused, never half-written.

Source layouts are built by tests/builders.py's checkpoint-layout builders (their sources are cited there).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from steps import convert
from steps.lib import layouts
from steps.lib.checks import strict
from steps.lib.diagnose import diagnose, read_checkpoint
from tests.builders import (
    LAYOUT_LAYER_IDS,
    LAYOUT_N,
    eagle_official_layout,
    eaglenest_layout,
    specforge_layout,
    speculators_layout,
)

LAYER_IDS, N = LAYOUT_LAYER_IDS, LAYOUT_N  # the layouts' aux ids and target layers


def tensors(path):
    return load_file(str(path / "model.safetensors"))


def config(path):
    return json.loads((path / "config.json").read_text())


def test_round_trip_sglang_vllm_sglang_gives_identical_tensors_and_equivalent_config(tmp_path):
    src = eaglenest_layout(tmp_path, "sglang")
    vllm = layouts.convert(src, tmp_path / "v", "vllm", verifier="tiny")
    back = layouts.convert(vllm, tmp_path / "s", "sglang")
    a, b = tensors(src), tensors(back)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert config(back) == config(src)
    assert any(k.startswith("layers.0.") for k in tensors(vllm)) and not any("midlayer" in k for k in tensors(vllm))
    # F4: SGLang ids are internal − 1; vLLM ids are internal
    assert config(src)["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in LAYER_IDS]
    assert config(vllm)["eagle_aux_hidden_state_layer_ids"] == LAYER_IDS
    assert strict.check_engine_dir(vllm, "vllm") == [] and read_checkpoint(vllm).layout == "speculators"


def test_speculators_and_specforge_dirs_convert_to_a_strict_sglang_dir(tmp_path):
    out = layouts.convert(speculators_layout(tmp_path), tmp_path / "from-spec", "sglang")
    assert strict.check_engine_dir(out, "sglang", expect={"layer_ids": LAYER_IDS}) == []
    out2 = layouts.convert(specforge_layout(tmp_path), tmp_path / "from-sf", "vllm", verifier="tiny",
                           num_target_layers=N)
    assert config(out2)["eagle_aux_hidden_state_layer_ids"] == LAYER_IDS          # the server defaults, pinned
    assert "embed_tokens.weight" not in tensors(out2)                            # not invented


def test_the_eagle_official_release_is_repackaged_so_doctor_passes_f7(tmp_path):
    src = eagle_official_layout(tmp_path)
    with pytest.raises(layouts.ConvertError, match="--num-target-layers"):
        layouts.convert(src, tmp_path / "x", "sglang")
    out = layouts.convert(src, tmp_path / "fixed", "sglang", num_target_layers=N)
    assert config(out)["architectures"] == ["LlamaForCausalLMEagle3"]
    assert {f.id: f.status for f in diagnose(out)}["F7"] == "pass"
    assert torch.equal(tensors(out)["midlayer.self_attn.q_proj.weight"],
                       tensors(src)["midlayer.self_attn.q_proj.weight"])


@pytest.mark.parametrize("flag", ["norm_before_residual", "fc_norm", "norm_before_fc"])
def test_flags_that_cannot_be_carried_are_refused_by_name(tmp_path, flag):
    src = speculators_layout(tmp_path)
    cfg = config(src)
    cfg[flag] = True
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(layouts.ConvertError, match=flag):
        layouts.convert(src, tmp_path / "out", "sglang")
    assert list(tmp_path.glob("*out*")) == []                         # nothing half-written


def test_unknown_keys_and_multi_layer_drafts_are_refused(tmp_path):
    src = specforge_layout(tmp_path, prefix="draft_model.")
    with pytest.raises(layouts.ConvertError, match="draft_model.fc.weight"):
        layouts.convert(src, tmp_path / "out", "vllm", verifier="tiny")
    multi = specforge_layout(tmp_path / "m", config_edit=lambda c: c.update(num_hidden_layers=2))
    with pytest.raises(layouts.ConvertError, match="num_hidden_layers=2"):
        layouts.convert(multi, tmp_path / "out", "vllm", verifier="tiny")
    assert not (tmp_path / "out").exists()


def test_an_existing_destination_is_never_overwritten_and_a_failed_check_leaves_nothing(tmp_path):
    src = eaglenest_layout(tmp_path, "sglang")
    (tmp_path / "taken").mkdir()
    with pytest.raises(layouts.ConvertError, match="already exists"):
        layouts.convert(src, tmp_path / "taken", "vllm", verifier="tiny")
    with pytest.raises(layouts.ConvertError, match="--verifier"):
        layouts.convert(src, tmp_path / "v", "vllm")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sglang", "taken"]


def test_cli_exit_codes(tmp_path, capsys):
    src = eaglenest_layout(tmp_path, "sglang")
    assert convert.main([str(src), str(tmp_path / "v"), "--to", "vllm", "--verifier", "tiny"]) == 0
    assert convert.main([str(src), str(tmp_path / "v"), "--to", "vllm", "--verifier", "tiny"]) == 2
    assert "already exists" in capsys.readouterr().err
