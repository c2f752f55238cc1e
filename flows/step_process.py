"""A step as its own process: `python -m steps.<step> ... --json`, started from a flow.

The local pool runs each step flow as a subflow of the pipeline (one Python process for the orchestration,
no worker pick-up, no fresh Prefect per step), and the step itself here, in a child process: the
orchestrator never imports torch, a step's memory (a target, a draft, CUDA) is returned when it ends, and
the step runs exactly as a container or a shell runs it (the same CLI, `steps/registry.py`).

Starting Python and importing torch costs seconds per step, so the process is started ahead: while a
step runs, the next one (`python -m steps.warm_start`) already imports what steps need, and the step after
it gets its command line on stdin — the same `step_main` as `python -m steps.<step>`. Whatever spare is
left when this process exits is ended with it.

What crosses the boundary: the arguments as CLI flags (`--config`, `--store`, `--set`, one `--<input> ID`
each, `--<option> V`); the step's log lines (stderr) to `log`, its progress as `steps.lib.runtime.progress` lines to
`on_progress`; its record (`--json`, the last line of stdout) back. A step that ends without a record
raises StepProcessFailed with the end of its stderr (the traceback, or the one-line usage error).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from steps.lib.runtime import progress
from steps.lib.runtime.processes import forwarding_signals, track, untrack
from steps.registry import STEPS, check_call

#: the code the flow runs: first on the child's path, so `python -m steps.<step>` is the same code (the child
#: keeps our working directory, so relative store and config paths mean the same there)
REPO_ROOT = Path(__file__).resolve().parents[1]
#: the registry's chain ends with it: no spare is started for a step after it
LAST_STEP = list(STEPS)[-1]
#: stderr lines kept for the error message of a step that fails
TAIL_LINES = 40


class StepProcessFailed(RuntimeError):
    """`python -m steps.<step>` ended without a record (a crash, a usage error, a signal)."""


def step_argv(step: str, config: str, overrides: list[str] | None, store_uri: str | None,
              inputs: Mapping[str, str], options: Mapping[str, Any] | None) -> list[str]:
    """The command line that runs `step` as `steps.<step>.run(cfg, store, *inputs, **options)` would."""
    spec = STEPS[step]
    cli_options = {o.name for o in spec.options if o.cli}
    argv = [sys.executable, "-m", spec.module, "--config", config, "--json"]
    if store_uri:
        argv += ["--store", store_uri]
    for override in overrides or []:
        argv += ["--set", override]
    for name in spec.inputs:
        argv += [f"--{name}", inputs[name]]
    for name, value in (options or {}).items():
        if value is None or name not in cli_options:
            continue
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def step_env() -> dict[str, str]:
    """A step process's environment: ours, this code first on the path, progress as lines."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, progress.LINES_ENV: "1", "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def extra_env(options: Mapping[str, Any] | None) -> dict[str, str]:
    """Serve's `env` option (no CLI flag): set in the step's environment, which the server inherits."""
    return {k: str(v) for k, v in ((options or {}).get("env") or {}).items()}


_spare_lock = threading.Lock()
_spare: subprocess.Popen | None = None


def _warm_process() -> subprocess.Popen:
    # tracked: a SIGTERM of the orchestrator stops it (and so its servers) from whichever thread started it
    return track(subprocess.Popen([sys.executable, "-m", "steps.warm_start"], env=step_env(), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace"),
                 group=False)


def warm_up() -> None:
    """Start the spare for the first step now (the orchestrator's own start-up hides its imports)."""
    global _spare
    with _spare_lock:
        if _spare is None or _spare.poll() is not None:
            _spare = _warm_process()


def start_step_process(step: str, argv: list[str], options: Mapping[str, Any] | None) -> subprocess.Popen:
    """A process running `argv` (`python -m steps.<step> ...`): the spare started during the previous step,
    given the command line; and a new spare for the next step."""
    global _spare
    with _spare_lock:
        proc = _spare if _spare is not None and _spare.poll() is None else _warm_process()
        _spare = _warm_process() if step != LAST_STEP else None
    assert proc.stdin is not None and argv[1:3] == ["-m", STEPS[step].module]
    proc.stdin.write(json.dumps({"step": step, "argv": argv[3:], "env": extra_env(options)}) + "\n")
    proc.stdin.close()
    return proc


@atexit.register
def discard_spare() -> None:
    """End the spare no step will use (it exits on its own at end of input too)."""
    global _spare
    with _spare_lock:
        spare, _spare = _spare, None
    if spare is not None and spare.poll() is None:
        spare.terminate()
        spare.wait()


def run_step_process(step: str, config: str, overrides: list[str] | None, store_uri: str | None,
                     inputs: Mapping[str, str], options: Mapping[str, Any] | None = None, *,
                     log: Callable[[str], None], on_progress: Callable[[progress.Update], None]) -> dict[str, Any]:
    """Run the step in a child process; its record. Raises StepProcessFailed when it gives none."""
    check_call(step, inputs, options)
    argv = step_argv(step, config, overrides, store_uri, inputs, options)
    proc = start_step_process(step, argv, options)
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    # stdout is read on a thread so neither pipe can fill up while the other is read
    stdout: list[str] = []
    reader = threading.Thread(target=lambda: stdout.extend(proc.stdout or []), daemon=True)
    reader.start()
    # a cancelled or crashed flow run must not leave the step (and a server it started) running
    with forwarding_signals(lambda: proc.terminate(), signals_to_forward()):
        try:
            for raw in proc.stderr or []:
                _forward(raw.rstrip("\n"), tail, log, on_progress)
            code = proc.wait()
        except BaseException:   # Prefect's TerminationSignal (a cancel), KeyboardInterrupt: the step ends with us
            proc.terminate()
            proc.wait()
            raise
        finally:
            untrack(proc)
    reader.join()
    record = _record(stdout)
    if record is None:
        raise StepProcessFailed(f"`python -m steps.{step}` exited {code} without a record; its last lines:\n"
                                + "\n".join(tail))
    return record


def signals_to_forward() -> tuple[signal.Signals, ...]:
    """SIGHUP always; SIGTERM only where nothing handles it. Under a flow run Prefect's own SIGTERM handler
    raises TerminationSignal here (the `except` above stops the step), and Prefect acknowledges a cancel only
    while that handler is installed: replacing it made every cancelled run, and its running step, `Crashed`."""
    handled = callable(signal.getsignal(signal.SIGTERM))
    return (signal.SIGHUP,) if handled else (signal.SIGTERM, signal.SIGHUP)


def _forward(line: str, tail: deque[str], log: Callable[[str], None],
             on_progress: Callable[[progress.Update], None]) -> None:
    update = progress.parse_line(line)
    if update is not None:
        on_progress(update)
    elif line.strip():
        tail.append(line)
        log(line)


def _record(stdout: list[str]) -> dict[str, Any] | None:
    """The `--json` record: the last stdout line that is a JSON object with a kind and an id."""
    for line in reversed(stdout):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict) and {"kind", "id"} <= set(value):
            return value
    return None
