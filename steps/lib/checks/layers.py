"""F4, aux layers: the layers the server captures differ from those the draft was trained on.

Internal ids index HF `hidden_states`; SGLang's `eagle_config` ids are internal − 1 and it adds +1
before capturing (sglang.md §3.3), vLLM's are internal; SGLang reads capture ids from `eagle_config`
only (§3.2); the last layer's output is never captured; DeepSeek V2/V3 (and Kimi K2) targets add
the +1 only when the first id is 1. The conversions live in `steps/lib/layer_ids.py`; this module judges.
"""

from __future__ import annotations

from typing import Any

from steps.lib.checks.finding import Finding
from steps.lib.formats import engine_layer_ids
from steps.lib.layer_ids import (
    SHIFT_ONLY_IF_FIRST_IS_ONE,
    InexpressibleLayerIds,
    check_capturable,
    default_aux_layer_ids,
    family_rule,
    from_engine,
    to_engine,
)

#: where each engine reads the capture ids.
IDS_FIELD = {"sglang": "eagle_config.eagle_aux_hidden_state_layer_ids", "vllm": "eagle_aux_hidden_state_layer_ids"}


def check_aux_layers(config: dict[str, Any], engine: str, *, num_layers: int | None, target_arch: str | None,
                     trained: list[int] | None, where: str) -> Finding:
    """F4: which internal layers the `engine` server captures for this draft config, whether the target can
    capture them (and shifts them as trained), and whether they are the layers the draft was trained on."""
    ids = engine_layer_ids(config, engine)
    if engine == "sglang" and not ids and "eagle_aux_hidden_state_layer_ids" in config:
        return Finding("F4", "fail", where, f"aux layer ids only at the top level "
                       f"({config['eagle_aux_hidden_state_layer_ids']}); SGLang reads capture ids from eagle_config "
                       "only and would capture its defaults",
                       "write them as eagle_config.eagle_aux_hidden_state_layer_ids (SGLang ids = internal − 1): "
                       "re-export with steps.export, or `eaglenest convert` a speculators directory")
    if ids:
        captured, how = from_engine(ids, engine, target_arch), f"{IDS_FIELD[engine]}={ids} ({engine} convention)"
    elif num_layers is None:
        return Finding("F4", "warn", where, "no ids recorded: the server captures its defaults [2, N//2, N-3] (N "
                       "unknown without the target)", "pass the target to check them, or re-export with "
                       "steps.export to pin the trained layers")
    else:
        try:
            captured = default_aux_layer_ids(int(num_layers))
        except ValueError as err:
            return Finding("F4", "fail", where, str(err), "record explicit aux layer ids in the draft config")
        how = "no ids recorded: the server's defaults [2, N//2, N-3]"
    evidence = f"{how} → the server captures internal (HF hidden_states) {captured}"
    meant = from_engine(ids, engine) if ids else captured      # the plain convention's reading
    if (ids and trained is None and family_rule(engine, target_arch) == SHIFT_ONLY_IF_FIRST_IS_ONE
            and meant != captured):
        # without the export manifest the ids are read as the plain convention writes them
        return Finding("F4", "fail", where, f"{IDS_FIELD[engine]}={ids} with a {target_arch} target: SGLang adds "
                       f"+1 for this family only when the first id is 1, so it would capture internal {ids} "
                       f"instead of the trained {meant}",
                       "train with aux layer ids starting at internal 2 (the default [2, N//2, N-3]); steps.export "
                       "writes other ids in this family's own convention (unshifted)")
    if num_layers is not None:
        try:
            check_capturable(captured, int(num_layers))
        except ValueError as err:
            return Finding("F4", "fail", where, f"{evidence}: {err}",
                           "re-extract and retrain on layers this target can capture (internal ids 1..N−1; the last "
                           "layer's output never is), or export for the target the draft was trained on")
    if trained is not None and trained != captured:
        return Finding("F4", "fail", where, f"{evidence}, but the draft was trained on internal {trained} (export "
                       "manifest): acceptance quietly lower",
                       f"re-export so the config records {trained} in the {engine} convention (steps.export)")
    return Finding("F4", "pass", where, evidence + ("" if trained is None else f" = the trained layers {trained}")
                   + ("" if num_layers is None else f"; capturable in a {num_layers}-layer target"))


def layer_id_findings(config: dict[str, Any], engine: str, expected: list[int] | None, where: str,
                      target_arch: str | None = None) -> list[Finding]:
    """F4 for the strict checker: ids present where the engine reads them, ascending and unique, and equal to
    the `expected` internal ids in the engine's convention for a `target_arch` target."""
    ids, field = engine_layer_ids(config, engine), f"{where}:{IDS_FIELD[engine]}"
    if ids is None:
        return [Finding("F4", "fail", field, "required field is missing or null", "re-export with steps.export")]
    out = []
    if ids != sorted(set(ids)):
        out.append(Finding("F4", "fail", field, f"{ids} must be ascending and unique (the engine captures in "
                           "ascending order)", "re-export with steps.export"))
    if expected is None:
        return out
    try:
        want = to_engine(list(expected), engine, target_arch)
    except InexpressibleLayerIds as err:
        return out + [Finding("F4", "fail", field, str(err), "re-extract and retrain on expressible layer ids")]
    if ids != want:
        out.append(Finding("F4", "fail", field, f"expected {want} ({engine} convention of internal {list(expected)}"
                           f"{'' if target_arch is None else ' for a ' + target_arch + ' target'}), got {ids} (the "
                           f"engine would capture internal {from_engine(ids, engine, target_arch)}): acceptance "
                           "quietly lower", "re-export with steps.export"))
    return out
