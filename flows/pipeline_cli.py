"""`eaglenest pipeline`: run the eagle3-pipeline flow in-process and print each step's artifact."""

from __future__ import annotations

import argparse
import json

from flows.pipeline import eagle3_pipeline


def main(argv: list[str] | None = None) -> int:
    from steps.cli import add_common_args

    parser = argparse.ArgumentParser(prog="eaglenest pipeline", description=__doc__)
    add_common_args(parser)
    parser.add_argument("--json", action="store_true", help="print the step records as JSON")
    args = parser.parse_args(argv)
    records = eagle3_pipeline(config=args.config, overrides=args.overrides, store=args.store)
    if args.json:
        print(json.dumps(records, indent=2))
    else:
        for name, r in records.items():
            print(f"{name:8s} {r['seconds']:8.1f} s  {r['uri']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
