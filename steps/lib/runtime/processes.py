"""Background processes we start: each in its own process group, stopped as a group, waited on with a deadline.

One implementation for everything eaglenest spawns and must clean up after: the SGLang / reference
servers of serve and benchmark (`steps/lib/serving/launch.py`) and the Prefect server and worker of the local
stack (`flows/stack.py`).

- `spawn` starts argv in a new session (the group id is the leader's pid), output appended to a log;
- `stop_group` SIGTERMs the group, waits up to a grace period, then SIGKILLs whatever is left of the
  group (SGLang's scheduler/detokenizer children outlive their leader);
- `wait_until` polls a readiness condition (usually `http_status(url) == 200`) against a deadline and
  stops early when the process died;
- `forwarding_signals` stops the group when *we* get SIGTERM/SIGHUP (`docker stop`, a cancelled Prefect
  run): a child in its own session does not receive the signal its parent got, and would outlive us.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

#: what `wait_until` saw: the condition held, the process exited first, or the deadline passed.
Outcome = Literal["ready", "exited", "timeout"]


def spawn(argv: Sequence[str], *, log_path: str | Path, env: Mapping[str, str] | None = None,
          cwd: str | Path | None = None) -> subprocess.Popen:
    """Start `argv` in its own session, stdout + stderr appended to `log_path`, stdin closed.

    `env` is the complete environment (None: this process's)."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        return subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=dict(env) if env is not None else None, cwd=cwd, start_new_session=True)


def signal_group(pid: int, sig: signal.Signals) -> None:
    """Send `sig` to the process group led by `pid` (spawn() made it a session leader); gone is fine."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def stop_group(pid: int, *, grace_s: float, running: Callable[[], bool]) -> None:
    """SIGTERM the group, wait up to `grace_s` while `running()`, then SIGKILL the group even if the
    leader exited (its children may linger)."""
    if running():
        signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while running() and time.monotonic() < deadline:
            time.sleep(0.1)
    signal_group(pid, signal.SIGKILL)


def stop_process(process: subprocess.Popen, grace_s: float) -> int:
    """`stop_group` for a process we hold a handle on; its exit code."""
    stop_group(process.pid, grace_s=grace_s, running=lambda: process.poll() is None)
    return process.wait()


def wait_until(ready: Callable[[], bool], *, timeout_s: float, alive: Callable[[], bool] = lambda: True,
               interval_s: float = 0.5, max_interval_s: float | None = None) -> Outcome:
    """Poll `ready()` until true, the deadline, or `alive()` turning false. The interval grows by 1.5×
    up to `max_interval_s` (default: it stays `interval_s`).

    `alive()` is asked first and again after `ready()`: a server that could not bind its port exits at
    once while another process on that port (another pipeline's server) answers its health URL; that is
    "exited", never "ready"."""
    deadline = time.monotonic() + timeout_s
    delay = interval_s
    while True:
        if not alive():
            return "exited"
        if ready():
            return "ready" if alive() else "exited"
        if time.monotonic() >= deadline:
            return "timeout"
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 1.5, max_interval_s or interval_s)


def http_status(url: str, timeout_s: float) -> int | None:
    """HTTP status of one GET, None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code
    except (urllib.error.URLError, OSError):
        return None


@contextmanager
def forwarding_signals(stop: Callable[[], object],
                       signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """While the block runs, a SIGTERM/SIGHUP to this process first calls `stop()` (stop the group we
    spawned), then acts as it would have (the previous handler, or the default: exit by that signal).

    Signal handlers can only be set from the main thread; elsewhere (a thread pool) this does nothing
    and the caller's own `finally` is the only cleanup."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # getsignal() says None for a handler set outside Python: treat it as the default
    previous = {sig: signal.getsignal(sig) or signal.SIG_DFL for sig in signals}

    def handler(signum: int, frame: object) -> None:
        stop()
        before = previous[signal.Signals(signum)]
        signal.signal(signum, before)
        if callable(before):
            before(signum, frame)
        elif before != signal.SIG_IGN:
            os.kill(os.getpid(), signum)    # the default action, now that our handler is gone

    for sig in signals:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)
