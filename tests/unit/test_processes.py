"""steps/lib/runtime/processes.py: the one spawn/stop/wait helper of serve, benchmark and the local Prefect stack. Real
processes: a group is stopped with its children, a SIGTERM to the parent reaches the group it spawned."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from steps.lib.runtime import processes

#: a leader that starts a grandchild (its pid to argv[1]) and ignores SIGTERM, as a stuck server would
STUBBORN = textwrap.dedent("""
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[1], "w").write(str(child.pid))
    time.sleep(600)
""")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


def wait_for_file(path: Path, timeout_s: float = 60.0) -> str:
    outcome = processes.wait_until(lambda: path.exists() and path.read_text() != "", timeout_s=timeout_s,
                                   interval_s=0.05)
    assert outcome == "ready", f"{path} never written"
    return path.read_text()


def test_stop_process_kills_a_leader_that_ignores_sigterm_and_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    proc = processes.spawn([sys.executable, "-c", STUBBORN, str(pid_file)], log_path=tmp_path / "logs" / "x.log")
    child = int(wait_for_file(pid_file))
    assert os.getpgid(proc.pid) == proc.pid, "spawn must make the process its own group leader"
    started = time.monotonic()
    code = processes.stop_process(proc, grace_s=0.5)
    assert code == -9, "the leader ignored SIGTERM, so only SIGKILL ends it"
    assert time.monotonic() - started < 30
    processes.wait_until(lambda: not alive(child), timeout_s=10, interval_s=0.05)
    assert not alive(child), "the grandchild in the same group must be killed too"


def test_wait_until_says_ready_exited_or_timeout(tmp_path):
    proc = processes.spawn([sys.executable, "-c", "raise SystemExit(3)"], log_path=tmp_path / "exit.log")
    assert processes.wait_until(lambda: False, timeout_s=60, alive=lambda: proc.poll() is None,
                                interval_s=0.05) == "exited"
    assert proc.returncode == 3
    assert processes.wait_until(lambda: False, timeout_s=0.3, interval_s=0.05) == "timeout"
    calls = iter([False, False, True])
    assert processes.wait_until(lambda: next(calls), timeout_s=10, interval_s=0.01) == "ready"


def test_a_server_that_died_is_not_ready_even_if_its_port_answers(tmp_path):
    """A server that cannot bind its port exits while another pipeline's server answers the health URL:
    that must read as exited (the old order, health first, took the foreign server for ours)."""
    proc = processes.spawn([sys.executable, "-c", "raise SystemExit(1)"], log_path=tmp_path / "bind.log")
    proc.wait()
    assert processes.wait_until(lambda: True, timeout_s=5, alive=lambda: proc.poll() is None) == "exited"


def test_http_status_of_nothing_listening_is_none():
    assert processes.http_status("http://127.0.0.1:9/health", timeout_s=2) is None


def test_sigterm_to_the_parent_stops_the_group_it_spawned(tmp_path):
    """A cancelled run (the worker SIGTERMs the flow run's process) must not orphan its servers, which
    live in their own session and never see their parent's signal."""
    pid_file = tmp_path / "child.pid"
    parent = textwrap.dedent(f"""
        import sys, time
        from steps.lib.runtime import processes
        proc = processes.spawn([sys.executable, "-c", {STUBBORN!r}, {str(pid_file)!r}],
                               log_path={str(tmp_path / "server.log")!r})
        open({str(tmp_path / "server.pid")!r}, "w").write(str(proc.pid))
        with processes.forwarding_signals(lambda: processes.stop_process(proc, grace_s=0.5)):
            time.sleep(600)
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    outer = subprocess.Popen([sys.executable, "-c", parent], env=env)
    grandchild = int(wait_for_file(pid_file))
    server = int(wait_for_file(tmp_path / "server.pid"))
    outer.terminate()
    assert outer.wait(timeout=60) == -15, "after stopping the group the parent still ends by SIGTERM"
    processes.wait_until(lambda: not alive(server) and not alive(grandchild), timeout_s=10, interval_s=0.05)
    assert not alive(server) and not alive(grandchild), "SIGTERM to the parent must stop the spawned group"


def test_a_forked_child_forgets_the_parents_children_and_reaper(tmp_path):
    """A fork (multiprocessing, a DataLoader worker) must not stop its parent's servers on its own SIGTERM."""
    proc = processes.spawn([sys.executable, "-c", "import time; time.sleep(600)"], log_path=tmp_path / "log")
    try:
        assert proc.pid in processes.children()
        pid = os.fork()
        if pid == 0:    # the child: what its reaper does on a SIGTERM, then exit without the parent's atexit
            processes.stop_children()
            os._exit(0)
        os.waitpid(pid, 0)
        assert proc.poll() is None and proc.pid in processes.children()    # the parent's server still runs
    finally:
        processes.stop_process(proc, grace_s=1.0)
    assert proc.pid not in processes.children()
