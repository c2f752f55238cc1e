"""The failure catalogue (DESIGN.md F1–F9) → the one function that judges each row.

Every `Finding` for a row is built in that row's module and nowhere else (tests/unit/test_checks.py
scans the source). Serve's preflight (`steps/lib/serving/start.py`), the export's strict checker
(`steps/lib/checks/strict.py`), doctor (`steps/lib/diagnose.py`) and the gate (through doctor) call
these modules; none of them holds a rule of its own. A new row: a module here, a row in CATALOGUE,
a row in DESIGN.md's table, and a test that reproduces the failure.
"""

from __future__ import annotations

from collections.abc import Callable

from steps.lib.checks import algorithm, config, context, cuda_graph, disk, keys, layers, tau, vocab
from steps.lib.checks.finding import Finding

#: row → (what went wrong, the check that judges it). The module of each check owns the row.
CATALOGUE: dict[str, tuple[str, Callable[..., Finding]]] = {
    "F1": ("EAGLE/NEXTN algorithm with an EAGLE-3 draft: no aux capture, fc skipped", algorithm.check_algorithm),
    "F2": ("weight keys the serving loader drops without a word", keys.check_keys),
    "F3": ("d2t absolute, missing or float", vocab.check_vocab),
    "F4": ("aux layer ids differ between training and serving", layers.check_aux_layers),
    "F5": ("draft max_position_embeddings shorter than the serving context", context.check_context),
    "F6": ("CUDA graph capture hangs at startup", cuda_graph.check_cuda_graph),
    "F7": ("draft_vocab_size missing or null, wrong architecture", config.check_config_fields),
    "F8": ("hidden states do not fit on local disk", disk.check_disk_budget),
    "F9": ("acceptance never measured before scaling; live τ ≈ 1 with offline τ good", tau.compare_tau),
}


def module_of(row: str) -> str:
    """The module that owns a row (the only one allowed to build a Finding for it)."""
    return CATALOGUE[row][1].__module__
