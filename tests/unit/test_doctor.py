"""`eaglenest doctor` on every layout it must read, healthy and broken, one broken checkpoint per F-row.

The directories are built by tests/builders.py's checkpoint-layout builders, laid out the way each producer
writes them (their sources are cited there): eaglenest's own `sglang/` and `vllm/` exports, SpecForge's
SGLang export, speculators, and the EAGLE official release.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from steps import doctor
from steps.lib.checks.cuda_graph import check_cuda_graph
from steps.lib.checks.finding import Finding
from steps.lib.checks.tau import compare_tau
from steps.lib.diagnose import diagnose, read_checkpoint
from steps.lib.layouts import detect_layout
from tests.builders import (
    LAYOUT_H,
    LAYOUT_LAYER_IDS,
    LAYOUT_N,
    LAYOUT_V,
    LAYOUT_VD,
    eagle_official_layout,
    eaglenest_layout,
    specforge_layout,
    speculators_layout,
)

V, H, VD, N, LAYER_IDS = LAYOUT_V, LAYOUT_H, LAYOUT_VD, LAYOUT_N, LAYOUT_LAYER_IDS  # the layouts' sizes and aux ids


def target_dir(root: Path, **overrides) -> Path:
    """Only the target's config.json: the static checks read nothing else."""
    out = root / "target"
    out.mkdir(exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": N, "hidden_size": H,
           "vocab_size": V, "max_position_embeddings": 512, **overrides}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def verdicts(path: Path, **kw) -> dict[str, Finding]:
    return {f.id: f for f in diagnose(path, **kw)}


def failed(findings: dict[str, Finding]) -> set[str]:
    return {k for k, f in findings.items() if f.status == "fail"}


# --- layouts: healthy ---------------------------------------------------------------------------------

@pytest.mark.parametrize("build,layout", [
    (lambda r: eaglenest_layout(r, "sglang"), "sglang"), (lambda r: eaglenest_layout(r, "vllm"), "speculators"),
    (specforge_layout, "sglang"), (speculators_layout, "speculators")])
def test_healthy_layouts_pass_every_check(tmp_path, build, layout):
    path = build(tmp_path)
    found = verdicts(path, target=target_dir(tmp_path))
    assert read_checkpoint(path).layout == layout
    assert failed(found) == set(), [str(f) for f in found.values()]
    assert {"F2", "F3", "F4", "F5", "F7"} <= {k for k, f in found.items() if f.status == "pass"}


def test_specforge_export_without_eagle_config_is_captured_at_the_server_defaults(tmp_path):
    found = verdicts(specforge_layout(tmp_path), target=target_dir(tmp_path))
    assert "defaults" in found["F4"].evidence and str(LAYER_IDS) in found["F4"].evidence


def test_the_eagle_official_release_fails_f7_with_the_repackage_fix(tmp_path):
    found = verdicts(eagle_official_layout(tmp_path), target=target_dir(tmp_path))
    assert failed(found) == {"F7"}
    assert "LlamaForCausalLM" in found["F7"].evidence and "eaglenest convert" in found["F7"].fix
    assert "--to sglang" in found["F7"].fix


def test_layout_detection_is_a_rules_table_not_a_path_guess(tmp_path):
    path = specforge_layout(tmp_path)
    renamed = path.rename(tmp_path / "speculators-vllm-export")       # a misleading name changes nothing
    assert read_checkpoint(renamed).layout == "sglang"
    assert detect_layout({"architectures": ["MistralForCausalLM"]}, ["fc.weight"]) == "unknown"


# --- one broken checkpoint per row --------------------------------------------------------------------

def test_f2_a_draft_model_prefix_is_named_with_the_dropped_keys(tmp_path):
    found = verdicts(specforge_layout(tmp_path, prefix="draft_model."), target=target_dir(tmp_path))
    assert "F2" in failed(found)
    assert "draft_model." in found["F2"].evidence and "draft_model.fc.weight" in found["F2"].evidence
    assert "draft_model." in found["F2"].fix and found["F2"].fix


def test_f2_a_shape_that_disagrees_with_config_is_named(tmp_path):
    def shrink(state):
        state["fc.weight"] = state["fc.weight"][:, :2 * H]
    found = verdicts(specforge_layout(tmp_path, state_edit=shrink))
    assert "F2" in failed(found) and "fc.weight" in found["F2"].evidence


@pytest.mark.parametrize("breakage,words", [
    (lambda s: s.__setitem__("d2t", s["d2t"] + torch.arange(VD)), "absolute"),
    (lambda s: s.pop("d2t"), "draft ids as target ids"),
    (lambda s: s.__setitem__("d2t", s["d2t"].float()), "int64"),
])
def test_f3_absolute_missing_or_float_d2t_fails_f3(tmp_path, breakage, words):
    found = verdicts(specforge_layout(tmp_path, state_edit=breakage), target=target_dir(tmp_path))
    assert "F3" in failed(found), str(found["F3"])
    assert words in found["F3"].evidence and found["F3"].fix


def test_f4_ids_written_in_the_vllm_convention_into_an_sglang_dir_are_caught_against_the_manifest(tmp_path):
    export = tmp_path / "export"
    path = eaglenest_layout(export, "sglang", layer_ids=[i + 1 for i in LAYER_IDS])  # SGLang reads +1: shifted by one
    (export / "manifest.json").write_text(json.dumps({"meta": {"internal_layer_ids": LAYER_IDS}}))
    found = verdicts(path, target=target_dir(tmp_path))
    assert "F4" in failed(found)
    assert str(LAYER_IDS) in found["F4"].evidence and "trained" in found["F4"].evidence and found["F4"].fix


def test_f4_the_last_layer_cannot_be_captured(tmp_path):
    path = eaglenest_layout(tmp_path, "sglang", layer_ids=[2, 4, N])
    found = verdicts(path, target=target_dir(tmp_path))
    assert "F4" in failed(found) and "cannot be captured" in found["F4"].evidence


def test_f4_top_level_ids_in_an_sglang_dir_are_ignored_by_sglang(tmp_path):
    found = verdicts(specforge_layout(tmp_path,
                                      config_edit=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 3, 4])))
    assert "F4" in failed(found) and "eagle_config" in found["F4"].fix


def test_f5_a_draft_context_shorter_than_the_target_fails(tmp_path):
    found = verdicts(specforge_layout(tmp_path, config_edit=lambda c: c.update(max_position_embeddings=256)),
                     target=target_dir(tmp_path, max_position_embeddings=4096))
    assert failed(found) == {"F5"}
    assert "256" in found["F5"].evidence and "4096" in found["F5"].fix


@pytest.mark.parametrize("edit,words", [
    (lambda c: c.pop("draft_vocab_size"), "draft_vocab_size missing"),
    (lambda c: c.update(draft_vocab_size=None), "null"),
])
def test_f7_missing_or_null_draft_vocab_size_fails(tmp_path, edit, words):
    found = verdicts(specforge_layout(tmp_path, config_edit=edit), target=target_dir(tmp_path))
    assert "F7" in failed(found) and words in found["F7"].evidence and found["F7"].fix


def test_cli_json_has_exactly_ok_and_checks_and_exits_nonzero_on_fail(tmp_path, capsys):
    good, bad = eaglenest_layout(tmp_path, "sglang"), specforge_layout(tmp_path, prefix="draft_model.")
    assert doctor.main([str(good), "--target", str(target_dir(tmp_path)), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"ok", "checks"} and out["ok"] is True
    assert all(set(c) == {"id", "status", "evidence", "fix"} for c in out["checks"])
    assert {c["status"] for c in out["checks"]} <= {"PASS", "FAIL", "WARN", "SKIP"}
    assert doctor.main([str(bad)]) == 1
    text = capsys.readouterr().out
    assert "[F2 FAIL]" in text and "fix:" in text


# --- F9 / F6 verdicts from measured numbers (the live path is exercised in tests/integration) ------------

def test_f9_offline_good_and_live_one_means_serving_not_training():
    earlier = [Finding("F4", "fail", "captures [2, 3, 4]", "re-export")]
    serving = compare_tau(2.0, 1.0, earlier)
    assert serving.status == "fail" and "serving is misconfigured, not training" in serving.evidence
    assert "F4" in serving.evidence
    both = compare_tau(1.0, 1.0, [])
    assert both.status == "fail" and "even offline" in both.evidence and "training" in both.fix
    assert compare_tau(2.0, 1.9, []).status == "pass"
    assert compare_tau(2.5, 1.5, []).status == "warn"
    assert compare_tau(None, None, []).status == "skip"


def test_f6_reports_disabled_cuda_graphs_and_the_start_attempts(tmp_path):
    attempts = [{"cuda_graph": True, "outcome": "failed: not healthy after 60 s (F6)", "seconds": 60.0},
                {"cuda_graph": False, "outcome": "healthy", "seconds": 12.0}]
    record = tmp_path / "serve.json"
    record.write_text(json.dumps({"meta": {"attempts": attempts}}))
    found = check_cuda_graph({"cuda_graph_backend_decode": "disabled"}, doctor.read_serve_record(record))
    assert found.status == "warn" and "cuda_graph=True" in found.evidence and "healthy" in found.evidence
    assert check_cuda_graph({"cuda_graph_backend_decode": "full"}, None).status == "pass"


def test_cli_takes_ids_like_the_steps_and_finds_the_target_through_the_lineage(tmp_path, capsys):
    """PATH may be an export id and --target a target id (with --store), as for every step; without
    --target, an eaglenest export's lineage names its target, so the target-dependent checks run."""
    from tests.builders import bigram_world, free_port

    world = bigram_world(tmp_path, free_port())
    store, draft_dir = world["store"].uri, str(world["draft_dir"])

    def checks(*argv: str) -> dict[str, str]:
        assert doctor.main([*argv, "--json"]) == 0, capsys.readouterr()
        return {c["id"]: c["status"] + c["evidence"] for c in json.loads(capsys.readouterr().out)["checks"]}

    by_dir = checks(draft_dir, "--target", str(world["target_dir"]))
    assert checks(world["export_id"], "--store", store) == by_dir
    assert checks(draft_dir, "--target", world["target_id"], "--store", store) == by_dir
    assert checks(draft_dir) == by_dir                                    # the lineage names the target
    assert "capturable in a 4-layer target" in by_dir["F4"] and by_dir["F5"].startswith("PASS")
    # a draft copied out of the store has no lineage: the target-dependent checks say they need one
    alone = tmp_path / "copied"
    shutil.copytree(draft_dir, alone)
    found = checks(str(alone))
    assert "capturable" not in found["F4"] and found["F5"].startswith("SKIP") and "pass the target" in found["F5"]
    for bad in (["0123456789abcdef", "--store", store], [draft_dir, "--target", str(tmp_path / "nope")]):
        assert doctor.main(bad) == 2
        err = capsys.readouterr().err
        assert err.startswith("eaglenest doctor: ") and err.count("\n") == 1


# --- each fix a command that works ----------------------------------------------------------------------

def fix_command(finding: Finding) -> list[str]:
    """The `eaglenest convert ...` a finding's fix names, as argv after `eaglenest`."""
    import re
    import shlex

    found = re.search(r"`eaglenest (convert [^`]+)`", finding.fix)
    assert found, finding.fix
    return shlex.split(found[1])


def renamed_layer(state: dict) -> None:
    """A trainer that called the draft layer `decoder` (SGLang drops every such key without a word)."""
    for key in [k for k in state if k.startswith("midlayer.")]:
        state[key.replace("midlayer.", "decoder.", 1)] = state.pop(key)


@pytest.mark.parametrize("row, edits", [
    ("F7", {"config_edit": lambda c: c.update(draft_vocab_size=None)}),
    ("F7", {"config_edit": lambda c: c.pop("draft_vocab_size")}),
    ("F2", {"state_edit": renamed_layer}),
    ("F2", {"state_edit": renamed_layer, "config_edit": lambda c: c.update(draft_vocab_size=None)}),
])
def test_the_fix_doctor_prints_is_a_command_that_repairs_the_directory(tmp_path, row, edits, capsys):
    from steps import convert

    target = target_dir(tmp_path)
    broken = specforge_layout(tmp_path, **edits)
    found = verdicts(broken, target=target)
    assert row in failed(found)
    argv = fix_command(found[row])
    if row == "F2":
        assert "--rename" in argv and "decoder.=midlayer." in argv     # the rename, by name
    assert convert.main(argv[1:]) == 0, capsys.readouterr().err
    fixed = verdicts(Path(argv[2]), target=target)
    assert not failed(fixed) and fixed["F7"].evidence.endswith(f"draft_vocab_size={VD}"), fixed


def test_the_last_line_sums_up_and_says_what_needs_a_server(tmp_path, capsys):
    bad = specforge_layout(tmp_path, config_edit=lambda c: c.update(draft_vocab_size=None))
    assert doctor.main([str(bad), "--target", str(target_dir(tmp_path))]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("doctor: 1 failing (F7), ") and " passing, " in last, last
    assert "not checked without --server URL: F1 (" in last and "F6 (" in last and "F9 (" in last, last
