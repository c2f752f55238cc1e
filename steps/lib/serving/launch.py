"""Launch: start a server process, wait for its health with a deadline, retry once without CUDA graphs, stop it.

Reads: a launch argv (built by `steps.serve`); writes: the server's log (stdout + stderr) and a record
of every start attempt `{command, cuda_graph, outcome, seconds, log}`. Prevents F6 going unnoticed:
a CUDA graph capture hang at startup becomes a deadline, one retry with CUDA graphs off, and both
attempts recorded. The process machinery (own process group, stop, health wait, signal forwarding) is
`steps/lib/runtime/processes.py`, shared with the local Prefect stack.
"""

from __future__ import annotations

import logging
import os
import shlex
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steps.lib.runtime.processes import http_status, spawn, stop_process, wait_until

#: seconds between health polls.
HEALTH_POLL_INTERVAL_S = 0.5
#: one poll may take this long: /health_generate runs a 1-token generation and answers 503 only
#: after SGLANG_HEALTH_CHECK_TIMEOUT (20 s), so a shorter client timeout would never see its answer.
HEALTH_REQUEST_TIMEOUT_S = 25.0
#: seconds a server gets to exit after SIGTERM before SIGKILL.
STOP_GRACE_S = 30.0


class ServerStartError(RuntimeError):
    """No attempt produced a healthy server; `attempts` records each one."""

    def __init__(self, message: str, attempts: list[dict[str, Any]]):
        self.attempts = attempts
        super().__init__(message)

    def __reduce__(self) -> tuple[type, tuple[str, list[dict[str, Any]]]]:
        # Prefect persists a failed run's exception (pickled) and the parent reads it back: both arguments
        return type(self), (str(self), self.attempts)


@dataclass
class Server:
    """A started server process; `stop()` ends its whole process group."""
    process: subprocess.Popen
    command: list[str]
    log_path: Path
    health_url: str
    attempts: list[dict[str, Any]] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return self.health_url.rsplit("/", 1)[0]

    def stop(self, grace_s: float = STOP_GRACE_S) -> int:
        """SIGTERM the process group, SIGKILL it after `grace_s`; returns the exit code."""
        return stop_process(self.process, grace_s)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def available_port(host: str, preferred: int) -> int:
    """`preferred` when it can be bound on `host`, else (or for 0) a free port the OS picks. Two pipelines on one
    machine share a config's serve ports; a second server on a taken port would fail to start, or worse,
    its health check would be answered by the first pipeline's server. (A port taken between this check and
    the server's own bind still fails that start, loudly.)"""
    for port in (preferred, 0):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            # as servers do: a port whose last connections linger in TIME_WAIT is free, a listening one is not
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                continue
            chosen = sock.getsockname()[1]
        if preferred and chosen != preferred:     # 0: any free port was asked for
            logging.getLogger(__name__).warning("port %d on %s is taken; serving on %d", preferred, host, chosen)
        return chosen
    raise OSError(f"no free port on {host}: cannot bind {preferred} nor an OS-chosen one")


def health_status(url: str, timeout_s: float = HEALTH_REQUEST_TIMEOUT_S) -> int | None:
    """HTTP status of one GET, None when nothing answers."""
    return http_status(url, timeout_s)


def launch(cmd: Sequence[str], *, log_path: str | Path, health_url: str, timeout_s: float,
           env: Mapping[str, str] | None = None) -> Server:
    """Start `cmd` and poll `health_url` until it answers 200; on the deadline kill the process group.

    stdout and stderr go to `log_path` (appended); `env` adds variables to this process's environment.
    """
    log_path = Path(log_path)
    process = spawn(cmd, log_path=log_path, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + timeout_s

    def healthy() -> bool:
        return health_status(health_url, min(HEALTH_REQUEST_TIMEOUT_S, max(0.1, deadline - time.monotonic()))) == 200

    outcome = wait_until(healthy, timeout_s=timeout_s, alive=lambda: process.poll() is None,
                         interval_s=HEALTH_POLL_INTERVAL_S)
    if outcome == "ready":
        return Server(process, list(cmd), log_path, health_url)
    if outcome == "exited":
        raise ServerStartError(f"server exited with code {process.returncode} before {health_url} "
                               f"answered; see {log_path}", [])
    stop_process(process, grace_s=5.0)
    raise ServerStartError(f"{health_url} not healthy after {timeout_s:.0f} s (a CUDA graph capture hang "
                           f"looks like this, F6); process group killed; see {log_path}", [])


def launch_with_fallback(command_for: Callable[[bool], list[str]], *, log_dir: str | Path, health_url: str,
                         timeout_s: float, env: Mapping[str, str] | None = None) -> Server:
    """Start with CUDA graphs, and once more without them if that fails (F6); every attempt is recorded.

    `command_for(disable_cuda_graph)` builds the argv. Raises ServerStartError (with `.attempts`)
    when both attempts fail.
    """
    attempts: list[dict[str, Any]] = []
    for disable in (False, True):
        cmd = command_for(disable)
        log_path = Path(log_dir) / f"server-attempt{len(attempts) + 1}.log"
        started = time.monotonic()
        try:
            server = launch(cmd, log_path=log_path, health_url=health_url, timeout_s=timeout_s, env=env)
        except ServerStartError as err:
            attempts.append(attempt_record(cmd, disable, f"failed: {err}", started, log_path))
            continue
        attempts.append(attempt_record(cmd, disable, "healthy", started, log_path))
        server.attempts = attempts
        return server
    raise ServerStartError("the server never became healthy, with or without CUDA graphs:\n  "
                           + "\n  ".join(a["outcome"] for a in attempts), attempts)


def attempt_record(cmd: Sequence[str], disable_cuda_graph: bool, outcome: str, started: float,
                   log_path: Path) -> dict[str, Any]:
    return {"command": shlex.join(cmd), "cuda_graph": not disable_cuda_graph, "outcome": outcome,
            "seconds": round(time.monotonic() - started, 2), "log": str(log_path)}
