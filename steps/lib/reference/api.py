"""The reference server's request parameters and response shapes, as SGLang 0.5.23 spells them
(shared/reference/sglang.md §4): what the served model (`model.py`) answers and the HTTP handler
(`http.py`) sends. A leaf of the package: the model and the handler both import it.
"""

from __future__ import annotations

from typing import Any

from steps.lib.metrics import AcceptStats

#: SGLang's /health_generate prompt: one greedy token after token id 0.
HEALTH_INPUT_IDS = [0]


class RequestError(ValueError):
    """A request the reference server cannot serve; answered with 400 and this message."""


def sampling(params: dict[str, Any], eos: int | None) -> tuple[int, int | None]:
    """(max_new_tokens, eos or None with ignore_eos); temperature > 0 is refused, not silently greedy."""
    temperature = float(params.get("temperature", 0.0) or 0.0)
    if temperature > 0:
        raise RequestError(f"sampling_params.temperature={temperature}: the reference engine verifies greedily; "
                           "use temperature 0 (benchmark sampled decoding on SGLang)")
    return int(params.get("max_new_tokens", 128)), None if params.get("ignore_eos") else eos


def finish_reason(out: list[int], eos: int | None) -> dict[str, Any]:
    if out and eos is not None and out[-1] == eos:
        return {"type": "stop", "matched": eos}
    return {"type": "length", "length": len(out)}


def spec_meta_info(stats: AcceptStats, completion_tokens: int, num_draft_tokens: int) -> dict[str, Any]:
    """SGLang 0.5.23's `_calculate_spec_decoding_metrics` fields (sglang.md §4.3)."""
    proposed = stats.verify_steps * (num_draft_tokens - 1)
    return {"spec_verify_ct": stats.verify_steps, "spec_num_correct_drafts": stats.accepted_drafts,
            "spec_num_proposed_drafts": proposed,
            "spec_accept_rate": stats.accepted_drafts / proposed if proposed else 0.0,
            # SGLang's own per-request number: counts the prefill token too (slightly high)
            "spec_accept_length": completion_tokens / stats.verify_steps,
            "spec_correct_drafts_histogram": list(stats.histogram)}
