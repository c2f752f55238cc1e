"""Serve: start SGLang (or any server speaking its API) for an exported EAGLE-3 draft.

Reads: an exported SGLang draft directory (`config.json`, `model.safetensors`), the target model
path and its `config.json`, and the `serve` / `target` config sections.
Writes: the server log (stdout + stderr) and a record of every start attempt
`{command, cuda_graph, outcome, seconds}`; `run` also writes a `serve` artifact (command,
attempts, endpoint, log snapshots, smoke-test τ). The machinery is `steps/lib/serving/start.py` (benchmark
starts its servers with it too); this module is the step and its CLI. `serve.engine: reference` launches
`steps.lib.reference.server` with the very same argv, so the pipeline runs for real on a CPU.

The launch command is derived from the exported checkpoint and the config, never typed by hand,
and a preflight reads the draft's `config.json` against the command before anything starts:
- F1: the algorithm comes from the draft's architecture (a table). `EAGLE`/`NEXTN` with an EAGLE-3
  draft is refused: the target would capture no aux layers and the draft's `fc` would be skipped
  silently (accept length 1.00, no warning).
- F4: aux layer ids must name capturable target layers, sit in `eagle_config` (the only place
  SGLang reads them for capture) and survive the target family's id shift (DeepSeek: +1 only if
  the first id is 1).
- F5: the draft's `max_position_embeddings` must cover the serving context length.
- F6: the health wait has a deadline; the caller retries once with CUDA graphs off; both recorded.
- F7: `draft_vocab_size` must be an explicit integer and the architecture `LlamaForCausalLMEagle3`.
- F1/F9 after launch: a smoke /generate on a held-out prompt; live τ at zero acceptance stops the server
  and fails.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Mapping
from typing import Any

from steps.lib.artifacts import served_export
from steps.lib.config import PipelineConfig
from steps.lib.home import under_home
from steps.lib.runtime.processes import forwarding_signals
from steps.lib.serving.launch import ServerStartError, launch_with_fallback
from steps.lib.serving.start import LAUNCHERS, build_sglang_command, health_url_for, preflight, start, target_config_for
from steps.lib.store import store_uri_for
from steps.registry import UsageError, step_main


def run(cfg: PipelineConfig, store: Any, export_id: str, target_id: str, *,
        env: Mapping[str, str] | None = None) -> Any:
    """Start the server for an export, smoke-test it, record it, stop it; returns the serve manifest.

    The pipeline that needs the server running (benchmark, gate) calls `start` and stops it itself.
    """
    manifest, server = start(cfg, store, export_id, target_id, env=env)
    server.stop()
    return manifest


# --- CLI -----------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    return step_main("serve", argv)


def launch_directory(cfg: PipelineConfig, args: argparse.Namespace) -> int | None:
    """The registry's CLI hook: `--draft DIR` launches an exported directory and stays up (no store, no
    artifact); without it, `eaglenest serve --export ID --target ID` runs the step like a flow does."""
    if args.draft is None:
        if args.print_command or args.target_path:
            raise UsageError("--print-command and --target-path go with --draft DIR (an exported SGLang draft "
                             "directory); for artifacts pass --export ID --target ID")
        return None
    # the target comes from the export's lineage in the store; --target-path only overrides it
    draft_dir, lineage_target = served_export(args.draft, store_uri_for(args.store, cfg.store))
    args.draft = str(draft_dir)
    args.target_path = args.target_path or (lineage_target and str(lineage_target)) or cfg.target.path
    args.log_dir = args.log_dir or str(under_home("out/serve"))
    if not args.target_path:
        raise UsageError(f"--draft {args.draft}: no store lineage names its target (a directory outside the store) "
                         f"and {args.config} (target.source={cfg.target.source}) names no model directory; pass "
                         "--target-path (the target's local HF directory)")
    try:
        cmd = build_sglang_command(cfg, target_path=args.target_path, draft_dir=args.draft, port=args.port,
                                   disable_cuda_graph=args.disable_cuda_graph)
    except (KeyError, FileNotFoundError) as err:
        print(f"serve: {err.args[0] if isinstance(err, KeyError) else err}", file=sys.stderr)
        return 1
    findings = preflight(args.draft, cmd, target_config=target_config_for(cfg.target, args.target_path))
    if any(f.status == "fail" for f in findings):
        print("\n".join(str(f) for f in findings), file=sys.stderr)
        return 1
    if args.print_command:
        print(shlex.join(cmd))
        return 0
    return serve_until_interrupted(cfg, args)


def serve_until_interrupted(cfg: PipelineConfig, args: argparse.Namespace) -> int:
    # `serve.engine` picks the server, as in `run`; --print-command always prints SGLang's (the serve image's)
    def command_for(disable: bool) -> list[str]:
        return build_sglang_command(cfg, target_path=args.target_path, draft_dir=args.draft, port=args.port,
                                    disable_cuda_graph=disable or args.disable_cuda_graph,
                                    launcher=LAUNCHERS[cfg.serve.engine])

    try:
        server = launch_with_fallback(command_for, log_dir=args.log_dir, health_url=health_url_for(cfg, args.port),
                                      timeout_s=cfg.serve.startup_timeout_s)
    except ServerStartError as err:
        print(json.dumps(err.attempts, indent=2), file=sys.stderr)
        print(err, file=sys.stderr)
        return 1
    print(json.dumps(server.attempts, indent=2))
    print(f"serving at {server.base_url}; Ctrl-C stops it", flush=True)
    # SIGTERM/SIGHUP (kill, docker stop) end the wait like Ctrl-C, and the server is stopped below: it runs in its
    # own session and would outlive us. Not `forwarding_signals(server.stop)`: a handler that stops the server
    # inside `Popen.wait()` deadlocks on the lock that wait holds; raising unwinds out of it first.
    with forwarding_signals(_interrupt):
        try:
            server.process.wait()
        except KeyboardInterrupt:
            pass
    return server.stop()


def _interrupt() -> None:
    raise KeyboardInterrupt




if __name__ == "__main__":
    raise SystemExit(main())
