"""The reference server: the reference engine behind the subset of SGLang 0.5.23's HTTP API we use.

Reads: the SAME argv `steps.serve.build_sglang_command` builds for SGLang (launcher
`python -m steps.lib.reference.server`): `--model-path` (a Hugging Face target dir), and for a draft
`--speculative-algorithm`, `--speculative-draft-model-path` (an exported SGLang dir),
`--speculative-num-steps/-eagle-topk/-num-draft-tokens`; any other SGLang flag is accepted and
recorded in /server_info. The draft is loaded with SGLang's lenient rules
(`steps/lib/formats/sglang_loader.py`), and `EAGLE`/`NEXTN` run the engine without aux capture, so the
draft's `fc` is skipped exactly as SGLang skips it: F1–F4 reproduce for real, and the pipeline's
preflight, smoke test, benchmark and doctor are tested against a live server.
Writes: nothing but its log (stdout).

Endpoints: `steps/lib/reference/http.py` (docs/ARCHITECTURE.md "Serving: the reference server").
The engine decodes batch 1 and greedily: generation is serialised by one lock, a batched
/generate is served request by request, and `temperature > 0` is refused (400), never ignored.

F6 stand-in: with `EAGLENEST_REFERENCE_HANG_WITH_CUDA_GRAPH=1` the server answers 503 forever
unless CUDA graphs are off (`--cuda-graph-backend-decode disabled` or `--disable-cuda-graph`),
like a CUDA graph capture hang, so the serve step's retry is exercised for real.

    python -m steps.lib.reference.server --model-path T --speculative-algorithm EAGLE3 \\
        --speculative-draft-model-path D --speculative-num-steps 3 --port 30000
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any

from steps.lib.formats.sglang import AUTO_NUM_STEPS
from steps.lib.reference.http import Handler
from steps.lib.reference.model import ENGINE_ALGORITHM, ServedModel, cuda_graphs_disabled

#: set to 1 to make the server hang "in CUDA graph capture" unless CUDA graphs are disabled (F6).
HANG_ENV = "EAGLENEST_REFERENCE_HANG_WITH_CUDA_GRAPH"


# --- argv: SGLang's flags ---------------------------------------------------------------------------

def parse_args(argv: list[str]) -> tuple[argparse.Namespace, dict[str, Any]]:
    """SGLang-style flags -> (known flags, every other `--flag [value]` as recorded extras)."""
    p = argparse.ArgumentParser(prog="python -m steps.lib.reference.server", description=__doc__.splitlines()[0],
                                allow_abbrev=True)
    p.add_argument("--model-path", required=True)
    p.add_argument("--speculative-algorithm", default=None, choices=sorted(ENGINE_ALGORITHM))
    p.add_argument("--speculative-draft-model-path", default=None)
    p.add_argument("--speculative-num-steps", type=int, default=AUTO_NUM_STEPS)
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
