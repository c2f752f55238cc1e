"""Layout rules of DESIGN.md, pinned: steps/ is plain Python, flows/ holds no tensors, the library → steps →
flows layering (no step imports another step), CLI surface."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from steps.registry import STEPS, TOOLS

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


#: the step modules (and the two tools, which follow the same rule); everything else in steps/ is library.
STEP_MODULES = frozenset({*STEPS, *TOOLS})


def _steps_modules_imported(path: Path) -> set[str]:
    """The `steps.<module>` names a file imports anywhere in it (function-local imports included), in every
    spelling: `import steps.x`, `from steps.x import y`, `from steps import x`, `from steps.x.y import z`."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("steps.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] == "steps":
                out |= {parts[1]} if len(parts) > 1 else {a.name for a in node.names}
    return out


def _module_name(path: Path) -> str:
    """`steps/serve.py` → `serve`; `steps/checks/keys.py` → `checks` (a package is one library module)."""
    return path.relative_to(ROOT / "steps").parts[0].removesuffix(".py")


def test_no_step_module_imports_another_step_module():
    """Steps share code through the library (artifacts, checks, formats, serving, ...), never each other."""
    offenders = sorted(f"{p.relative_to(ROOT)} imports steps.{m}" for p in (ROOT / "steps").rglob("*.py")
                       if _module_name(p) in STEP_MODULES
                       for m in _steps_modules_imported(p) & STEP_MODULES - {_module_name(p)})
    assert offenders == [], offenders


def test_the_library_never_imports_a_step_module():
    """Imports point down only: a library module that imported a step would make the layers a cycle."""
    offenders = sorted(f"{p.relative_to(ROOT)} imports steps.{m}" for p in (ROOT / "steps").rglob("*.py")
                       if _module_name(p) not in STEP_MODULES
                       for m in _steps_modules_imported(p) & STEP_MODULES)
    assert offenders == [], offenders


def test_the_import_scan_sees_every_spelling(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("import steps.serve\nfrom steps import doctor as d\nfrom steps.train import run\n"
                   "def f():\n    from steps.checks.keys import check_keys\n")
    assert _steps_modules_imported(src) == {"serve", "doctor", "train", "checks"}


def test_the_stores_callers_never_touch_its_backend():
    """Callers use `Store` methods; only steps/store/ knows a backend (tests may reach it to inject faults)."""
    callers = [p for top in ("steps", "flows", "benchmarks", "scripts") for p in (ROOT / top).rglob("*.py")
               if not p.is_relative_to(ROOT / "steps" / "store")]
    offenders = sorted(f"{p.relative_to(ROOT)}:{node.lineno}" for p in callers
                       for node in ast.walk(ast.parse(p.read_text()))
                       if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                       and node.value.attr == "backend")
    assert offenders == [], offenders


def test_steps_never_import_prefect():
    offenders = [p.name for p in (ROOT / "steps").rglob("*.py") if "prefect" in _imports(p)]
    assert offenders == [], f"steps/ must stay plain Python (containers run it without Prefect): {offenders}"


def test_flows_never_import_torch():
    offenders = [p.name for p in (ROOT / "flows").rglob("*.py") if {"torch", "safetensors"} & _imports(p)]
    assert offenders == [], f"flows/ orchestrates artifacts, never tensors: {offenders}"


def test_the_orchestrator_loads_no_torch_even_through_the_steps_library():
    """The static rule above sees direct imports only; a flow that reads a file name from steps.artifacts
    once pulled in torch (2.4 s and 200 MB in the orchestrator, a pause after training) through it."""
    code = ("import sys\nimport flows.pipeline, flows.step_flows, flows.step_process, flows.demo, steps.artifacts\n"
            "from steps.artifacts import DRAFT_LOG_FILE, export_dir, target_dir\n"
            "loaded = sorted(m for m in ('torch', 'safetensors.torch', 'transformers') if m in sys.modules)\n"
            "assert not loaded, f'the orchestrator imported {loaded}'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]


def test_cli_commands_are_the_registry_steps_the_tools_and_the_flow_commands():
    from flows.cli import COMMANDS, FLOW_COMMANDS

    assert list(COMMANDS) == [*STEPS, *TOOLS, "store", *FLOW_COMMANDS]
    assert set(FLOW_COMMANDS) == {"pipeline", "demo", "stack", "dataset"}
    assert set(TOOLS) == {"doctor", "convert"}
    assert all((ROOT / "steps" / f"{m}.py").is_file() for m in STEP_MODULES), "a registry row without its module"


def _flows_strings(path: Path) -> list[str]:
    """String literals naming a flows module: `importlib.import_module("flows.x")` is an import too."""
    return [node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and (node.value == "flows" or node.value.startswith("flows."))]


def test_steps_never_import_flows_not_even_by_string():
    offenders = sorted(f"{p.relative_to(ROOT)}: {name}" for p in (ROOT / "steps").rglob("*.py")
                       for name in sorted(({"flows"} & _imports(p)) | set(_flows_strings(p))))
    assert offenders == [], f"steps/ is below flows/: {offenders}"


def test_every_step_main_is_the_shared_one():
    """`main()` of every step is `step_main(<step>, argv)`: one set of flags, one error contract."""
    for name in STEPS:
        tree = ast.parse((ROOT / "steps" / f"{name}.py").read_text())
        (main,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
        assert len(main.body) == 1 and "step_main" in ast.unparse(main.body[0]), f"steps/{name}.py main()"


def test_every_step_module_runs_as_python_dash_m():
    """`python -m steps.<step>` is how a container, a shell and the local pool's subflows start a step
    (flows/step_process.py): every step module calls its main() when run as a script."""
    guard = 'if __name__ == "__main__":\n    raise SystemExit(main())'
    missing = [name for name in STEPS if guard not in (ROOT / "steps" / f"{name}.py").read_text()]
    assert missing == [], f"steps without the __main__ guard: {missing}"


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


def test_the_config_names_exactly_the_registered_engines():
    """A new export format is its module plus its ENGINES row; the config's Literal (kept so that loading a
    config never imports torch) must name the same engines, or an export would be refused or unknown."""
    from typing import get_args

    from steps.config import ExportConfig
    from steps.formats import ENGINES

    (literal,) = get_args(ExportConfig.model_fields["engines"].annotation)
    assert set(get_args(literal)) == set(ENGINES)
    assert all(f.name == name and f.fixed_fields and f.required_fields for name, f in ENGINES.items())
