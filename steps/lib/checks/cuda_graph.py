"""F6, CUDA graph capture: a server that hangs capturing graphs with the draft is never healthy.

The launcher (`steps/lib/serving/launch.py`) waits for health with a deadline and retries once with CUDA graphs
off, recording both attempts; this check reads what a running server reports and those attempts.
"""

from __future__ import annotations

from typing import Any

from steps.lib.checks.finding import Finding


def check_cuda_graph(info: dict[str, Any], serve_record: list[dict[str, Any]] | None, *,
                     where: str = "server") -> Finding:
    """F6: healthy with CUDA graphs on (pass) or only with them off (warn), with every start attempt."""
    launch = str(info.get("launch_command") or "")
    disabled = bool(info.get("disable_cuda_graph")) or info.get("cuda_graph_backend_decode") == "disabled" \
        or "--disable-cuda-graph" in launch or "--cuda-graph-backend-decode disabled" in launch
    attempts = "" if not serve_record else "; start attempts: " + "; ".join(
        f"cuda_graph={a.get('cuda_graph')} → {str(a.get('outcome'))[:80]} ({a.get('seconds')} s)" for a in serve_record)
    if disabled:
        return Finding("F6", "warn", where, f"healthy with CUDA graphs disabled (slower decode){attempts}",
                       "if the start with graphs hung, debug capture: --cuda-graph-max-bs-decode 1..8, "
                       "--debug-cuda-graph (sglang.md §5)")
    return Finding("F6", "pass", where, f"healthy with CUDA graphs on{attempts}")


def server_unreachable(server: str, err: Exception) -> Finding:
    """F6: a server that does not answer at all (never became healthy, or died)."""
    return Finding("F6", "fail", f"{server}/server_info", f"did not answer: {err}",
                   "start the server (steps.serve retries once without CUDA graphs) and read its log")
