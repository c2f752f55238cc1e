"""The local stack: a Prefect server and a process worker on 127.0.0.1, every local deployment registered,
so that `prefect deployment run 'eagle3-pipeline/tiny' --watch` works. `Stack` is the Python API (tests
use it); `eaglenest stack up|down|status|register` is its CLI (`flows/stack_cli.py`); what it creates on
the server is `flows/prefect_setup.py`; the processes are started and stopped by `steps/lib/runtime/processes.py`.

Reads `deploy/prefect.yaml` (deployments, `prefect --no-prompt deploy`) and `deploy/pools/<pool>.json`
(base job templates; `up` creates the `local` pool, and the docker / k8s pools only when asked for with
`--pools`; only `local` gets a worker here). Writes under `--dir`:

    prefect/                 PREFECT_HOME of the server and the worker: SQLite database, UI build
    results/                 Prefect's persisted results (LocalFileSystem block) for a file:// store
    server.pid, server.log   `prefect server start`, its own process group
    worker.pid, worker.log   `prefect worker start --pool local`, its own process group
    deploy.log               output of the last `prefect deploy`
    stack.json               api/UI address, store, result storage: what `status` and `down` read

Result storage: flows persist their results (the step records the parent reads back, the cache
that makes a retried run skip finished steps) to the block `eaglenest-results`: a LocalFileSystem
under `<dir>/results` for a `file://` store, a prefect-aws S3Bucket at `<prefix>/prefect-results`
in the store's bucket for `s3://` (endpoint from EAGLENEST_S3_ENDPOINT_URL / AWS_ENDPOINT_URL; no
keys are saved in the block: boto3 finds them in the environment of whoever reads or writes).

Start-up is slow on a small shared machine (a fresh server: ~45 s idle, minutes under load), so every
wait polls a condition against a generous deadline; nothing sleeps a fixed time and hopes.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flows.prefect_setup import (
    DEPLOYMENT_SETS,
    RESULTS_BLOCK,
    SetupError,
    create_pools,
    deploy,
    deployment_names,
    pool_workers,
    pools_for,
    save_result_storage,
)
from steps.lib.home import under_home
from steps.lib.runtime.processes import spawn as spawn_process
from steps.lib.runtime.processes import stop_group, wait_until

#: what `up` registers: every deployment on the local pool (`flows/prefect_setup.py` DEPLOYMENT_SETS).
LOCAL_DEPLOYMENTS = DEPLOYMENT_SETS["local"]
WORKER_POOL = "local"
#: a fresh server (SQLite created, migrations run) took 47 s on an idle 2-core machine; under load, minutes.
START_TIMEOUT_S = 600.0
#: the worker asks for new runs this often (Prefect's default 10 s was most of each step's start-up).
WORKER_QUERY_SECONDS = 1
STOP_TIMEOUT_S = 30.0
#: server settings that let `--watch` (and the UI's live view) follow a run's logs, not only its events.
LOG_STREAM_ENV = {"PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED": "true",
                  "PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED": "true"}
#: a run's tags as they are now in its state-change events: the rollback trigger matches `moved-production`,
#: which a run gets when it promotes (flows/promotion.py), and the server's default 5-minute cache of a run's
#: related resources would hand the trigger its tags from before
EVENTS_ENV = {"PREFECT_SERVER_EVENTS_RELATED_RESOURCE_CACHE_TTL": "PT0S"}


class StackError(RuntimeError):
    """The stack could not be started, reached or stopped; the message says which part and why."""


# --- processes we started (pid files, so `down` in another shell finds them) ---------------------------

def pid_alive(pid: int) -> bool:
    """True if `pid` runs and is a Prefect process (a recycled pid of something else is not ours)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"prefect" in cmdline


def running(pid: int) -> bool:
    """Whether `pid` still runs. Our own child is asked directly (it may not have exec'd `prefect` yet;
    an exited one is reaped, since a zombie keeps its /proc entry); any other pid must be a Prefect process."""
    try:
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:    # not our child: started by an earlier `eaglenest stack up`
        return pid_alive(pid)


def read_pid(path: Path) -> int | None:
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if running(pid) else None


def spawn(argv: list[str], *, env: dict[str, str], log: Path, pid_file: Path) -> Callable[[], bool]:
    """Start `argv` in the background in its own process group, its pid in `pid_file`; an is-it-running
    check on the process handle (see `running` for why not /proc)."""
    proc = spawn_process(argv, log_path=log, env=env, cwd=Path(__file__).resolve().parents[1])
    pid_file.write_text(f"{proc.pid}\n")
    return lambda: proc.poll() is None


def stop(pid_file: Path, timeout_s: float = STOP_TIMEOUT_S) -> bool:
    """SIGTERM the process group we started, SIGKILL it after `timeout_s`; False if nothing ran."""
    pid = read_pid(pid_file)
    pid_file.unlink(missing_ok=True)
    if pid is None:
        return False
    stop_group(pid, grace_s=timeout_s, running=lambda: running(pid))
    return True


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def prefect_argv(*args: str) -> list[str]:
    """The `prefect` CLI of this interpreter's environment."""
    return [sys.executable, "-m", "prefect", *args]


# --- HTTP -------------------------------------------------------------------------------------------------

def api_healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=5) as resp:
            return resp.status == 200 and json.loads(resp.read() or b"false") is True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_for(condition: Callable[[], bool], *, what: str, timeout_s: float,
             alive: Callable[[], bool] = lambda: True, log: Path | None = None) -> None:
    """Poll `condition()` until true; fail at the deadline or as soon as `alive()` says the process died."""
    outcome = wait_until(condition, timeout_s=timeout_s, alive=alive, interval_s=0.5, max_interval_s=5.0)
    if outcome == "exited":
        raise StackError(f"{what}: the process exited; last lines of {log}:\n{log_tail(log) if log else ''}")
    if outcome == "timeout":
        raise StackError(f"{what}: not ready after {timeout_s:.0f} s; last lines of {log}:\n"
                         f"{log_tail(log) if log else ''}")


# --- the stack --------------------------------------------------------------------------------------------

@dataclass
class Stack:
    """A local Prefect server + process worker with eaglenest's deployments (`up()`, `down()`, `status()`).

    `store_uri`: the store URI flows run against when a run does not pass one (EAGLENEST_STORE in the
    worker's environment; also decides file vs S3 result storage). `scheduler=False` keeps the
    sensor's interval schedule from starting runs (tests start what they need themselves).
    """

    dir: Path = field(default_factory=lambda: under_home("out/stack"))
    port: int = 4200
    store_uri: str | None = None
    ui: bool = True
    scheduler: bool = True
    worker_limit: int = 4
    deployments: tuple[str, ...] = LOCAL_DEPLOYMENTS
    #: infrastructure whose pools to create besides `local` ("docker", "k8s"): only when asked for
    infrastructure: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.dir = Path(self.dir).resolve()
        self.store_uri = self.store_uri or os.environ.get("EAGLENEST_STORE") or None

    # where things are
    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def ui_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def home(self) -> Path:
        return self.dir / "prefect"

    @property
    def results_dir(self) -> Path:
        return self.dir / "results"

    def _file(self, name: str) -> Path:
        return self.dir / name

    @property
    def result_storage(self) -> str:
        """The block slug flows persist results to."""
        kind = "s3-bucket" if (self.store_uri or "").startswith("s3://") else "local-file-system"
        return f"{kind}/{RESULTS_BLOCK}"

    @property
    def env(self) -> dict[str, str]:
        """Environment for `prefect ...` CLI calls (and anything else) against this stack."""
        env = {**os.environ, **self.extra_env,
               "PREFECT_API_URL": self.api_url, "PREFECT_HOME": str(self.home),
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
        if self.store_uri:
            env["EAGLENEST_STORE"] = self.store_uri
        return env

    def server_env(self) -> dict[str, str]:
        # `prefect deployment run ... --watch` shows a run's logs only when the server streams them out
        # (off by default in Prefect 3.9); the pipeline's result lines are logs
        env = {**self.env, **LOG_STREAM_ENV, **EVENTS_ENV}
        if not self.scheduler:
            env["PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED"] = "false"
        return env

    def worker_env(self) -> dict[str, str]:
        """What every flow run of the worker inherits: API, result storage, store, quick pick-up."""
        return {**self.env,
                "PREFECT_WORKER_QUERY_SECONDS": str(WORKER_QUERY_SECONDS),
                "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
                "PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK": self.result_storage}

    # up / down / status
    def up(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start what is not running, create pools and result storage, register deployments; idempotent."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.home.mkdir(parents=True, exist_ok=True)
        self._start_server(timeout_s)
        self._write_state()
        with self._api():
            create_pools(pools_for(("local", *self.infrastructure)))
            save_result_storage(self.store_uri, self.results_dir)
        try:
            deploy(self.deployments, env=self.env, log=self._file("deploy.log"))
        except SetupError as err:
            raise StackError(str(err)) from None
        self._start_worker(timeout_s)

    def down(self) -> dict[str, bool]:
        """Stop the worker, then the server (a worker whose server is gone ignores SIGTERM for a while)."""
        worker = stop(self._file("worker.pid"))
        server = stop(self._file("server.pid"))
        return {"worker": worker, "server": server}

    def status(self) -> dict[str, Any]:
        healthy = api_healthy(self.api_url)
        report: dict[str, Any] = {
            "api_url": self.api_url, "ui_url": self.ui_url, "healthy": healthy,
            "server_pid": read_pid(self._file("server.pid")), "worker_pid": read_pid(self._file("worker.pid")),
            "store": self.store_uri, "result_storage": self.result_storage, "workers": [], "deployments": []}
        if healthy:
            with self._api():
                report["workers"] = pool_workers(WORKER_POOL)
                report["deployments"] = deployment_names()
        return report

    # the parts
    def _api(self):
        from prefect.settings import PREFECT_API_URL, temporary_settings

        return temporary_settings(updates={PREFECT_API_URL: self.api_url})

    def _start_server(self, timeout_s: float) -> None:
        pid_file, log = self._file("server.pid"), self._file("server.log")
        pid = read_pid(pid_file)
        if pid is None and port_in_use(self.port):
            raise StackError(f"port {self.port} is in use by a process this stack did not start (no live pid in "
                             f"{pid_file}); pick another --port or stop that process")
        if pid is None:
            argv = prefect_argv("server", "start", "--host", "127.0.0.1", "--port", str(self.port))
            alive = spawn(argv + ([] if self.ui else ["--no-ui"]), env=self.server_env(), log=log, pid_file=pid_file)
        else:
            alive = lambda: running(pid)  # noqa: E731
        wait_for(lambda: api_healthy(self.api_url), what=f"Prefect server at {self.api_url}/health",
                 timeout_s=timeout_s, alive=alive, log=log)

    def _start_worker(self, timeout_s: float) -> None:
        pid_file, log = self._file("worker.pid"), self._file("worker.log")
        pid = read_pid(pid_file)
        if pid is None:
            argv = prefect_argv("worker", "start", "--pool", WORKER_POOL, "--type", "process",
                                "--limit", str(self.worker_limit), "--name", f"eaglenest-{self.port}")
            alive = spawn(argv, env=self.worker_env(), log=log, pid_file=pid_file)
        else:
            alive = lambda: running(pid)  # noqa: E731

        def online() -> bool:
            with self._api():
                return any(w["status"] == "ONLINE" for w in pool_workers(WORKER_POOL))

        wait_for(online, what=f"worker on pool {WORKER_POOL!r}", timeout_s=timeout_s, alive=alive, log=log)

    def _write_state(self) -> None:
        state = {"api_url": self.api_url, "ui_url": self.ui_url, "port": self.port, "store": self.store_uri,
                 "result_storage": self.result_storage}
        self._file("stack.json").write_text(json.dumps(state, indent=2) + "\n")
