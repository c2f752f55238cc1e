"""The `eaglenest` console script: one entry point for every step, the tools and the Prefect commands.

    eaglenest <step> [--config C] [--store URI] [--set SECTION.FIELD=VALUE ...] [--<input> ID ...] [--json]

Step commands come from the one table in `steps/registry.py` and run the step in this process (no
Prefect imported, as in a container); `pipeline`, `demo`, `stack` and `dataset` run Prefect flows. It
lives in flows/ because it dispatches to both layers: steps/ never names flows/ (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import os
import sys
import traceback
from pathlib import Path

from steps.lib.runtime.processes import install_reaper
from steps.lib.runtime.redaction import redact_text
from steps.registry import STEPS, TOOLS, step_main, version

#: the commands that need Prefect: command → (module with a `main(argv) -> int`, one-line help)
FLOW_COMMANDS: dict[str, tuple[str, str]] = {
    "pipeline": ("flows.pipeline_cli", "run the whole chain as a Prefect flow"),
    "demo": ("flows.demo", "the whole chain on the embedded default, with a summary"),
    "stack": ("flows.stack_cli", "a local Prefect server + worker with every deployment registered (up|down|status)"),
    "dataset": ("flows.dataset_trigger", "upload a dataset to the store and start a pipeline run (upload|list)"),
}
#: store maintenance (steps/lib/store/maintenance.py): no Prefect, no torch
STORE_HELP = "check every artifact's sha256 (verify [--kind K] [--id ID]) or remove stale staging (gc)"
#: every `eaglenest` command → its one-line help, in the order `--help` lists them
COMMANDS: dict[str, str] = {**{s.name: s.help for s in STEPS.values()}, **TOOLS, "store": STORE_HELP,
                            **{name: help_text for name, (_, help_text) in FLOW_COMMANDS.items()}}


def usage() -> str:
    lines = ["usage: eaglenest <command> [options]   (eaglenest <command> --help for its options)", "", "commands:"]
    lines += [f"  {name:10s} {help_text}" for name, help_text in COMMANDS.items()]
    return "\n".join(lines)


def store_main(argv: list[str]) -> int:
    """`eaglenest store verify|gc`: 0 when every artifact checks out (or gc ran), 1 when one is corrupt, 2 for
    a usage error (one line)."""
    from steps.lib.runtime.redaction import redact_text
    from steps.lib.store import ArtifactError, collect_garbage, open_store, store_uri_for, verify_aliases, verify_all
    from steps.registry import add_common_args

    parser = argparse.ArgumentParser(prog="eaglenest store", description=STORE_HELP)
    sub = parser.add_subparsers(dest="action", required=True)
    verify = sub.add_parser("verify", help="hash every file of every committed artifact against its manifest")
    verify.add_argument("--kind", default=None, help="only this kind (target, dataset, hidden, vocab, draft, ...)")
    verify.add_argument("--id", default=None, help="only this artifact id (16 hex digits)")
    gc = sub.add_parser("gc", help="remove staging of committed artifacts, orphan attempts and expired leases")
    gc.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    for p in (verify, gc):
        add_common_args(p)
        p.add_argument("--json", action="store_true", help="print the records as JSON")
    args = parser.parse_args(argv)
    try:
        from steps.lib.config import find_config, load_config

        store = open_store(store_uri_for(args.store, load_config(find_config(args.config), args.overrides).store))
        if args.action == "verify":
            records = verify_all(store, args.kind, args.id)
            # aliases too (all of them when nothing narrower was asked): a missing or corrupt target named
            aliases = verify_aliases(store) if args.kind is None and args.id is None else []
            print(json.dumps(records + aliases, indent=2) if args.json else "\n".join(
                [f"{'ok     ' if r['ok'] else 'CORRUPT'} {r['kind']}/{r['id']}"
                 + (f"  {r['files']} files, {r['bytes']} bytes" if r["ok"] else f"  {r['error']}") for r in records]
                + [f"{'ok     ' if a['ok'] else 'CORRUPT'} alias {a['alias']}"
                   + (f" -> {a['kind']}/{a['id']}" if a["ok"] else f"  {a['error']}") for a in aliases])
                or f"no artifacts in {store.uri}")
            return 0 if all(r["ok"] for r in records + aliases) else 1
        out = collect_garbage(store, dry_run=args.dry_run)
        print(json.dumps(out, indent=2) if args.json else "\n".join(
            [f"{'would remove' if args.dry_run else 'removed'} {r['key']} ({r['why']})" for r in out["removed"]]
            + [f"{len(out['removed'])} objects, {out['bytes']} bytes; kept {len(out['kept'])} of live writers"]))
        return 0
    except (ArtifactError, ValueError, OSError) as err:
        print(redact_text(f"eaglenest store: {' '.join(str(err).split())}"), file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(argv)
    except Exception as err:  # noqa: BLE001 — the last line of defence: one line, never a traceback
        if "--debug" in argv or os.environ.get("EAGLENEST_DEBUG"):
            raise
        print(f"eaglenest {argv[0] if argv else ''}: {unexpected_error_line(err)}", file=sys.stderr)
        return 2


def unexpected_error_line(err: BaseException) -> str:
    """One line for an error no layer turned into a message: what, where it was raised, how to see more."""
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:     # a full disk: the file, its filesystem, knobs
        from steps.lib.files import disk_full_line

        return redact_text(disk_full_line(err))
    frames = traceback.extract_tb(err.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    text = redact_text(" ".join(str(err).split()))[:500]
    return (f"{type(err).__name__}: {text}{where}; an input eaglenest does not check yet, or a bug: check the "
            "file named above, re-run with EAGLENEST_DEBUG=1 for the traceback and report it")


def _dispatch(argv: list[str]) -> int:
    install_reaper()    # SIGTERM/SIGINT stop every server and step process this command starts
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
    if command == "store":
        return store_main(rest)
    if command in FLOW_COMMANDS:
        return int(importlib.import_module(FLOW_COMMANDS[command][0]).main(rest) or 0)
    print(f"eaglenest: unknown command {command!r} — run `eaglenest --help` for the list", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
