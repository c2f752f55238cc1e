"""Empty stand-in modules for packages speculators 0.9.0 imports at module level but never calls in its
EAGLE-3 model or training step (`openai`, `datasets`): used where speculators runs without them (the
GPU anchor, benchmarks/speculators_anchor.py; the parity harness's driver, benchmarks/speculators_driver.py).
Standard library only, so it imports in any venv.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


class _Anything:
    """Stands in for any name of a stand-in module: a class, a function, a constant."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, *args, **kwargs) -> _Anything:
        return _Anything()

    def __class_getitem__(cls, item):  # `Foo[Bar]` in annotations
        return cls


def _stand_in_attr(name: str):
    # Dunder names stay missing: importers and torch.compile probe `__file__`, `__version__`, ...
    if name.startswith("__"):
        raise AttributeError(name)
    return _Anything if name[:1].isupper() else _Anything()


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: set[str]):
        self.names = names

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _stand_in_attr
        return module

    def exec_module(self, module) -> None:
        pass


def stand_in(names: tuple[str, ...] = ("openai", "datasets")) -> list[str]:
    """Empty modules for those of `names` not installed -> the names stood in for."""
    missing = {n for n in names if importlib.util.find_spec(n) is None}
    if missing:
        sys.meta_path.append(_StandInFinder(missing))
    return sorted(missing)
