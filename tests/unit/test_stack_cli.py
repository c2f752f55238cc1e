"""`eaglenest stack status|down` find the stack `up` started and tell the truth about it, without a server here:
the folder from --dir, else from the Prefect profile's API address (`up` records which folder serves it), else
$EAGLENEST_HOME/out/stack; `down` of a folder where no stack was started, or none runs, says so and exits 1.

`up` itself (a real `prefect server start` + worker, and `down` stopping them) runs in the session's
`prefect_stack` fixture (tests/conftest.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flows import stack_cli
from tests.builders import free_port


@pytest.fixture()
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLENEST_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    return tmp_path / "home"


def started_by_up(folder, port: int) -> str:
    """What `up --dir folder --port port` leaves behind: its state file and its line in the stacks index."""
    folder.mkdir(parents=True)
    api_url = f"http://127.0.0.1:{port}/api"
    (folder / "stack.json").write_text(json.dumps({"api_url": api_url, "port": port, "store": "file:///s"}))
    stack_cli.remember_stack(api_url, folder)
    return api_url


def a_prefect_process() -> subprocess.Popen:
    """A stand-in for the server or the worker: a process whose command line names prefect (what `down` checks
    before it signals a pid from a file), in a session of its own as `stack up` starts them."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "prefect"], start_new_session=True)


def test_status_without_dir_reads_the_stack_the_profile_points_at(home, tmp_path, monkeypatch, capsys):
    port = free_port()
    api_url = started_by_up(tmp_path / "D", port)
    monkeypatch.setenv("PREFECT_API_URL", api_url)     # what `up` put in the profile
    assert stack_cli.main(["status", "--json"]) == 1     # nothing listens: not healthy ...
    report = json.loads(capsys.readouterr().out)
    # ... but about the stack `up` started: its folder, its port, its store
    assert report["dir"] == str((tmp_path / "D").resolve()) and report["api_url"] == api_url
    assert report["store"] == "file:///s" and report["started"] is True


def test_down_without_dir_stops_the_processes_of_the_stack_the_profile_points_at(home, tmp_path, monkeypatch,
                                                                                 capsys):
    folder = tmp_path / "D"
    api_url = started_by_up(folder, free_port())
    server, worker = a_prefect_process(), a_prefect_process()
    (folder / "server.pid").write_text(f"{server.pid}\n")
    (folder / "worker.pid").write_text(f"{worker.pid}\n")
    monkeypatch.setenv("PREFECT_API_URL", api_url)
    try:
        assert stack_cli.main(["down"]) == 0
        assert capsys.readouterr().out.strip() == "worker stopped, server stopped"
        # stopped, not at the end of their 600 s sleep (`down` reaps them itself: their exit codes are its)
        server.wait(timeout=60), worker.wait(timeout=60)
    finally:
        for proc in (server, worker):
            proc.kill()
            proc.wait()
    assert api_url not in stack_cli.known_stacks()
    # the same again: nothing runs any more, and it says so
    assert stack_cli.main(["down", "--dir", str(folder)]) == 1
    assert "was not running: nothing stopped" in capsys.readouterr().err


def test_down_of_a_folder_where_no_stack_was_started_says_so_and_fails(home, tmp_path, capsys):
    assert stack_cli.main(["down", "--dir", str(tmp_path / "nothing")]) == 1
    err = capsys.readouterr().err
    assert "no stack was started under" in err and str(tmp_path / "nothing") in err and "--dir" in err


def test_without_dir_or_profile_the_stack_lives_under_the_home(home, capsys):
    assert stack_cli.main(["status", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["dir"] == str(home / "out" / "stack")
