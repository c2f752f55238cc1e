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


#: the step modules (and the two tools, which follow the same rule): the files directly in steps/.
STEP_MODULES = frozenset({*STEPS, *TOOLS})
#: the step layer's own files beside the steps: the index of steps and the warm spare that runs one.
STEP_LAYER = frozenset({"registry", "warm_start"})
LIB = ROOT / "steps" / "lib"


def _module_of(path: Path) -> str:
    """`steps/lib/store/ids.py` → `steps.lib.store.ids`; a package's `__init__.py` is the package."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _steps_imports(path: Path) -> set[str]:
    """Every `steps...` module a file imports anywhere in it (function-local and TYPE_CHECKING imports
    included), in every spelling: `import steps.x`, `from steps.x import y` (y a module or a name),
    `from steps import x`."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {_existing_module(a.name) for a in node.names if a.name.split(".")[0] == "steps"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "steps":
                out |= {_existing_module(f"{node.module}.{a.name}") for a in node.names}
    return out


def _existing_module(name: str) -> str:
    """The longest prefix of a dotted name that is a module file (`steps.lib.store.Store` → `steps.lib.store`)."""
    while name.count("."):
        base = ROOT / Path(*name.split("."))
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return name
        name = name.rpartition(".")[0]
    return name


def _graph() -> dict[str, set[str]]:
    return {_module_of(p): _steps_imports(p) - {_module_of(p)} for p in (ROOT / "steps").rglob("*.py")}


def test_steps_shows_the_step_layer_and_lib_the_library():
    """Which file is a step is read from the folder: steps/*.py are the steps, the tools and the step
    layer's two files; everything else is a package under steps/lib/."""
    top = {p.stem for p in (ROOT / "steps").glob("*.py")} - {"__init__"}
    assert top == STEP_MODULES | STEP_LAYER
    assert sorted(p.name for p in (ROOT / "steps").iterdir() if p.is_dir() and p.name != "__pycache__") == ["lib"]


def test_the_library_imports_nothing_of_steps_outside_the_library():
    """Imports point down only: steps/lib/** → steps.lib.* (never a step, the registry or warm_start)."""
    offenders = sorted(f"{m} imports {t}" for m, ts in _graph().items() if m.startswith("steps.lib")
                       for t in ts if not (t == "steps.lib" or t.startswith("steps.lib.")))
    assert offenders == [], offenders


def test_a_step_imports_only_the_library_and_the_registry():
    """Steps share code through the library (artifacts, checks, formats, serving, ...), never each other."""
    offenders = sorted(f"{m} imports {t}" for m, ts in _graph().items() if m.rpartition(".")[2] in STEP_MODULES
                       and m.count(".") == 1
                       for t in ts if not (t.startswith("steps.lib") or t == "steps.registry"))
    assert offenders == [], offenders


def test_no_import_circle_among_files_or_folders():
    """No module reaches itself through imports, counting function-local and TYPE_CHECKING ones, and no
    two library folders import each other (the import graph is a DAG at both grains)."""
    graph = _graph()
    assert _cycle(graph) is None, f"import circle: {' → '.join(_cycle(graph))}"
    folders: dict[str, set[str]] = {}
    for m, ts in graph.items():
        for t in ts:
            a, b = _folder(m), _folder(t)
            if a != b:
                folders.setdefault(a, set()).add(b)
    assert _cycle(folders) is None, f"folder circle: {' → '.join(_cycle(folders))}"


def _folder(module: str) -> str:
    """The unit of the folder rule: a library package (`steps.lib.store.ids` → `steps.lib.store`); a file
    directly in steps/ or steps/lib/ stands for itself."""
    parts = module.split(".")
    return ".".join(parts[:3]) if parts[:2] == ["steps", "lib"] and len(parts) > 3 else module


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of `graph` as a path that returns to its start, or None (depth-first, three colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_scan_sees_every_spelling(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("import steps.serve\nfrom steps import doctor as d\nfrom steps.train import run\n"
                   "def f():\n    from steps.lib.checks.keys import check_keys\n"
                   "from steps.lib import layer_ids\n")
    assert _steps_imports(src) == {"steps.serve", "steps.doctor", "steps.train", "steps.lib.checks.keys",
                                   "steps.lib.layer_ids"}


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_stores_callers_never_touch_its_backend():
    """Callers use `Store` methods; only steps/lib/store/ knows a backend (tests may reach it to inject faults)."""
    callers = [p for top in ("steps", "flows", "benchmarks", "scripts") for p in (ROOT / top).rglob("*.py")
               if not p.is_relative_to(LIB / "store")]
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
    """The static rule above sees direct imports only; a flow that reads a file name from steps.lib.artifacts
    once pulled in torch (2.4 s and 200 MB in the orchestrator, a pause after training) through it."""
    code = ("import sys\nimport flows.pipeline, flows.step_flows, flows.step_process, flows.demo, steps.lib.artifacts\n"
            "from steps.lib.artifacts import DRAFT_LOG_FILE, export_dir, target_dir\n"
            "loaded = sorted(m for m in ('torch', 'safetensors.torch', 'transformers') if m in sys.modules)\n"
            "assert not loaded, f'the orchestrator imported {loaded}'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]


def test_cli_commands_are_the_registry_steps_the_tools_and_the_flow_commands():
    from flows.cli import COMMANDS, FLOW_COMMANDS

    assert list(COMMANDS) == [*STEPS, *TOOLS, "store", *FLOW_COMMANDS]
    assert set(FLOW_COMMANDS) == {"pipeline", "demo", "stack", "dataset"}
    assert set(TOOLS) == {"doctor", "convert", "plan"}
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

    for step in STEPS.values():
        module_name = step.module
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

    from steps.lib.config import ExportConfig
    from steps.lib.formats import ENGINES
    from steps.lib.layer_ids import ENGINE_ID_OFFSETS

    assert set(ENGINE_ID_OFFSETS) == set(ENGINES), "each engine's layer-id offset lives in steps/lib/layer_ids.py"
    (literal,) = get_args(ExportConfig.model_fields["engines"].annotation)
    assert set(get_args(literal)) == set(ENGINES)
    assert all(f.name == name and f.fixed_fields and f.required_fields for name, f in ENGINES.items())
