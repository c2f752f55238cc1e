"""F1, the speculative algorithm: an EAGLE-3 draft served with `--speculative-algorithm EAGLE` (or NEXTN).

The target then captures no aux layers and sends only its last hidden state (width H, not A·H); the
draft's `fc` is skipped because the widths match, and accept length is 1.00 with no warning
(sglang.md §1.5, §2.3: SGLang never infers EAGLE3 from the draft). The algorithm is therefore read
from the draft's architecture by a table, never typed; `check_algorithm` judges a command or a
running server, `check_aux_capture_flag` a config that switches capture off.
"""

from __future__ import annotations

from typing import Any

from steps.lib.checks.finding import Finding

#: draft `architectures[0]` → the SGLang speculative algorithm that serves it. A table, not substring
#: matching: an unknown architecture is an error naming the known ones.
ALGORITHM_BY_ARCHITECTURE: dict[str, str] = {
    "LlamaForCausalLMEagle3": "EAGLE3",
}
#: algorithms SGLang resolves to plain EAGLE (`NEXTN` is an alias): no aux capture.
NON_AUX_ALGORITHMS = frozenset({"EAGLE", "NEXTN"})


def draft_architecture(draft_config: dict[str, Any]) -> str | None:
    """`architectures[0]` of a draft config.json, or None."""
    return (draft_config.get("architectures") or [None])[0]


def is_eagle3_draft(draft_config: dict[str, Any]) -> bool:
    """An EAGLE-3 draft by its declared architecture, or by its EAGLE-3 `eagle_config` (a mislabelled one)."""
    if ALGORITHM_BY_ARCHITECTURE.get(draft_architecture(draft_config) or "") == "EAGLE3":
        return True
    eagle_config = draft_config.get("eagle_config") or {}
    return "eagle_aux_hidden_state_layer_ids" in eagle_config or bool(eagle_config.get("use_aux_hidden_state"))


def speculative_algorithm(draft_config: dict[str, Any], where: str = "draft config.json") -> str:
    """The algorithm that serves this draft, from the architecture table."""
    arch = draft_architecture(draft_config)
    if arch not in ALGORITHM_BY_ARCHITECTURE:
        raise KeyError(f"{where}: architectures[0]={arch!r} has no known SGLang algorithm; known: "
                       f"{', '.join(ALGORITHM_BY_ARCHITECTURE)}. Re-export the draft with steps.export")
    return ALGORITHM_BY_ARCHITECTURE[arch]


def check_algorithm(algorithm: str | None, *, eagle3: bool, where: str, detail: str = "") -> Finding:
    """F1: the algorithm a command passes or a server runs, for a draft that is (or is not) EAGLE-3.

    `detail` is appended to the evidence (a live server's τ, the directory it really serves)."""
    algorithm = (algorithm or "").upper()
    if not eagle3:
        return Finding("F1", "skip", where, f"not an EAGLE-3 draft; algorithm {algorithm or 'unset'}{detail}")
    if algorithm in NON_AUX_ALGORITHMS:
        return Finding("F1", "fail", where, f"EAGLE-3 draft served with --speculative-algorithm {algorithm}: the "
                       f"target captures no aux layers and the draft's fc is skipped silently (accept length "
                       f"1.00){detail}",
                       "use EAGLE3 — the target would capture no aux layers and the draft's fc would be skipped "
                       "silently (accept length 1.00); derive the command with steps.serve")
    if algorithm != "EAGLE3":
        return Finding("F1", "fail", where, f"EAGLE-3 draft but --speculative-algorithm is {algorithm or 'not set'}: "
                       f"the draft is not used{detail}", "pass --speculative-algorithm EAGLE3")
    return Finding("F1", "pass", where, f"EAGLE-3 draft served with EAGLE3{detail}")


def check_aux_capture_flag(config: dict[str, Any], engine: str, where: str) -> list[Finding]:
    """F1 in a config: SGLang's `eagle_config.use_aux_hidden_state: false` makes the target send its final
    hidden state only, exactly as `--speculative-algorithm EAGLE` does (the strict checker's view)."""
    if engine != "sglang":
        return []
    got = (config.get("eagle_config") or {}).get("use_aux_hidden_state", "missing")
    if got is True:
        return []
    return [Finding("F1", "fail", f"{where}:eagle_config.use_aux_hidden_state", f"expected True, got {got!r}: false "
                    "makes the target send its final hidden only", "re-export with steps.export")]
