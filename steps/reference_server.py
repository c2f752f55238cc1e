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

Endpoints (docs/ARCHITECTURE.md "Serving: the reference server"): `/health`, `/health_generate`
(a real 1-token generation), `/server_info`, `/model_info`, `/v1/models`, `POST /generate`
(SGLang's `spec_*` meta_info for finished requests), `POST /v1/completions` (SSE with `stream`).
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
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from steps.metrics import AcceptStats

#: set to 1 to make the server hang "in CUDA graph capture" unless CUDA graphs are disabled (F6).
HANG_ENV = "EAGLENEST_REFERENCE_HANG_WITH_CUDA_GRAPH"
#: SGLang's /server_info shows NEXTN as EAGLE; both mean "no aux capture" (F1).
SHOWN_ALGORITHM = {"EAGLE3": "EAGLE3", "EAGLE": "EAGLE", "NEXTN": "EAGLE"}
#: the reference engine's mode per algorithm: EAGLE3 captures aux layers, EAGLE sends the final hidden.
ENGINE_ALGORITHM = {"EAGLE3": "EAGLE3", "EAGLE": "EAGLE", "NEXTN": "EAGLE"}
#: SGLang's /health_generate prompt: one greedy token after token id 0.
HEALTH_INPUT_IDS = [0]


class RequestError(ValueError):
    """A request the reference server cannot serve; answered with 400 and this message."""


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

class Backend:
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

    def generate(self, input_ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
        """One /generate request -> SGLang's response object (text, output_ids, meta_info)."""
        self.check_ids(input_ids)
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
        """The same generation, yielding the tokens of each target forward as it finishes (the caller checks
        the ids and the sampling parameters before its 200 goes out)."""
        max_new, eos = sampling(params, self.eos)
        with self.lock:
            yield from (stream_speculative if self.speculative else stream_plain)(self, input_ids, max_new, eos)

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


# streaming mirrors Engine.generate / generate_plain step by step (the engine has no token callback)

def stream_speculative(b: Backend, prompt: list[int], max_new: int, eos: int | None) -> Iterator[list[int]]:
    from transformers import DynamicCache

    from steps.engine import _State

    e, emitted = b.engine, 0
    s = _State(x=list(prompt), target_cache=DynamicCache())
    t, s.feats = e.target_forward(prompt, s.target_cache)
    s.x.append(int(t[-1]))
    while True:
        out = cut(s.x[len(prompt):], max_new, eos)
        if len(out) > emitted:
            yield out[emitted:]
            emitted = len(out)
        if len(out) >= max_new or (eos is not None and eos in out):
            return
        _, a = e.speculative_step(s)
        b.total.add(a)


def stream_plain(b: Backend, prompt: list[int], max_new: int, eos: int | None) -> Iterator[list[int]]:
    import torch
    from transformers import DynamicCache

    e, cache, out, ids = b.engine, DynamicCache(), [], prompt
    with torch.no_grad():
        while len(out) < max_new and not (eos is not None and eos in out):
            logits = e._target(ids, cache).logits
            out.append(int(logits[0, -1].argmax()))
            ids = out[-1:]
            yield out[-1:]


def cut(out: list[int], max_new: int, eos: int | None) -> list[int]:
    if eos is not None and eos in out:
        out = out[:out.index(eos) + 1]
    return out[:max_new]


# --- HTTP ------------------------------------------------------------------------------------------------

def prompts_of(body: dict[str, Any], tokenizer: Any) -> tuple[list[list[int]], bool]:
    """/generate's `text` or `input_ids`, single or batched -> (token id lists, batched?)."""
    if body.get("input_ids") is not None:
        ids = body["input_ids"]
        batched = bool(ids) and isinstance(ids[0], list)
        return ([list(map(int, x)) for x in ids] if batched else [list(map(int, ids))]), batched
    if body.get("text") is not None:
        texts = body["text"]
        batched = isinstance(texts, list)
        return [tokenizer(t)["input_ids"] for t in (texts if batched else [texts])], batched
    raise RequestError("/generate needs 'text' (str or list) or 'input_ids' (list of ints or of lists)")


class Handler(BaseHTTPRequestHandler):
    backend: Backend          # set on the class by `serve`
    hang: bool = False
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        b = self.backend
        path = self.path.split("?")[0]
        if path in ("/health", "/health_generate"):
            if not b.ready or self.hang:
                return self.send_json({"error": "starting"}, HTTPStatus.SERVICE_UNAVAILABLE)
            b.generate(HEALTH_INPUT_IDS, {"max_new_tokens": 1, "ignore_eos": True})
            return self.send_json({})
        if not b.ready:
            return self.send_json({"error": "starting"}, HTTPStatus.SERVICE_UNAVAILABLE)
        if path in ("/server_info", "/get_server_info"):
            return self.send_json(b.server_info())
        if path in ("/model_info", "/get_model_info"):
            return self.send_json({"model_path": b.args.model_path, "is_generation": True})
        if path == "/v1/models":
            return self.send_json({"object": "list", "data": [{"id": b.args.model_path, "object": "model"}]})
        self.send_json({"error": f"no route {path}"}, HTTPStatus.NOT_FOUND)

    def do_POST(self) -> None:
        b = self.backend
        if not b.ready:
            return self.send_json({"error": "starting"}, HTTPStatus.SERVICE_UNAVAILABLE)
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path == "/generate":
                prompts, batched = prompts_of(body, b.tokenizer)
                outs = [b.generate(ids, body.get("sampling_params") or {}) for ids in prompts]
                return self.send_json(outs if batched else outs[0])
            if self.path == "/v1/completions":
                return self.completions(body)
            self.send_json({"error": f"no route {self.path}"}, HTTPStatus.NOT_FOUND)
        except (RequestError, ValueError, KeyError, TypeError) as err:
            self.send_json({"error": {"message": str(err), "type": "BadRequestError"}}, HTTPStatus.BAD_REQUEST)

    def completions(self, body: dict[str, Any]) -> None:
        """OpenAI /v1/completions: one string prompt (or token ids), optional SSE streaming."""
        b = self.backend
        prompt = body.get("prompt", "")
        ids = list(map(int, prompt)) if isinstance(prompt, list) else b.tokenizer(prompt)["input_ids"]
        params = {"max_new_tokens": body.get("max_tokens", 16), "temperature": body.get("temperature", 0.0),
                  "ignore_eos": body.get("ignore_eos", False)}
        cid, model = f"cmpl-{uuid.uuid4().hex}", b.args.model_path
        if not body.get("stream"):
            r = b.generate(ids, params)
            usage = {"prompt_tokens": len(ids), "completion_tokens": len(r["output_ids"]),
                     "total_tokens": len(ids) + len(r["output_ids"])}
            return self.send_json({"id": cid, "object": "text_completion", "created": int(time.time()),
                                   "model": model, "usage": usage,
                                   "choices": [{"index": 0, "text": r["text"], "logprobs": None,
                                                "finish_reason": r["meta_info"]["finish_reason"]["type"]}]})
        sampling(params, b.eos)                       # refuse before the 200 goes out
        b.check_ids(ids)
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        out: list[int] = []
        text = ""
        for new in b.stream(ids, params):
            out += new
            full = b.tokenizer.decode(out, skip_special_tokens=True)
            self.sse({"id": cid, "object": "text_completion", "model": model,
                      "choices": [{"index": 0, "text": full[len(text):], "finish_reason": None}]})
            text = full
        self.sse({"id": cid, "object": "text_completion", "model": model,
                  "choices": [{"index": 0, "text": "", "finish_reason": finish_reason(out, b.eos)["type"]}],
                  "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out),
                            "total_tokens": len(ids) + len(out)}})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True

    def sse(self, obj: dict[str, Any]) -> None:
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()

    def send_json(self, obj: Any, status: HTTPStatus = HTTPStatus.OK) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, fmt: str, *args: Any) -> None:
        if self.path.startswith("/health"):      # polled twice a second while starting: not worth a line
            return
        print(f"[reference_server] {self.address_string()} {fmt % args}", flush=True)


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
    backend = Backend(args, extras, argv)
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


def _load(backend: Backend, httpd: ThreadingHTTPServer) -> None:
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
