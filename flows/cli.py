"""The `eaglenest` console script: one entry point for every step, the tools and the Prefect commands.

    eaglenest <step> [--config C] [--store URI] [--set SECTION.FIELD=VALUE ...] [--<input> ID ...] [--json]

Step commands come from the one table in `steps/registry.py` and run the step in this process (no
Prefect imported, as in a container); `pipeline`, `demo`, `stack` and `dataset` run Prefect flows. It
lives in flows/ because it dispatches to both layers: steps/ never names flows/ (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import importlib
import sys

from steps.registry import STEPS, TOOLS, step_main, version

#: the commands that need Prefect: command → (module with a `main(argv) -> int`, one-line help)
FLOW_COMMANDS: dict[str, tuple[str, str]] = {
    "pipeline": ("flows.pipeline_cli", "run the whole chain as a Prefect flow"),
    "demo": ("flows.demo", "the whole chain on the embedded default, with a summary"),
    "stack": ("flows.stack_cli", "a local Prefect server + worker with every deployment registered (up|down|status)"),
    "dataset": ("flows.dataset_trigger", "upload a dataset to the store and start a pipeline run (upload|list)"),
}
#: every `eaglenest` command → its one-line help, in the order `--help` lists them
COMMANDS: dict[str, str] = {**{s.name: s.help for s in STEPS.values()}, **TOOLS,
                            **{name: help_text for name, (_, help_text) in FLOW_COMMANDS.items()}}


def usage() -> str:
    lines = ["usage: eaglenest <command> [options]   (eaglenest <command> --help for its options)", "", "commands:"]
    lines += [f"  {name:10s} {help_text}" for name, help_text in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "--version":
        print(f"eaglenest {version()}")
        return 0
    if command == "--commands":   # for containers/entrypoint.sh: which first arguments are eaglenest's
        print(" ".join(COMMANDS))
        return 0
    if command in STEPS:
        return step_main(command, rest)
    if command in TOOLS:
        return int(importlib.import_module(f"steps.{command}").main(rest) or 0)
    if command in FLOW_COMMANDS:
        return int(importlib.import_module(FLOW_COMMANDS[command][0]).main(rest) or 0)
    print(f"eaglenest: unknown command {command!r} — run `eaglenest --help` for the list", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
