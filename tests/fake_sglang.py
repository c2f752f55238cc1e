"""The fast stand-in for SGLang's start-up (F6 and the launch lifecycle), run as a script:
`python tests/fake_sglang.py --port P [SGLang flags...] [options]`.

A real HTTP server on 127.0.0.1 that takes SGLang's flags, answers /health_generate with 503 until it is
"ready", and can hang in "CUDA graph capture" (never ready) unless started with --cuda-graph-backend-decode
disabled: the CUDA-graph retry is exercised in seconds, not the ~40 s a real load + hang takes (the one live
F6 wait is tests/unit/test_reference_server.py's). It can start a child process (like SGLang's scheduler)
whose pid it writes down, so a test can check that stop() ends the whole group.
"""

import argparse
import http.server
import os
import signal
import subprocess
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--cuda-graph-backend-decode", default="full")
    p.add_argument("--ready-after-s", type=float, default=0.0)
    p.add_argument("--hang-with-cuda-graphs", action="store_true")
    p.add_argument("--exit-code", type=int, default=None)
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--child-pid-file", default=None)
    args, _sglang_flags = p.parse_known_args()
    print("fake server argv:", sys.argv[1:], "mark:", os.environ.get("EAGLENEST_TEST_MARK"), flush=True)
    if args.exit_code is not None:
        print("fake server: bad arguments", flush=True)
        sys.exit(args.exit_code)
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.child_pid_file:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(args.child_pid_file, "w") as f:
            f.write(str(child.pid))
    hangs = args.hang_with_cuda_graphs and args.cuda_graph_backend_decode != "disabled"
    if hangs:
        print("fake server: capturing CUDA graphs", flush=True)
    ready_at = float("inf") if hangs else time.monotonic() + args.ready_after_s

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            ok = self.path == "/health_generate" and time.monotonic() >= ready_at
            self.send_response(200 if ok else 503)
            self.end_headers()

        def log_message(self, *a) -> None:
            pass

    http.server.HTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
