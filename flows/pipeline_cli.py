"""`eaglenest pipeline`: run the eagle3-pipeline flow from this shell and print each step's artifact.

`--mode local` (default) runs every step in this process; `--mode deployments` starts each step as the
deployment `<step>/<step>-<pool>` (needs a Prefect server with workers: `eaglenest stack up`).
"""

from __future__ import annotations

import argparse
import json
import sys

from flows.parameters import BadParameter, Outcome, Refused, check_pipeline
from flows.pipeline import eagle3_pipeline
from steps.lib.runtime.processes import install_reaper
from steps.registry import add_common_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eaglenest pipeline", description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--mode", choices=["local", "deployments"], default="local")
    parser.add_argument("--pool", default="local", help="step deployments to use in --mode deployments")
    parser.add_argument("--through", choices=["verify", "gate"], default="gate",
                        help="stop after offline verify, or serve, benchmark and gate (default)")
    parser.add_argument("--dataset", default=None, help="URI of an uploaded dataset file (eaglenest dataset upload)")
    parser.add_argument("--spec-url", default=None, help="benchmark this running speculative server")
    parser.add_argument("--json", action="store_true", help="print the step records as JSON")
    args = parser.parse_args(argv)
    try:   # what the flow checks first, here before Prefect starts (a temporary server takes seconds)
        check_pipeline(config=args.config, overrides=args.overrides, store=args.store, mode=args.mode,
                       pool=args.pool, spec_url=args.spec_url, baseline_url=None, through=args.through)
    except BadParameter as err:
        print(f"eaglenest pipeline: {err}", file=sys.stderr)
        return 2
    install_reaper()    # a SIGTERM stops the step processes, their servers and Prefect's temporary server
    state = eagle3_pipeline(config=args.config, overrides=args.overrides, store=args.store, mode=args.mode,
                            pool=args.pool, through=args.through, dataset=args.dataset, spec_url=args.spec_url,
                            return_state=True)
    # a step that raised fails the run with its exception: let it surface; a gate verdict is the run's
    # own final state, whose data are the step records and whose message is the result
    records = state.result(raise_on_failure=False)
    if isinstance(records, Refused):        # a parameter that does not hold: its one line, exit 2
        print(f"eaglenest pipeline: {state.message}", file=sys.stderr)
        return 2
    if isinstance(records, BaseException):
        if not isinstance(records, Outcome):
            raise records                   # a step failed: its own error
        records = {}                        # the gate refused: the message says why
    if args.json:
        print(json.dumps({"state": state.name, "message": state.message, "records": records}, indent=2))
    else:
        for name, r in records.items():
            print(f"{name:16s} {r['seconds']:8.1f} s  {r['uri']}")
        print(f"{state.name}: {state.message}" if state.message else state.name)
    return 0 if state.is_completed() else 1


if __name__ == "__main__":
    raise SystemExit(main())
