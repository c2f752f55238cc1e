"""Offline τ through a served engine (`verify.engine: server`): held-out prompts decoded plainly by the target's
baseline server and speculatively by the draft's server, started from the export as serve starts them
(`steps.lib.serving.start`: SGLang with the derived EAGLE3 flags, or the reference server), one at a time so a
target that fills the node is never loaded twice. Requests go through the one client
(`steps.lib.serving.client`), so accept counts are read exactly as benchmark reads live ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from steps.lib.config import PipelineConfig
from steps.lib.http import get_json
from steps.lib.metrics import AcceptStats
from steps.lib.runtime.processes import forwarding_signals
from steps.lib.serving import start as serving
from steps.lib.serving.client import generate_all, logit_gap, request_stats

#: one decoded prompt: (new tokens, seconds); a speculative one also has its accept counts.
Output = tuple[list[int], float]
SpecOutput = tuple[list[int], AcceptStats, float]


@contextlib.contextmanager
def one_server(cfg: PipelineConfig, store: Any, export_id: str, target_id: str, *, baseline: bool
               ) -> Iterator[tuple[str, dict[str, Any]]]:
    """(base URL, /server_info) of a started server — the target alone, or with the exported draft after the
    serve preflight and smoke test — stopped when the block ends (and on SIGTERM)."""
    _, server = serving.start(cfg, store, export_id, target_id, baseline=baseline)
    try:
        with forwarding_signals(server.stop):
            yield server.base_url, get_json(f"{server.base_url}/server_info")
    finally:
        server.stop()


def plain_outputs(base_url: str, prompts: list[list[int]], *, max_new_tokens: int, concurrency: int
                  ) -> list[Output]:
    """Greedy outputs of the baseline server, with each request's server-side seconds."""
    return [(list(r["output_ids"]), float(r["meta_info"]["e2e_latency"]))
            for r in generate_all(base_url, prompts, concurrency=concurrency, max_new_tokens=max_new_tokens)]


def spec_outputs(base_url: str, prompts: list[list[int]], *, max_new_tokens: int, concurrency: int,
                 num_steps: int) -> list[SpecOutput]:
    """Greedy outputs of the speculative server with each request's accept histogram; a server that
    verified nothing for a request that decoded past its first token is not decoding speculatively."""
    out = []
    for r in generate_all(base_url, prompts, concurrency=concurrency, max_new_tokens=max_new_tokens):
        meta = r["meta_info"]
        if len(r["output_ids"]) > 1 and "spec_verify_ct" not in meta:      # the prefill gives the first token
            raise RuntimeError(f"{base_url}/generate: meta_info has no spec_verify_ct (got {sorted(meta)}); the "
                               "server is not decoding speculatively — check --speculative-algorithm")
        out.append((list(r["output_ids"]), request_stats(meta, num_steps), float(meta["e2e_latency"])))
    return out


def logit_gaps(base_url: str, wanted: list[tuple[tuple[int, ...], int, int]]) -> dict[tuple, float]:
    """The baseline server's logit gap for each (context, plain token, speculative token)."""
    return {key: logit_gap(base_url, list(key[0]), key[1], key[2]) for key in wanted}
