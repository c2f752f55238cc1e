"""`eaglenest stack up|down|status|register`: the CLI of the local stack (`flows/stack.py`).

    eaglenest stack up [--dir DIR] [--port 4200] [--store URI] [--pools docker k8s]
                                                     start (or re-check) and register
    eaglenest stack status [--dir DIR] [--json]                          health, worker, deployments
    eaglenest stack down [--dir DIR]                                     worker first, then the server

`up` records what it was given in `DIR/stack.json` (port, store) and which folder serves which API address
in `$EAGLENEST_HOME/out/stacks.json`. `status` and `down` read them: `--dir` as given, else the stack the
Prefect profile's PREFECT_API_URL points at (what `up` set), else `$EAGLENEST_HOME/out/stack`
(`steps/lib/home.py`). `down` of a folder where no stack was started, or none runs, says so and exits 1.
    eaglenest stack register --store URI [--deployments local|docker|k8s ...] [--pools docker k8s] [--all]
                                     pools + result storage + deployments on the server PREFECT_API_URL
                                     names (compose: `--deployments docker --pools docker`, a cluster)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from flows.prefect_setup import (
    DEPLOYMENT_SETS,
    INFRASTRUCTURE,
    PoolSettings,
    SetupError,
    create_pools,
    deploy,
    point_profile,
    pools_for,
    profile_api_url,
    s3_container_env,
    save_result_storage,
    save_s3_secrets,
)
from flows.stack import START_TIMEOUT_S, Stack, StackError
from steps.lib.home import under_home
from steps.lib.runtime.processes import install_reaper

#: the stack's folder when none is named (under EAGLENEST_HOME)
DEFAULT_DIR = "out/stack"
#: API address → the folder of the stack `up` started for it (under EAGLENEST_HOME)
STACKS_INDEX = "out/stacks.json"
STATE_FILE = "stack.json"


def known_stacks() -> dict[str, str]:
    path = under_home(STACKS_INDEX)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def remember_stack(api_url: str, folder: Path | None) -> None:
    """Record (or, with None, forget) which folder's stack serves `api_url`."""
    stacks = {url: d for url, d in known_stacks().items() if url != api_url}
    if folder is not None:
        stacks[api_url] = str(folder)
    path = under_home(STACKS_INDEX)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stacks, indent=2) + "\n")


def stack_dir(args: argparse.Namespace) -> Path:
    """--dir as typed; for status/down else the stack the profile's API address belongs to; else the home's."""
    if args.dir:
        return Path(args.dir).resolve()
    found = known_stacks().get(profile_api_url() or "") if args.command in ("status", "down") else None
    return Path(found) if found else under_home(DEFAULT_DIR)


def stack_from_args(args: argparse.Namespace) -> Stack:
    """A Stack for its folder (`stack_dir`); --port/--store default to what `up` recorded in stack.json."""
    folder = stack_dir(args)
    state_file = folder / STATE_FILE
    state = json.loads(state_file.read_text()) if state_file.exists() else {}
    return Stack(dir=folder, port=args.port or state.get("port") or 4200,
                 store_uri=getattr(args, "store", None) or state.get("store"),
                 infrastructure=tuple(getattr(args, "pools", None) or ()),
                 ui=not getattr(args, "no_ui", False), scheduler=not getattr(args, "no_schedules", False))


def cmd_up(args: argparse.Namespace) -> int:
    stack = stack_from_args(args)
    print(f"starting the Prefect server and worker under {stack.dir} (a fresh start takes a minute or more)...")
    stack.up(timeout_s=args.timeout)
    remember_stack(stack.api_url, stack.dir)
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
    environ = {**os.environ, "EAGLENEST_STORE": store or ""}
    docker_env = s3_container_env(environ) if args.s3_credentials else {}
    if args.s3_credentials:
        save_s3_secrets(environ)
    settings = PoolSettings(docker_network=args.docker_network, docker_env=docker_env, k8s_namespace=args.namespace)
    pools = create_pools(pools_for(INFRASTRUCTURE if args.all else {*args.deployments, *args.pools}), settings)
    slug = save_result_storage(store, stack_dir(args) / "results")
    deploy(None if args.all else [n for kind in args.deployments for n in DEPLOYMENT_SETS[kind]])
    print(f"{api_url}: pools {', '.join(pools)}; result storage {slug}; deployments registered")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    stack = stack_from_args(args)
    if not (stack.dir / STATE_FILE).exists():
        print(f"eaglenest stack down: no stack was started under {stack.dir} (no {STATE_FILE}): nothing stopped; "
              "pass the --dir `stack up` was given", file=sys.stderr)
        return 1
    stopped = stack.down()
    remember_stack(stack.api_url, None)
    if profile_api_url() == stack.api_url:
        point_profile(None)     # the CLI goes back to its default rather than a dead address
    print(", ".join(f"{name} {'stopped' if ok else 'was not running'}" for name, ok in stopped.items()))
    if not any(stopped.values()):
        print(f"eaglenest stack down: the stack under {stack.dir} ({stack.api_url}) was not running: nothing "
              "stopped", file=sys.stderr)
        return 1
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    stack = stack_from_args(args)
    report = {**stack.status(), "dir": str(stack.dir), "started": (stack.dir / STATE_FILE).exists()}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if report["healthy"] else 1
    where = "" if report["started"] else f"  (no stack was started here: no {STATE_FILE})"
    print(f"stack    {report['dir']}{where}")
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
    args = build_parser().parse_args(argv)
    install_reaper()    # a SIGTERM while `up` waits stops the server and worker it started
    try:
        commands = {"up": cmd_up, "down": cmd_down, "status": cmd_status, "register": cmd_register}
        return commands[args.command](args)
    except (StackError, SetupError) as err:
        print(f"eaglenest stack {args.command}: {err}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    """The `eaglenest stack` argument parser (tests read compose's `stack register` line with it)."""
    parser = argparse.ArgumentParser(prog="eaglenest stack", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("up", "start the server and worker, create pools, register deployments"),
                            ("down", "stop the worker, then the server"),
                            ("status", "health, worker and deployments")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--dir", default=None, help="where the database, logs and pid files live (default: the "
                                                   "stack the Prefect profile points at, else "
                                                   f"$EAGLENEST_HOME/{DEFAULT_DIR})")
        p.add_argument("--port", type=int, default=None, help="server port on 127.0.0.1 (default 4200, or as up)")
    register = sub.add_parser("register", help="pools, result storage and deployments on PREFECT_API_URL's server")
    register.add_argument("--dir", default=None, help="results folder parent for a file:// store (default "
                                                      f"$EAGLENEST_HOME/{DEFAULT_DIR})")
    register.add_argument("--store", default=None, help="store URI (s3:// → S3Bucket results; default EAGLENEST_STORE)")
    register.add_argument("--all", action="store_true", help="every deployment and pool (local, docker, k8s)")
    register.add_argument("--docker-network", default=None,
                          help="docker network the step containers join (compose: eaglenest, to reach minio and "
                               "prefect-server by name)")
    register.add_argument("--s3-credentials", action="store_true",
                          help="save AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY as Secret blocks and give the docker "
                               "pools' containers them (by reference) with EAGLENEST_STORE, EAGLENEST_S3_ENDPOINT_URL")
    register.add_argument("--namespace", default=None,
                          help="Kubernetes namespace of the step Jobs (k8s pools; default eaglenest)")
    register.add_argument("--deployments", nargs="+", choices=list(DEPLOYMENT_SETS), default=["local"],
                          help="which sets to register (default local; compose: docker)")
    up = sub.choices["up"]
    up.add_argument("--store", default=None, help="store URI for runs that pass none (default: EAGLENEST_STORE)")
    up.add_argument("--timeout", type=float, default=START_TIMEOUT_S, help="seconds to wait for server and worker")
    up.add_argument("--no-ui", action="store_true", help="API only (starts faster)")
    up.add_argument("--no-schedules", action="store_true", help="do not run the dataset sensor's schedule")
    up.add_argument("--no-profile", action="store_true",
                    help="leave the Prefect profile alone (export PREFECT_API_URL yourself)")
    for p in (up, register):
        p.add_argument("--pools", nargs="*", choices=[k for k in INFRASTRUCTURE if k != "local"], default=[],
                       help="also create the docker / k8s work pools (deploy/pools/); by default only `local`, "
                            "since a pool without a worker shows red on the dashboard")
    sub.choices["status"].add_argument("--json", action="store_true")
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
