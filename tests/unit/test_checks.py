"""The failure catalogue's checks: every row F1–F9 has exactly one implementation, and one Finding type."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from steps.lib.checks.catalogue import CATALOGUE, module_of
from steps.lib.checks.finding import Finding

ROOT = Path(__file__).resolve().parents[2]
ROWS = [f"F{i}" for i in range(1, 10)]


def _findings_built(path: Path) -> set[str]:
    """Catalogue rows a module builds a Finding for: `Finding("F3", ...)` or `Finding(id="F3", ...)`."""
    rows = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Finding":
            first = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "id"), None)
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                rows.add(first.value)
    return rows


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def test_the_catalogue_names_every_row_once():
    assert sorted(CATALOGUE) == ROWS
    assert all(callable(check) and why for why, check in CATALOGUE.values())


@pytest.mark.parametrize("row", ROWS)
def test_each_row_is_judged_in_exactly_one_module(row):
    """No module but the row's own builds a Finding for it: serve, export, doctor and the gate call it."""
    builders = sorted(_module(p) for p in (ROOT / "steps").rglob("*.py") if row in _findings_built(p))
    assert builders == [module_of(row)], f"{row} is judged in {builders}, owner {module_of(row)}"


def test_there_is_one_finding_type():
    defined = sorted(_module(p) for p in (ROOT / "steps").rglob("*.py")
                     for node in ast.walk(ast.parse(p.read_text()))
                     if isinstance(node, ast.ClassDef) and node.name == "Finding")
    assert defined == ["steps.lib.checks.finding"]


def test_a_finding_prints_where_and_keeps_the_report_json_shape():
    f = Finding("F5", "fail", "draft/config.json", "max_position_embeddings=256 < 4096", "re-export")
    assert str(f) == "[F5 FAIL] draft/config.json: max_position_embeddings=256 < 4096\n      fix: re-export"
    assert f.to_dict() == {"id": "F5", "status": "fail", "evidence": "draft/config.json: max_position_embeddings=256 "
                           "< 4096", "fix": "re-export"}


def test_f4_deepseek_rule_is_one_rule_in_both_conventions():
    """The old serve check (SGLang ids[0] != 1) and doctor check (internal ids[0] != 2) were one rule written
    in two conventions (SGLang = internal − 1, sglang.md §3.3): the one check now agrees with both."""
    from steps.lib.checks.layers import check_aux_layers

    target = {"num_hidden_layers": 8, "architectures": ["DeepseekV3ForCausalLM"]}
    for sglang_ids in ([1, 3, 5], [0, 3, 5], [2, 4, 6]):
        config = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_ids}}
        f = check_aux_layers(config, "sglang", num_layers=8, target_arch=target["architectures"][0], trained=None,
                             where="c")
        internal_first = sglang_ids[0] + 1
        assert (f.status == "pass") == (sglang_ids[0] == 1) == (internal_first == 2), (sglang_ids, f)
