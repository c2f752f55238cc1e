"""Layout rules of DESIGN.md, pinned: steps/ is plain Python, flows/ holds no tensors, CLI surface."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_steps_never_import_prefect():
    offenders = [p.name for p in (ROOT / "steps").rglob("*.py") if "prefect" in _imports(p)]
    assert offenders == [], f"steps/ must stay plain Python (containers run it without Prefect): {offenders}"


def test_flows_never_import_torch():
    offenders = [p.name for p in (ROOT / "flows").rglob("*.py") if {"torch", "safetensors"} & _imports(p)]
    assert offenders == [], f"flows/ orchestrates artifacts, never tensors: {offenders}"


def test_cli_commands_are_pinned():
    from steps.cli import COMMANDS

    assert set(COMMANDS) == {"target", "datagen", "extract", "mapping", "train", "export", "verify",
                             "serve", "benchmark", "doctor", "convert", "pipeline", "demo", "stack", "dataset"}


def test_every_step_module_has_run_and_main():
    import importlib

    from flows.step_flows import STEPS

    for module_name, _, _ in STEPS.values():
        module = importlib.import_module(module_name)
        assert callable(getattr(module, "run", None)), f"{module_name} has no run()"
        assert callable(getattr(module, "main", None)), f"{module_name} has no main()"


def test_no_flows_module_shadows_a_package():
    """Prefect loads an entrypoint `flows/x.py` as a script, putting flows/ first on sys.path: a module
    named like a package (`steps`, `datasets`) would then replace that package for the whole flow run."""
    import importlib.util

    clashes = [p.stem for p in (ROOT / "flows").glob("*.py")
               if p.stem != "__init__" and importlib.util.find_spec(p.stem) is not None]
    assert clashes == [], f"flows/ modules shadowing importable packages: {clashes}"
