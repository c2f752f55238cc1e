"""`eaglenest stack up|down|status`: a Prefect server and a process worker on 127.0.0.1, every local
deployment registered, so that `prefect deployment run 'eagle3-pipeline/tiny' --watch` works.

    eaglenest stack up [--dir out/stack] [--port 4200] [--store URI]    start (or re-check) and register
    eaglenest stack status [--dir out/stack] [--json]                    health, worker, deployments
    eaglenest stack down [--dir out/stack]                               worker first, then the server
    eaglenest stack register --store URI [--all]     pools + result storage + deployments on the server
                                                     PREFECT_API_URL names (compose, a cluster)

Reads `deploy/prefect.yaml` (deployments, `prefect --no-prompt deploy`) and `deploy/pools/<pool>.json`
(base job templates; `up` creates every pool, only `local` gets a worker here). Writes under `--dir`:

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

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

REPO_ROOT = Path(__file__).resolve().parents[1]
PREFECT_FILE = REPO_ROOT / "deploy" / "prefect.yaml"
POOLS_DIR = REPO_ROOT / "deploy" / "pools"

#: pool → (worker type, pool concurrency limit). A GPU pool runs one job at a time until you raise
#: the limit to its number of GPU hosts (`prefect work-pool set-concurrency-limit gpu-docker N`).
POOLS: dict[str, tuple[str, int | None]] = {
    "local": ("process", None),
    "cpu-docker": ("docker", None),
    "gpu-docker": ("docker", 1),
    "serve-docker": ("docker", 1),
    "cpu-k8s": ("kubernetes", None),
    "gpu-k8s": ("kubernetes", 1),
    "serve-k8s": ("kubernetes", 1),
}
#: what `up` registers (`name:` values in prefect.yaml): every `<flow>/local`, and the pipelines `tiny` and
#: `smollm2`, all on the local pool. Plain names, not `flow/name`: `prefect deploy -n flow/name` (3.9.1)
#: compares `flow` with the entrypoint's *function* name (`target_flow`), and a `*/local` pattern deploys
#: every `local` once per matching deployment (12 × 12 runs of the same registration).
LOCAL_DEPLOYMENTS = ("local", "tiny", "smollm2")
WORKER_POOL = "local"
RESULTS_BLOCK = "eaglenest-results"
#: a fresh server (SQLite created, migrations run) took 47 s on an idle 2-core machine; under load, minutes.
START_TIMEOUT_S = 600.0
#: the worker asks for new runs this often (Prefect's default 10 s is most of each step's start-up).
WORKER_QUERY_SECONDS = 2
DEPLOY_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 30.0
#: server settings that let `--watch` (and the UI's live view) follow a run's logs, not only its events.
LOG_STREAM_ENV = {"PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED": "true",
                  "PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED": "true"}


class StackError(RuntimeError):
    """The stack could not be started, reached or stopped; the message says which part and why."""


# --- processes we started ---------------------------------------------------------------------------------

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
    """Start `argv` in the background in its own session (so `stop` can end it and its children).

    Returns an is-it-running check on the process handle (see `running` for why not /proc).
    """
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    pid_file.write_text(f"{proc.pid}\n")
    return lambda: proc.poll() is None


def stop(pid_file: Path, timeout_s: float = STOP_TIMEOUT_S) -> bool:
    """SIGTERM the process group we started, SIGKILL it after `timeout_s`; False if nothing ran."""
    pid = read_pid(pid_file)
    pid_file.unlink(missing_ok=True)
    if pid is None:
        return False
    _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and running(pid):
        time.sleep(0.2)
    if running(pid):
        _signal_group(pid, signal.SIGKILL)
        running(pid)
    return True


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)     # the group is the pid itself: spawn() started a new session
    except ProcessLookupError:
        pass


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
    deadline = time.monotonic() + timeout_s
    delay = 0.5
    while not condition():
        if not alive():
            raise StackError(f"{what}: the process exited; last lines of {log}:\n{log_tail(log) if log else ''}")
        if time.monotonic() > deadline:
            raise StackError(f"{what}: not ready after {timeout_s:.0f} s; last lines of {log}:\n"
                             f"{log_tail(log) if log else ''}")
        time.sleep(delay)
        delay = min(delay * 1.5, 5.0)


# --- the stack --------------------------------------------------------------------------------------------

@dataclass
class Stack:
    """A local Prefect server + process worker with eaglenest's deployments (`up()`, `down()`, `status()`).

    `store_uri`: the store URI flows run against when a run does not pass one (EAGLENEST_STORE in the
    worker's environment; also decides file vs S3 result storage). `scheduler=False` keeps the
    sensor's interval schedule from starting runs (tests start what they need themselves).
    """

    dir: Path = Path("out/stack")
    port: int = 4200
    store_uri: str | None = None
    ui: bool = True
    scheduler: bool = True
    worker_limit: int = 4
    deployments: tuple[str, ...] = LOCAL_DEPLOYMENTS
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
        env = {**self.env, **LOG_STREAM_ENV}
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
            create_pools(POOLS_DIR)
            save_result_storage(self.store_uri, self.results_dir)
        self._deploy()
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

    def _deploy(self) -> None:
        argv = prefect_argv("--no-prompt", "deploy", "--prefect-file", str(PREFECT_FILE.relative_to(REPO_ROOT)))
        for name in self.deployments:
            argv += ["-n", name]
        log = self._file("deploy.log")
        with open(log, "wb") as out:
            done = subprocess.run(argv, env=self.env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=DEPLOY_TIMEOUT_S)
        if done.returncode != 0:
            raise StackError(f"`prefect deploy` of {PREFECT_FILE} exited {done.returncode}; last lines of "
                             f"{log}:\n{log_tail(log)}")

    def _write_state(self) -> None:
        state = {"api_url": self.api_url, "ui_url": self.ui_url, "port": self.port, "store": self.store_uri,
                 "result_storage": self.result_storage}
        self._file("stack.json").write_text(json.dumps(state, indent=2) + "\n")


# --- Prefect objects (called with the API pointed at the stack) -----------------------------------------

def create_pools(pools_dir: Path) -> list[str]:
    """Create or update every pool of POOLS from `<pools_dir>/<pool>.json`, with its concurrency limit."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    with get_client(sync_client=True) as client:
        for name, (pool_type, limit) in POOLS.items():
            template = json.loads((pools_dir / f"{name}.json").read_text())
            client.create_work_pool(WorkPoolCreate(name=name, type=pool_type, base_job_template=template,
                                                   concurrency_limit=limit), overwrite=True)
    return list(POOLS)


def save_result_storage(store: str | None, results_dir: Path, name: str = RESULTS_BLOCK) -> str:
    """Save the result-storage block for `store` (S3Bucket for s3://, else LocalFileSystem); its slug."""
    if store and store.startswith("s3://"):
        from prefect_aws import AwsCredentials, S3Bucket
        from prefect_aws.client_parameters import AwsClientParameters

        parsed = urlparse(store)
        endpoint = os.environ.get("EAGLENEST_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")
        credentials = AwsCredentials(region_name=os.environ.get("AWS_DEFAULT_REGION"),
                                     aws_client_parameters=AwsClientParameters(endpoint_url=endpoint))
        credentials.save(name, overwrite=True)
        folder = "/".join(p for p in (parsed.path.strip("/"), "prefect-results") if p)
        S3Bucket(bucket_name=parsed.netloc, bucket_folder=folder, credentials=credentials).save(name, overwrite=True)
        return f"s3-bucket/{name}"
    from prefect.filesystems import LocalFileSystem

    results_dir.mkdir(parents=True, exist_ok=True)
    LocalFileSystem(basepath=str(results_dir)).save(name, overwrite=True)
    return f"local-file-system/{name}"


def pool_workers(pool: str) -> list[dict[str, Any]]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        workers = client.read_workers_for_work_pool(pool)
    return [{"name": w.name, "status": str(getattr(w.status, "value", w.status)),
             "last_heartbeat": str(w.last_heartbeat_time)} for w in workers]


def deployment_names() -> list[str]:
    """Every registered deployment as `flow/deployment`, sorted."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        flows = {f.id: f.name for f in client.read_flows()}
        return sorted(f"{flows.get(d.flow_id, '?')}/{d.name}" for d in client.read_deployments())


def point_profile(api_url: str | None) -> None:
    """Make (or stop making) the current Prefect profile's CLI talk to this stack (`prefect config set`)."""
    from prefect.settings import update_current_profile

    update_current_profile({"PREFECT_API_URL": api_url})


def profile_api_url() -> str | None:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


# --- CLI --------------------------------------------------------------------------------------------------

def stack_from_args(args: argparse.Namespace) -> Stack:
    """A Stack for --dir; --port/--store default to what `up` recorded in stack.json."""
    state_file = Path(args.dir) / "stack.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else {}
    return Stack(dir=Path(args.dir), port=args.port or state.get("port") or 4200,
                 store_uri=getattr(args, "store", None) or state.get("store"),
                 ui=not getattr(args, "no_ui", False), scheduler=not getattr(args, "no_schedules", False))


def cmd_up(args: argparse.Namespace) -> int:
    stack = stack_from_args(args)
    print(f"starting the Prefect server and worker under {stack.dir} (a fresh start takes a minute or more)...")
    stack.up(timeout_s=args.timeout)
    if not args.no_profile:
        point_profile(stack.api_url)
    print(f"Prefect UI:   {stack.ui_url}\nPrefect API:  {stack.api_url}  (profile set"
          f"{'' if not args.no_profile else ' skipped: export PREFECT_API_URL=' + stack.api_url})")
    print(f"store:        {stack.store_uri or 'each config`s `store` (file://out/store for tiny)'}; "
          f"results: {stack.result_storage}")
    print("run:          prefect deployment run 'eagle3-pipeline/tiny' --watch")
    return 0


def cmd_register(args: argparse.Namespace) -> int:
    """Pools, result storage and deployments on a server someone else runs (PREFECT_API_URL)."""
    from prefect.settings import PREFECT_API_URL

    api_url = PREFECT_API_URL.value()
    if not api_url:
        raise StackError("no server to register with: set PREFECT_API_URL (e.g. http://127.0.0.1:4200/api)")
    store = args.store or os.environ.get("EAGLENEST_STORE")
    pools = create_pools(POOLS_DIR)
    slug = save_result_storage(store, Path(args.dir).resolve() / "results")
    names = ("--all",) if args.all else tuple(a for name in LOCAL_DEPLOYMENTS for a in ("-n", name))
    argv = prefect_argv("--no-prompt", "deploy", "--prefect-file", str(PREFECT_FILE.relative_to(REPO_ROOT)), *names)
    done = subprocess.run(argv, cwd=REPO_ROOT, timeout=DEPLOY_TIMEOUT_S)
    print(f"{api_url}: pools {', '.join(pools)}; result storage {slug}; deploy exited {done.returncode}")
    return done.returncode


def cmd_down(args: argparse.Namespace) -> int:
    stack = stack_from_args(args)
    stopped = stack.down()
    if profile_api_url() == stack.api_url:
        point_profile(None)     # the CLI goes back to its default rather than a dead address
    print(", ".join(f"{name} {'stopped' if ok else 'was not running'}" for name, ok in stopped.items()))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    report = stack_from_args(args).status()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if report["healthy"] else 1
    print(f"server   {'healthy' if report['healthy'] else 'DOWN'}  {report['api_url']}  "
          f"(pid {report['server_pid']})  UI {report['ui_url']}")
    online = [w["name"] for w in report["workers"] if w["status"] == "ONLINE"]
    print(f"worker   {'online: ' + ', '.join(online) if online else 'OFFLINE'}  (pid {report['worker_pid']})")
    print(f"store    {report['store'] or '(each config`s)'}  results {report['result_storage']}")
    print(f"deployments ({len(report['deployments'])}):")
    for name in report["deployments"]:
        print(f"  {name}")
    return 0 if report["healthy"] and online else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eaglenest stack", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("up", "start the server and worker, create pools, register deployments"),
                            ("down", "stop the worker, then the server"),
                            ("status", "health, worker and deployments")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--dir", default="out/stack", help="where the database, logs and pid files live")
        p.add_argument("--port", type=int, default=None, help="server port on 127.0.0.1 (default 4200, or as up)")
    register = sub.add_parser("register", help="pools, result storage and deployments on PREFECT_API_URL's server")
    register.add_argument("--dir", default="out/stack", help="results folder parent for a file:// store")
    register.add_argument("--store", default=None, help="store URI (s3:// → S3Bucket results; default EAGLENEST_STORE)")
    register.add_argument("--all", action="store_true", help="every deployment (docker, k8s too), not only local")
    up = sub.choices["up"]
    up.add_argument("--store", default=None, help="store URI for runs that pass none (default: EAGLENEST_STORE)")
    up.add_argument("--timeout", type=float, default=START_TIMEOUT_S, help="seconds to wait for server and worker")
    up.add_argument("--no-ui", action="store_true", help="API only (starts faster)")
    up.add_argument("--no-schedules", action="store_true", help="do not run the dataset sensor's schedule")
    up.add_argument("--no-profile", action="store_true",
                    help="leave the Prefect profile alone (export PREFECT_API_URL yourself)")
    sub.choices["status"].add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        commands = {"up": cmd_up, "down": cmd_down, "status": cmd_status, "register": cmd_register}
        return commands[args.command](args)
    except StackError as err:
        print(f"eaglenest stack {args.command}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
