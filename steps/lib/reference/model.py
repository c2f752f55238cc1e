"""The reference server's loaded model: the target (+ draft, loaded with SGLang's lenient rules) behind the
endpoints, one generation at a time, with the cumulative accept counts /server_info reports. F5 is checked
at load as SGLang 0.5.23 checks it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from steps.lib.metrics import AcceptStats
from steps.lib.reference.api import RequestError, finish_reason, sampling, spec_meta_info

#: SGLang's /server_info shows NEXTN as EAGLE; both mean "no aux capture" (F1).
SHOWN_ALGORITHM = {"EAGLE3": "EAGLE3", "EAGLE": "EAGLE", "NEXTN": "EAGLE"}
#: the reference engine's mode per algorithm: EAGLE3 captures aux layers, EAGLE sends the final hidden.
ENGINE_ALGORITHM = {"EAGLE3": "EAGLE3", "EAGLE": "EAGLE", "NEXTN": "EAGLE"}
#: SGLang's escape hatch for a draft whose context is shorter than the target's (sglang.md §1.8).
OVERWRITE_CONTEXT_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"


def cuda_graphs_disabled(args: argparse.Namespace) -> bool:
    return args.disable_cuda_graph or args.cuda_graph_backend_decode == "disabled"


class ServedModel:
    """The loaded target (+ draft) and the cumulative accept counts; one generation at a time."""

    def __init__(self, args: argparse.Namespace, extras: dict[str, Any], argv: list[str]):
        self.args, self.extras, self.argv = args, extras, argv
        self.lock = threading.Lock()
        self.ready = False
        self.engine: Any = None
        self.tokenizer: Any = None
        self.load_report: dict[str, Any] | None = None
        self.total = AcceptStats(args.speculative_num_steps)

    def load(self) -> None:
        """Target from --model-path; the draft with SGLang's rules; capture layers as SGLang reads them."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from steps.lib.formats.sglang import sglang_layer_ids
        from steps.lib.formats.sglang_loader import load_sglang_draft
        from steps.lib.model.checkpoint_keys import key_mapping
        from steps.lib.model.reference_engine import Engine

        a = self.args
        target = AutoModelForCausalLM.from_pretrained(a.model_path, dtype=torch.float32, use_safetensors=True,
                                                      key_mapping=key_mapping(a.model_path),
                                                      trust_remote_code=a.trust_remote_code).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(a.model_path, trust_remote_code=a.trust_remote_code)
        draft, layer_ids = None, []
        if a.speculative_algorithm:
            check_draft_context(Path(a.speculative_draft_model_path), target.config, self.extras)
            draft, report = load_sglang_draft(a.speculative_draft_model_path, target=target)
            self.load_report = report.to_dict()
            if ENGINE_ALGORITHM[a.speculative_algorithm] == "EAGLE3":
                layer_ids = sglang_layer_ids(Path(a.speculative_draft_model_path),      # as SGLang shifts them
                                             (target.config.architectures or [None])[0])
        self.engine = Engine(target, self.tokenizer, draft, layer_ids=layer_ids, num_steps=a.speculative_num_steps,
                             algorithm=ENGINE_ALGORITHM.get(a.speculative_algorithm or "EAGLE3", "EAGLE3"))

    @property
    def speculative(self) -> bool:
        return self.engine is not None and self.engine.draft is not None

    @property
    def eos(self) -> int | None:
        return self.tokenizer.eos_token_id

    # one request -------------------------------------------------------------------------------------

    def check_ids(self, input_ids: list[int]) -> None:
        """Refuse (400) a token id outside the target's vocab: the embedding lookup would crash the handler
        and the client would get an empty reply instead of the reason."""
        vocab = int(self.engine.target.config.vocab_size)
        bad = next((i for i in input_ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise RequestError(f"input_ids holds token id {bad}, outside the target's vocab [0, {vocab}); "
                               "tokenize with this model's tokenizer")
        if not input_ids:
            raise RequestError("input_ids is empty; send at least one token")

    def generate(self, input_ids: list[int], params: dict[str, Any], *,
                 logprob_ids: list[int] | None = None) -> dict[str, Any]:
        """One /generate request -> SGLang's response object (text, output_ids, meta_info); `logprob_ids`
        (SGLang's `token_ids_logprob`) adds those tokens' logprobs at every output position."""
        self.check_ids(input_ids)
        max_new, eos = sampling(params, self.eos)
        t0 = time.perf_counter()
        with self.lock:
            if self.speculative:
                out, stats = self.engine.generate(input_ids, max_new, eos)
                self.total.merge(stats)
            else:
                out, stats = self.engine.generate_plain(input_ids, max_new, eos), None
            logprobs = None if logprob_ids is None else self.token_logprobs(input_ids, out, logprob_ids)
        response = self.response(input_ids, out, stats, time.perf_counter() - t0, eos)
        if logprobs is not None:       # SGLang's shape: per output position, (logprob, token id, text)
            response["meta_info"]["output_token_ids_logprobs"] = logprobs
        return response

    def token_logprobs(self, input_ids: list[int], out: list[int], token_ids: list[int]) -> list[list[list]]:
        """The target's float32 logprobs of `token_ids` at each output position, from one plain forward."""
        import torch

        self.check_ids(list(token_ids))
        if not out:
            return []
        with torch.no_grad():
            ids = torch.tensor([input_ids + out[:-1]], device=self.engine.device)
            logits = self.engine.target(input_ids=ids).logits[0, len(input_ids) - 1:].float()
        logprobs = torch.log_softmax(logits, dim=-1)[:, list(token_ids)].tolist()
        return [[[lp, t, None] for lp, t in zip(row, token_ids, strict=True)] for row in logprobs]

    def stream(self, input_ids: list[int], params: dict[str, Any]) -> Iterator[list[int]]:
        """The same generation, yielding the tokens of each target forward as it finishes (the caller checks
        the ids and the sampling parameters before its 200 goes out)."""
        max_new, eos = sampling(params, self.eos)
        with self.lock:
            if self.speculative:
                stats = AcceptStats(self.args.speculative_num_steps)
                yield from self.engine.stream(input_ids, max_new, eos, stats)
                self.total.merge(stats)
            else:
                yield from self.engine.stream_plain(input_ids, max_new, eos)

    def response(self, input_ids: list[int], out: list[int], stats: AcceptStats | None, seconds: float,
                 eos: int | None) -> dict[str, Any]:
        meta: dict[str, Any] = {"id": uuid.uuid4().hex, "finish_reason": finish_reason(out, eos),
                                "prompt_tokens": len(input_ids), "completion_tokens": len(out),
                                "cached_tokens": 0, "e2e_latency": seconds}
        if stats is not None and stats.verify_steps > 0:     # SGLang adds them only when verify_ct > 0
            meta |= spec_meta_info(stats, len(out), self.args.speculative_num_draft_tokens)
        return {"text": self.tokenizer.decode(out, skip_special_tokens=True), "output_ids": out, "meta_info": meta}

    def server_info(self) -> dict[str, Any]:
        from steps.lib.store import code_version

        a = self.args
        return {**self.extras, "model_path": a.model_path,
                "speculative_algorithm": SHOWN_ALGORITHM.get(a.speculative_algorithm or "", None),
                "speculative_draft_model_path": a.speculative_draft_model_path,
                "speculative_num_steps": a.speculative_num_steps if a.speculative_algorithm else None,
                "speculative_eagle_topk": a.speculative_eagle_topk if a.speculative_algorithm else None,
                "speculative_num_draft_tokens": a.speculative_num_draft_tokens if a.speculative_algorithm else None,
                "cuda_graph_backend_decode": "disabled" if cuda_graphs_disabled(a) else a.cuda_graph_backend_decode,
                "host": a.host, "port": a.port,
                "launch_command": shlex.join([sys.executable, "-m", "steps.lib.reference.server", *self.argv]),
                "version": f"reference-{code_version()}", "engine": "reference",
                # cumulative since start, like SGLang's: use per-request meta_info for evaluation
                "internal_states": [{"avg_spec_accept_length": self.total.tau if self.speculative else None}],
                "draft_load_report": self.load_report}


def check_draft_context(draft_dir: Path, target_config: Any, extras: dict[str, Any]) -> None:
    """F5 as SGLang 0.5.23 does it: the draft gets the target's context length, and a draft
    `max_position_embeddings` below it refuses to start unless the env override is set."""
    draft_ctx = int(json.loads((draft_dir / "config.json").read_text()).get("max_position_embeddings") or 0)
    target_ctx = int(extras.get("context_length") or getattr(target_config, "max_position_embeddings", 0) or 0)
    if draft_ctx < target_ctx and os.environ.get(OVERWRITE_CONTEXT_ENV, "").lower() not in ("1", "true"):
        raise ValueError(f"Target model's context_length ({target_ctx}) is greater than the derived "
                         f"context_length ({draft_ctx}) of the draft model {draft_dir}. To allow overriding "
                         f"this maximum, set the env var {OVERWRITE_CONTEXT_ENV}=1")
