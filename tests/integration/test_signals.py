"""Signals stop the whole tree: SIGTERM or SIGINT of a step, of an orchestrator running a step from a worker
thread, or of `eaglenest stack up` leaves no process it started running and no port held (issue 27).

Each case runs the real command as a process with a marker in its environment (every descendant inherits it,
whatever session it put itself in), signals only that one process (as `kill PID` does: children in their own
sessions get nothing) at a seeded random point defined by events (how many marked processes exist, or a
server answering), then waits for events only: the process's exit, the marked processes' disappearance,
with generous deadlines a loaded 2-core machine cannot reach.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.builders import bigram_world, free_port
from tests.conftest import REPO, process_alive

MARK = "EAGLENEST_SIGNAL_TEST"
EXIT_DEADLINE_S = 180.0      # the signalled process stops its children (10 s grace each, in parallel) and exits
GONE_DEADLINE_S = 60.0       # what is left of the tree after it exited (none: this is what is asserted)


def marked(tag: str) -> dict[int, str]:
    """Live processes (zombies excluded) whose environment holds our marker: pid -> command line."""
    found = {}
    needle = f"{MARK}={tag}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0") and process_alive(int(entry.name)):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except OSError:
            continue
    return found


def wait_for(condition: Callable[[], bool], timeout_s: float, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval_s)
    return condition()


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def signal_at_random_point(argv: list[str], *, seed: int, ports: list[int], env: dict[str, str] | None = None,
                           most_marked: int) -> None:
    """Start argv, wait for a seeded number (0..most_marked) of its descendants to exist, wait a seeded
    0–2 s more, send SIGTERM or SIGINT (seeded) to it alone; then assert nothing marked lives and no
    port in `ports` listens."""
    rng = random.Random(seed)
    tag = uuid.uuid4().hex
    sig = rng.choice([signal.SIGTERM, signal.SIGINT])
    descendants, extra_s = rng.randint(0, most_marked), rng.uniform(0.0, 2.0)
    proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, **(env or {}), MARK: tag, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    seen: dict[int, str] = {}
    try:
        def enough() -> bool:
            seen.update(marked(tag))
            return proc.poll() is not None or len(set(seen) - {proc.pid}) >= descendants
        wait_for(enough, EXIT_DEADLINE_S, interval_s=0.05)
        time.sleep(extra_s)
        seen.update(marked(tag))
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=EXIT_DEADLINE_S)
        gone = wait_for(lambda: not marked(tag), GONE_DEADLINE_S, interval_s=0.5)
        left = marked(tag)
        held = [p for p in ports if listening(p)]
        assert gone and not left and not held, (
            f"{sig.name} after {descendants} descendants + {extra_s:.1f} s (seen {seen}) left {left} running, "
            f"ports {held} held; its output:\n{out.decode(errors='replace')[-3000:]}")
    finally:
        for pid in [proc.pid, *marked(tag)]:      # never leave our own debris behind, whatever failed
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """A bigram target and its exported copying draft (the benchmark's world), its config as a file."""
    from tests.unit.test_benchmark import free_ports

    root = tmp_path_factory.mktemp("signals")
    w = bigram_world(root, free_ports(), benchmark={"max_new_tokens": 64})
    config = root / "c.yaml"
    config.write_text(w["cfg"].model_dump_json())
    return {**w, "config": config, "ports": [w["cfg"].serve.port, w["cfg"].serve.port + 1]}


ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_step_signalled_leaves_no_server(world, seed):
    """`eaglenest benchmark` starts both servers from a thread pool, where no handler can be set."""
    argv = [sys.executable, "-m", "steps.benchmark", "--config", str(world["config"]), "--store",
            world["store"].uri, "--export", world["export_id"], "--target", world["target_id"]]
    signal_at_random_point(argv, seed=seed, ports=world["ports"], env=ENV, most_marked=2)


ORCHESTRATOR = textwrap.dedent("""
    import sys
    from concurrent.futures import ThreadPoolExecutor
    from flows.step_process import run_step_process
    from steps.lib.runtime.processes import install_reaper

    install_reaper()
    config, store, export_id, target_id = sys.argv[1:]
    with ThreadPoolExecutor(1) as pool:   # as Prefect runs a task: the step process started off the main thread
        pool.submit(run_step_process, "benchmark", config, None, store, {"export": export_id, "target": target_id},
                    log=print, on_progress=lambda update: None).result()
""")


@pytest.mark.parametrize("seed", [3, 4])
def test_an_orchestrator_signalled_leaves_no_step_nor_server(world, seed):
    """The pipeline's way of running a step: a step process (and its spare) from a worker thread."""
    argv = [sys.executable, "-c", ORCHESTRATOR, str(world["config"]), world["store"].uri, world["export_id"],
            world["target_id"]]
    signal_at_random_point(argv, seed=seed, ports=world["ports"], env=ENV, most_marked=4)


def test_stack_up_signalled_leaves_no_prefect_server_nor_worker(tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "flows.cli", "stack", "up", "--dir", str(tmp_path / "stack"), "--port", str(port),
            "--store", f"file://{tmp_path / 'store'}", "--no-ui", "--no-schedules", "--no-profile"]
    signal_at_random_point(argv, seed=5, ports=[port], most_marked=2)
