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
- the reaper: every child `spawn` starts (from any thread: benchmark starts its servers from a thread
  pool, where no signal handler can be set) and every child `track`ed is remembered process-wide;
  `install_reaper`, called once from the main thread by each CLI, makes SIGTERM/SIGINT/SIGHUP stop them
  all, run the `atexit` handlers (Prefect's temporary server, the spare step process) and then die by
  the signal. A forked child forgets the parent's children and handlers (`os.register_at_fork`): it
  must not stop, on its own SIGTERM, servers that belong to its parent.
"""

from __future__ import annotations

import atexit
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
    # held from the fork to `track`: a reaper running in the main thread meanwhile waits until this child is
    # remembered, rather than die with it unknown (a server left running in its own session, port held)
    with _spawning, log_path.open("ab") as log:
        if _closing:
            raise ShuttingDown(f"{argv[0]}: not started, this process is being stopped")
        process = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=dict(env) if env is not None else None, cwd=cwd, start_new_session=True)
        return track(process, group=True)


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
    code = process.wait()
    untrack(process)
    return code


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


# --- the reaper ------------------------------------------------------------------------------------------

#: how long the reaper waits for SIGTERMed process groups (servers) before SIGKILLing them
REAP_GRACE_S = 10.0
#: how long it waits for a plain child (a step process, which reaps its own servers first)
REAP_CHILD_GRACE_S = 2 * REAP_GRACE_S + 5.0
REAPED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

# pid -> (process, is it the leader of its own group); read without a lock by the signal handler (a dict
# copy is atomic under the GIL), so the handler cannot deadlock on a lock the interrupted code holds
_children: dict[int, tuple[subprocess.Popen, bool]] = {}
_children_lock = threading.Lock()
# re-entrant: the reaper runs in the main thread, which may itself be inside `spawn` when the signal lands
_spawning = threading.RLock()
_closing = False
_installed: dict[signal.Signals, object] = {}


class ShuttingDown(RuntimeError):
    """A child was started after the reaper began stopping this process's children."""


def track(process: subprocess.Popen, *, group: bool) -> subprocess.Popen:
    """Remember `process` (`group`: it leads its own process group, stop the whole group) so the reaper stops
    it; returns it. Started while the reaper runs (another thread racing the signal): killed at once."""
    with _children_lock:
        for pid, (proc, _) in list(_children.items()):
            if proc.poll() is not None:
                del _children[pid]
        _children[process.pid] = (process, group)
    if _closing:
        _stop([(process, group)])
        raise ShuttingDown(f"pid {process.pid} started while this process is being stopped; killed it")
    return process


def untrack(process: subprocess.Popen) -> None:
    """Forget `process` (it was stopped or waited for)."""
    with _children_lock:
        _children.pop(process.pid, None)


def children() -> list[int]:
    """The pids of the children the reaper would stop now."""
    return [pid for pid, (proc, _) in list(_children.items()) if proc.poll() is None]


def _stop(entries: Sequence[tuple[subprocess.Popen, bool]]) -> None:
    """SIGTERM every entry at once, wait for them (groups `REAP_GRACE_S`, plain children longer: they stop
    their own children first), then SIGKILL what is left, groups whole."""
    for proc, group in entries:
        if proc.poll() is None:
            signal_group(proc.pid, signal.SIGTERM) if group else proc.send_signal(signal.SIGTERM)
    start = time.monotonic()
    for proc, group in entries:
        grace = REAP_GRACE_S if group else REAP_CHILD_GRACE_S
        try:
            proc.wait(timeout=max(0.0, start + grace - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        if group:
            signal_group(proc.pid, signal.SIGKILL)     # its leader may be gone and its children left
        elif proc.poll() is None:
            proc.kill()
        proc.wait()


def stop_children() -> None:
    """Stop every child started or tracked by this process, from any thread, and refuse new ones."""
    global _closing
    _closing = True
    with _spawning:     # a child another thread is starting now is remembered (or refused) before the snapshot
        entries = list(_children.values())
    _stop(entries)
    with _children_lock:
        _children.clear()


def _reap(signum: int, frame: object) -> None:
    stop_children()
    atexit._run_exitfuncs()     # Prefect's temporary server, the spare step process: what normal exit stops
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)    # die by the signal, as without the reaper


def install_reaper() -> None:
    """From the main thread of a CLI: SIGTERM/SIGINT/SIGHUP stop every child (see the module docstring).
    Elsewhere (a thread) it does nothing: the main thread's CLI installed it, or nothing can."""
    if threading.current_thread() is not threading.main_thread() or _installed:
        return
    for sig in REAPED_SIGNALS:
        if signal.getsignal(sig) == signal.SIG_IGN:
            continue    # a background job's SIGINT, `nohup`'s SIGHUP: the user asked us to ignore it
        _installed[sig] = signal.getsignal(sig)
        signal.signal(sig, _reap)


def _forget_in_child() -> None:
    """After fork: the parent's children are not ours to stop, nor its exit handlers ours to run on a signal."""
    global _children_lock, _spawning, _closing
    _children.clear()
    _children_lock = threading.Lock()
    _spawning = threading.RLock()
    _closing = False
    for sig, before in list(_installed.items()):
        try:
            signal.signal(sig, before if before is not None else signal.SIG_DFL)
        except (ValueError, OSError, TypeError):
            pass
    _installed.clear()


os.register_at_fork(after_in_child=_forget_in_child)
