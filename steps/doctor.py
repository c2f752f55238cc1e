"""Doctor: why does this EAGLE-3 draft get no acceptance? Every catalogue check on any checkpoint directory.

Reads: a draft directory in any known layout (eaglenest's `sglang/` or `vllm/` export, SpecForge's
SGLang export, a speculators directory, EAGLE's official release) or an export artifact id; the
target (`--target`: its HF directory or a target artifact id, like every step's `--target`; by
default the one an eaglenest export's lineage names); a running server speaking SGLang's API
(`--server`) and a serve record (`--serve-record`: the start attempts `steps.serve` writes).
Writes nothing; prints one line per check (`--json`: `{"ok", "checks": [{"id", "status", "evidence",
"fix"}]}`) and exits 1 on any FAIL, 2 on an input it cannot find.

The layout comes from an explicit rules table over config.json and the weight keys (never from the
path, `steps/lib/layouts.py`). The checks are `steps/lib/checks/` (`diagnose`); each names its catalogue row:
- F2 every weight key lands in a parameter of the serving loader (SGLang's/vLLM's own rules,
  `steps/lib/formats/<engine>.py` `resolve`); dropped keys and their common prefix are named; shapes match config.
- F3 `d2t` present when the draft vocab is reduced, int64, offsets (not absolute ids), in range,
  consistent with `t2d` (`steps.lib.checks.vocab.validate_vocab`).
- F4 which aux layers the server will capture (convention per layout, `steps.lib.layer_ids`), capturable
  in the target, equal to the layers the draft was trained on when the export manifest records them.
- F5 `max_position_embeddings` against the target's context. F7 `draft_vocab_size` and architecture.
- F1 / F6 with `--server`: the served algorithm, a probe's live τ, CUDA graphs, start attempts.
- F9 with `--target` and `--server`: offline τ (reference engine) vs live τ on the same prompts;
  offline good + live ≈ 1 means serving is misconfigured, not training.

    eaglenest doctor PATH|EXPORT_ID [--target DIR|ID] [--store URI] [--server URL] [--context-length N] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from steps.lib.artifacts import served_export, target_dir
from steps.lib.checks.finding import Finding
from steps.lib.config import InputError
from steps.lib.diagnose import diagnose
from steps.lib.home import local_path
from steps.lib.store import ARTIFACT_ID, ArtifactError, open_store, store_uri_for

#: where `--store` points when neither it nor EAGLENEST_STORE is set (the shipped configs' default).
DEFAULT_STORE = "file://out/store"


def report(findings: list[Finding]) -> dict[str, Any]:
    """The --json shape: statuses upper-case, as printed."""
    return {"ok": not any(f.status == "fail" for f in findings),
            "checks": [{**f.to_dict(), "status": f.status.upper()} for f in findings]}


#: the rows only a live server can judge, and what each needs it for
SERVER_ROWS = {"F1": "the algorithm it serves with", "F6": "its CUDA-graph start", "F9": "live against offline τ"}


def summary(findings: list[Finding], server: str | None) -> str:
    """The last line: how many rows fail (which), pass, are skipped, and what was not checked without --server."""
    by = {s: sorted({f.id for f in findings if f.status == s}) for s in ("fail", "warn", "pass", "skip")}
    line = (f"doctor: {len(by['fail'])} failing" + (f" ({', '.join(by['fail'])})" if by["fail"] else "")
            + (f", {len(by['warn'])} warning ({', '.join(by['warn'])})" if by["warn"] else "")
            + f", {len(by['pass'])} passing, {len(by['skip'])} skipped")
    unchecked = [f"{row} ({why})" for row, why in SERVER_ROWS.items()
                 if server is None and not any(f.id == row for f in findings)]
    if unchecked:
        line += f"; not checked without --server URL: {', '.join(unchecked)}"
    return line


def read_serve_record(path: Path) -> list[dict[str, Any]]:
    """Start attempts: a JSON list (what `steps.serve` prints) or a manifest/dict holding `attempts`."""
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        data = data.get("attempts") or (data.get("meta") or {}).get("attempts") or []
    return list(data)


def resolve_inputs(path: str, target: str | None, store_uri: str) -> tuple[Path, Path | None]:
    """(draft directory, target directory): PATH and --target each as a directory or an artifact id;
    with no --target, the target an eaglenest export's lineage records (None for foreign drafts)."""
    draft_dir, lineage_target = served_export(path, store_uri)
    if target is None:
        return draft_dir, lineage_target
    if local_path(target).is_dir():
        return draft_dir, local_path(target)
    if ARTIFACT_ID.fullmatch(target):
        return draft_dir, target_dir(open_store(store_uri), target)
    raise FileNotFoundError(f"--target {target}: neither a model directory nor a target artifact id (16 hex digits)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eaglenest doctor", description=__doc__.splitlines()[0])
    ap.add_argument("path", help="a draft directory (any layout: SGLang, speculators, EAGLE official) "
                                 "or an export artifact id")
    ap.add_argument("--target", default=None, help="the target: its HF directory or a target artifact id "
                                                   "(default: the one an eaglenest export was trained for)")
    ap.add_argument("--store", default=None, help="artifact store URI for ids (default: $EAGLENEST_STORE, "
                                                  f"else {DEFAULT_STORE})")
    ap.add_argument("--server", default=None, help="base URL of a running server speaking SGLang's API")
    ap.add_argument("--context-length", type=int, default=None, help="the serving context length (F5)")
    ap.add_argument("--trained-layer-ids", default=None,
                    help="comma-separated internal aux ids the draft was trained on (F4)")
    ap.add_argument("--serve-record", default=None, help="JSON file of start attempts from steps.serve (F6)")
    ap.add_argument("--json", action="store_true", help='print {"ok", "checks": [...]} only')
    args = ap.parse_args(argv)
    trained = [int(i) for i in args.trained_layer_ids.split(",")] if args.trained_layer_ids else None
    record = read_serve_record(Path(args.serve_record)) if args.serve_record else None
    try:
        draft_dir, target = resolve_inputs(args.path, args.target, store_uri_for(args.store, DEFAULT_STORE))
    except (OSError, KeyError, ArtifactError) as err:   # a missing dir, id or manifest: one line
        print(f"eaglenest doctor: {err}", file=sys.stderr)
        return 2
    try:
        findings = diagnose(draft_dir, target=target, server=args.server, context_length=args.context_length,
                            trained_layer_ids=trained, serve_record=record)
    except (FileNotFoundError, InputError) as err:      # a missing or corrupt file: named, one line
        print(f"eaglenest doctor: {err}", file=sys.stderr)
        return 2
    out = report(findings)
    print(json.dumps(out, indent=2) if args.json else "\n".join([*map(str, findings), summary(findings, args.server)]))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
