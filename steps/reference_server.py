"""The reference server: the reference engine behind the subset of SGLang 0.5.23's HTTP API we use.

Reads: the SAME argv `steps.serve.build_sglang_command` builds for SGLang (launcher
`python -m steps.reference_server`): `--model-path` (a Hugging Face target dir), and for a draft
`--speculative-algorithm`, `--speculative-draft-model-path` (an exported SGLang dir),
`--speculative-num-steps/-eagle-topk/-num-draft-tokens`; any other SGLang flag is accepted and
recorded in /server_info. The draft is loaded with SGLang's lenient rules
(`steps/formats/sglang_loader.py`), and `EAGLE`/`NEXTN` run the engine without aux capture, so the
draft's `fc` is skipped exactly as SGLang skips it: F1–F4 reproduce for real, and the pipeline's
preflight, smoke test, benchmark and doctor are tested against a live server.
Writes: nothing but its log (stdout).

Endpoints: `steps/reference_http.py` (docs/ARCHITECTURE.md "Serving: the reference server").
The engine decodes batch 1 and greedily: generation is serialised by one lock, a batched
/generate is served request by request, and `temperature > 0` is refused (400), never ignored.

F6 stand-in: with `EAGLENEST_REFERENCE_HANG_WITH_CUDA_GRAPH=1` the server answers 503 forever
unless CUDA graphs are off (`--cuda-graph-backend-decode disabled` or `--disable-cuda-graph`),
like a CUDA graph capture hang, so the serve step's retry is exercised for real.

    python -m steps.reference_server --model-path T --speculative-algorithm EAGLE3 \\
        --speculative-draft-model-path D --speculative-num-steps 3 --port 30000
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from steps.metrics import AcceptStats
from steps.reference_http import Handler, finish_reason, sampling, spec_meta_info

#: set to 1 to make the server hang "in CUDA graph capture" unless CUDA graphs are disabled (F6).
HANG_ENV = "EAGLENEST_REFERENCE_HANG_WITH_CUDA_GRAPH"
#: SGLang's /server_info shows NEXTN as EAGLE; both mean "no aux capture" (F1).
SHOWN_ALGORITHM = {"EAGLE3": "EAGLE3", "EAGLE": "EAGLE", "NEXTN": "EAGLE"}
#: the reference engine's mode per algorithm: EAGLE3 captures aux layers, EAGLE sends the final hidden.
ENGINE_ALGORITHM = {"EAGLE3": "EAGLE3", "EAGLE": "EAGLE", "NEXTN": "EAGLE"}
# --- argv: SGLang's flags ---------------------------------------------------------------------------

def parse_args(argv: list[str]) -> tuple[argparse.Namespace, dict[str, Any]]:
    """SGLang-style flags -> (known flags, every other `--flag [value]` as recorded extras)."""
    p = argparse.ArgumentParser(prog="python -m steps.reference_server", description=__doc__.splitlines()[0],
                                allow_abbrev=True)
    p.add_argument("--model-path", required=True)
    p.add_argument("--speculative-algorithm", default=None, choices=sorted(ENGINE_ALGORITHM))
    p.add_argument("--speculative-draft-model-path", default=None)
    p.add_argument("--speculative-num-steps", type=int, default=3)
    p.add_argument("--speculative-eagle-topk", type=int, default=1)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--cuda-graph-backend-decode", default="full")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")
    args, rest = p.parse_known_args(argv)
    if args.speculative_algorithm and not args.speculative_draft_model_path:
        p.error(f"--speculative-algorithm {args.speculative_algorithm} needs --speculative-draft-model-path "
                "(SGLang would load the target itself as the draft and crash)")
    if args.speculative_num_draft_tokens is None:       # SGLang's topk=1 default: the chain plus the root
        args.speculative_num_draft_tokens = args.speculative_num_steps + 1
    return args, extra_flags(rest)


def extra_flags(rest: list[str]) -> dict[str, Any]:
    """`--a 1 --b --c=x` -> {"a": "1", "b": True, "c": "x"}: flags SGLang takes that we only record."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(rest):
        token = rest[i]
        if not token.startswith("--"):
            raise SystemExit(f"reference_server: unexpected argument {token!r} (flags are --name [value])")
        name, eq, inline = token[2:].partition("=")
        if eq:
            out[name.replace("-", "_")] = inline
        elif i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            out[name.replace("-", "_")] = rest[i + 1]
            i += 1
        else:
            out[name.replace("-", "_")] = True
        i += 1
    return out


def cuda_graphs_disabled(args: argparse.Namespace) -> bool:
    return args.disable_cuda_graph or args.cuda_graph_backend_decode == "disabled"


# --- the engine behind the endpoints ------------------------------------------------------------------

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

        from steps.engine import Engine
        from steps.formats.sglang import sglang_layer_ids
        from steps.formats.sglang_loader import load_sglang_draft

        a = self.args
        target = AutoModelForCausalLM.from_pretrained(a.model_path, dtype=torch.float32, use_safetensors=True,
                                                      trust_remote_code=a.trust_remote_code).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(a.model_path, trust_remote_code=a.trust_remote_code)
        draft, layer_ids = None, []
        if a.speculative_algorithm:
            check_draft_context(Path(a.speculative_draft_model_path), target.config, self.extras)
            draft, report = load_sglang_draft(a.speculative_draft_model_path, target=target)
            self.load_report = report.to_dict()
            if ENGINE_ALGORITHM[a.speculative_algorithm] == "EAGLE3":
                layer_ids = sglang_layer_ids(Path(a.speculative_draft_model_path))
        self.engine = Engine(target, self.tokenizer, draft, layer_ids=layer_ids, num_steps=a.speculative_num_steps,
                             algorithm=ENGINE_ALGORITHM.get(a.speculative_algorithm or "EAGLE3", "EAGLE3"))

    @property
    def speculative(self) -> bool:
        return self.engine is not None and self.engine.draft is not None

    @property
    def eos(self) -> int | None:
        return self.tokenizer.eos_token_id

    # one request -------------------------------------------------------------------------------------

    def generate(self, input_ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
        """One /generate request -> SGLang's response object (text, output_ids, meta_info)."""
        max_new, eos = sampling(params, self.eos)
        t0 = time.perf_counter()
        with self.lock:
            if self.speculative:
                out, stats = self.engine.generate(input_ids, max_new, eos)
                self.total.merge(stats)
            else:
                out, stats = self.engine.generate_plain(input_ids, max_new, eos), None
        return self.response(input_ids, out, stats, time.perf_counter() - t0, eos)

    def stream(self, input_ids: list[int], params: dict[str, Any]) -> Iterator[list[int]]:
        """The same generation, yielding the tokens of each target forward as it finishes."""
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
        from steps.store import code_version

        a = self.args
        return {**self.extras, "model_path": a.model_path,
                "speculative_algorithm": SHOWN_ALGORITHM.get(a.speculative_algorithm or "", None),
                "speculative_draft_model_path": a.speculative_draft_model_path,
                "speculative_num_steps": a.speculative_num_steps if a.speculative_algorithm else None,
                "speculative_eagle_topk": a.speculative_eagle_topk if a.speculative_algorithm else None,
                "speculative_num_draft_tokens": a.speculative_num_draft_tokens if a.speculative_algorithm else None,
                "cuda_graph_backend_decode": "disabled" if cuda_graphs_disabled(a) else a.cuda_graph_backend_decode,
                "host": a.host, "port": a.port,
                "launch_command": shlex.join([sys.executable, "-m", "steps.reference_server", *self.argv]),
                "version": f"reference-{code_version()}", "engine": "reference",
                # cumulative since start, like SGLang's: use per-request meta_info for evaluation
                "internal_states": [{"avg_spec_accept_length": self.total.tau if self.speculative else None}],
                "draft_load_report": self.load_report}


# --- process ------------------------------------------------------------------------------------------------

#: SGLang's escape hatch for a draft whose context is shorter than the target's (sglang.md §1.8).
OVERWRITE_CONTEXT_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"


def check_draft_context(draft_dir: Path, target_config: Any, extras: dict[str, Any]) -> None:
    """F5 as SGLang 0.5.23 does it: the draft gets the target's context length, and a draft
    `max_position_embeddings` below it refuses to start unless the env override is set."""
    draft_ctx = int(json.loads((draft_dir / "config.json").read_text()).get("max_position_embeddings") or 0)
    target_ctx = int(extras.get("context_length") or getattr(target_config, "max_position_embeddings", 0) or 0)
    if draft_ctx < target_ctx and os.environ.get(OVERWRITE_CONTEXT_ENV, "").lower() not in ("1", "true"):
        raise ValueError(f"Target model's context_length ({target_ctx}) is greater than the derived "
                         f"context_length ({draft_ctx}) of the draft model {draft_dir}. To allow overriding "
                         f"this maximum, set the env var {OVERWRITE_CONTEXT_ENV}=1")


def serve(args: argparse.Namespace, extras: dict[str, Any], argv: list[str]) -> int:
    """Bind first (health answers 503 while loading, like SGLang), load, then serve until SIGTERM."""
    backend = ServedModel(args, extras, argv)
    handler = type("BoundHandler", (Handler,), {"backend": backend})
    handler.hang = os.environ.get(HANG_ENV) == "1" and not cuda_graphs_disabled(args)
    httpd = ThreadingHTTPServer((args.host, args.port), handler)
    httpd.daemon_threads = True
    # shutdown() waits for serve_forever to return, so it must run off the thread serving
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=httpd.shutdown, daemon=True).start())
    print(f"[reference_server] listening on http://{args.host}:{args.port}; loading {args.model_path} "
          f"(algorithm {args.speculative_algorithm or 'none'}); extra flags {extras}", flush=True)
    if handler.hang:   # nothing is loaded: a hung capture never gets that far
        print(f"[reference_server] {HANG_ENV}=1: capturing CUDA graphs ... (never finishes; start with "
              "--cuda-graph-backend-decode disabled)", flush=True)
    else:
        threading.Thread(target=_load, args=(backend, httpd), daemon=True).start()
    try:
        httpd.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    httpd.server_close()
    print("[reference_server] stopped", flush=True)
    return 0 if backend.ready or handler.hang else 1


def _load(backend: ServedModel, httpd: ThreadingHTTPServer) -> None:
    try:
        t0 = time.perf_counter()
        backend.load()
        backend.ready = True
        print(f"[reference_server] ready in {time.perf_counter() - t0:.1f} s", flush=True)
    except Exception as err:  # noqa: BLE001 — any load failure must end the server with its message
        import traceback

        traceback.print_exc()
        print(f"[reference_server] failed to load: {type(err).__name__}: {err}", flush=True)
        threading.Thread(target=httpd.shutdown, daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extras = parse_args(argv)
    return serve(args, extras, argv)


if __name__ == "__main__":
    raise SystemExit(main())
