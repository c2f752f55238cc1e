"""Orchestration overhead of the tiny pipeline run through deployments (issue 13): the wall time of
`eagle3-pipeline/tiny` against the sum of its steps' own `run()` seconds, fresh and fully reused.

    python benchmarks/orchestration_overhead.py [--dir /tmp/overhead] [--port 4300] [--reruns 1] [--keep]

Starts a private stack (`flows.stack.Stack`, no UI, no scheduler) with an empty `file://` store, runs the
pipeline once (every step computes) and `--reruns` more times (every artifact reused), and prints one
JSON line per run: wall seconds (run created → final state, as `--watch` sees it), the steps' own
seconds (their records), overhead = wall − steps, and the final state. Run it from the repository
root of the checkout to measure (PYTHONPATH selects the code).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any


def step_seconds(client: Any, parent: Any) -> dict[str, float]:
    """label → the step's own seconds, from the records the parent kept (its state's data, or its children's)."""
    try:
        done = parent.state.result(raise_on_failure=False)
    except Exception:  # noqa: BLE001 — a Failed run's data is an exception; fall back to the children
        done = None
    if isinstance(done, dict) and all(isinstance(r, dict) and "seconds" in r for r in done.values()):
        return {k: float(r["seconds"]) for k, r in done.items()}
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    out = {}
    children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent.id])))
    for child in children:
        try:
            record = child.state.result(raise_on_failure=False) if child.state else None
        except Exception:  # noqa: BLE001 — a failed child's stored exception may not load here
            record = None
        if isinstance(record, dict) and "seconds" in record:
            out[child.name] = float(record["seconds"])
    return out


def run_once(stack: Any, store_uri: str, config: str) -> dict[str, Any]:
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: stack.api_url}):
        started = time.monotonic()
        run = run_deployment("eagle3-pipeline/tiny", parameters={"config": config, "store": store_uri},
                             timeout=3600, poll_interval=1)
        wall = time.monotonic() - started
        with get_client(sync_client=True) as client:
            parent = client.read_flow_run(run.id)
            steps = step_seconds(client, parent)
    return {"wall_s": round(wall, 1), "steps_s": round(sum(steps.values()), 1),
            "overhead_s": round(wall - sum(steps.values()), 1),
            "overhead_pct": round(100 * (wall - sum(steps.values())) / wall, 1),
            "state": f"{parent.state.type.value}/{parent.state.name}", "steps": steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/tmp/eaglenest-overhead")
    parser.add_argument("--port", type=int, default=4300)
    parser.add_argument("--reruns", type=int, default=1)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--keep", action="store_true",
                        help="keep --dir's store (every run is then a rerun: measures reuse only)")
    args = parser.parse_args(argv)

    from flows.stack import Stack

    root = Path(args.dir)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    store_uri = f"file://{(root / 'store').resolve()}"
    stack = Stack(dir=root / "stack", port=args.port, store_uri=store_uri, ui=False, scheduler=False)
    t0 = time.monotonic()
    try:
        stack.up()
        print(json.dumps({"what": "stack up", "seconds": round(time.monotonic() - t0, 1)}), flush=True)
        for i in range(1 + args.reruns):
            result = run_once(stack, store_uri, args.config)
            print(json.dumps({"what": "fresh" if i == 0 and not args.keep else "reused", **result,
                              "machine": f"{platform.node()} {platform.processor() or platform.machine()}",
                              "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}), flush=True)
    finally:
        stack.down()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
