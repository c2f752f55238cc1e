"""Serving an export: the SGLang launch command derived from the exported draft, the preflight that reads
it back before anything starts, and `start` (launch with the F6 fallback, smoke test, `serve` artifact).

The serve step runs `start` and stops the server; benchmark and gate keep it running. Nothing here is
typed by hand: the algorithm comes from the draft's architecture (F1), the context from the target
(F5), and `serve.engine: reference` launches `steps.lib.reference.server` with the very argv SGLang would
get, so the pipeline runs for real on a CPU. The preflight's rules are the catalogue's
(`steps/lib/checks/`): F1 algorithm, F3 vocab size, F4 aux layers, F5 context, F7 config schema.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from steps.lib.artifacts import export_dir, target_dir
from steps.lib.checks.algorithm import check_algorithm, check_aux_capture_flag, is_eagle3_draft, speculative_algorithm
from steps.lib.checks.config import config_findings, schema_verdict
from steps.lib.checks.context import LONGER_CONTEXT_ENV, check_context
from steps.lib.checks.finding import Finding
from steps.lib.checks.layers import check_aux_layers
from steps.lib.checks.tau import check_live_tau
from steps.lib.checks.vocab import check_vocab_size
from steps.lib.config import PipelineConfig, TargetConfig, config_dict
from steps.lib.data.prompts import held_out_prompts
from steps.lib.http import get_json, post_json
from steps.lib.metrics import acceptance_length_from_requests
from steps.lib.serving.launch import Server, available_port, launch_with_fallback
from steps.lib.store import artifact_id, utc_now

#: how the server is started: the module SGLang documents as its entry point.
SGLANG_LAUNCHER = ("python3", "-m", "sglang.launch_server")
#: `serve.engine` → the launcher; the reference server takes the very argv SGLang would.
LAUNCHERS: dict[str, tuple[str, ...]] = {"sglang": SGLANG_LAUNCHER,
                                         "reference": (sys.executable, "-m", "steps.lib.reference.server")}

#: flags the preflight reads back from a command. argparse accepts unambiguous prefixes
#: (`--speculative-algo EAGLE` parses), so each flag lists the shortest prefix that is unambiguous
#: in SGLang 0.5.23's parser (pinned by tests/integration/test_sglang_parser.py).
WATCHED_FLAGS: dict[str, tuple[str, str]] = {
    "speculative_algorithm": ("--speculative-algorithm", "--speculative-al"),
    "context_length": ("--context-length", "--context-l"),
}


class PreflightError(ValueError):
    """The command would start a server that serves the draft wrongly; the message lists why."""

    def __init__(self, findings: list[Finding]):
        self.findings = findings
        super().__init__("serve preflight refused the launch:\n  " + "\n  ".join(str(f) for f in findings))


class SmokeTestError(RuntimeError):
    """The server is up but speculative decoding does not work through it (F1/F9)."""


def read_draft_config(draft_dir: str | Path) -> dict[str, Any]:
    """The exported draft's config.json (what the command and the preflight are derived from)."""
    path = Path(draft_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no draft config.json; pass the exported SGLang directory "
                                "(artifacts/export/<id>/sglang)")
    return json.loads(path.read_text())


# --- the launch command -----------------------------------------------------------------------------

def build_sglang_command(cfg: PipelineConfig, *, target_path: str | Path, draft_dir: str | Path,
                         port: int | None = None, disable_cuda_graph: bool = False,
                         launcher: Sequence[str] = SGLANG_LAUNCHER) -> list[str]:
    """The SGLang 0.5.23 launch argv, derived from the exported draft and the config. Local paths are absolute,
    so a printed command works from any directory (a target that is no local path, a hub id, stays as is)."""
    serve, target = cfg.serve, cfg.target
    algorithm = speculative_algorithm(read_draft_config(draft_dir), f"{Path(draft_dir) / 'config.json'}")
    target_arg = os.path.abspath(target_path) if Path(target_path).exists() else str(target_path)
    cmd = [*launcher,
           "--model-path", target_arg,
           "--speculative-algorithm", algorithm,
           "--speculative-draft-model-path", os.path.abspath(draft_dir),
           # all three: SGLang asserts when only some are set, and auto-picks by target arch otherwise
           "--speculative-num-steps", str(serve.num_steps),
           "--speculative-eagle-topk", str(serve.eagle_topk),
           "--speculative-num-draft-tokens", str(serve.num_draft_tokens),
           "--tp", str(target.tensor_parallel_size),
           "--host", serve.host,
           "--port", str(serve.port if port is None else port),
           "--enable-metrics"]
    cmd += cuda_graph_args(serve.cuda_graph_max_bs, disabled=disable_cuda_graph)
    if target.context_length is not None:
        cmd += ["--context-length", str(target.context_length)]
    if target.quantization:
        # the draft would otherwise inherit the target's --quantization; it is trained unquantized
        cmd += ["--quantization", target.quantization, "--speculative-draft-model-quantization", "unquant"]
    if target.trust_remote_code:
        cmd += ["--trust-remote-code"]
    return cmd


def cuda_graph_args(max_bs: int, *, disabled: bool) -> list[str]:
    """0.5.23 flags: `--cuda-graph-max-bs` is gone (argparse: ambiguous option); use the per-phase ones."""
    if disabled:
        # a disabled decode backend also skips the draft's decode and extend graphs
        # (EAGLEWorkerV2.init_cuda_graphs returns early), where F6 capture hangs happen
        return ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
    return ["--cuda-graph-max-bs-decode", str(max_bs)]


def flag_value(argv: Sequence[str], name: str) -> str | None:
    """The last value given for a watched flag, in any form argparse accepts (`--f v`, `--f=v`, a prefix)."""
    full, shortest = WATCHED_FLAGS[name]
    value = None
    for i, token in enumerate(argv):
        flag, eq, inline = token.partition("=")
        if not (flag.startswith(shortest) and full.startswith(flag)):
            continue
        if eq:
            value = inline
        elif i + 1 < len(argv):
            value = argv[i + 1]
    return value


# --- preflight ----------------------------------------------------------------------------------------

def preflight(draft_dir: str | Path, cmd_or_args: Sequence[str], *, target_config: Mapping[str, Any],
              env: Mapping[str, str] | None = None) -> list[Finding]:
    """Check a launch command against the draft's config.json and the target's config (F1, F4, F5, F7)."""
    where = str(Path(draft_dir) / "config.json")
    draft, target = read_draft_config(draft_dir), dict(target_config)
    env = os.environ if env is None else env
    schema = config_findings(draft, "sglang", where,
                             expect={"hidden_size": target["hidden_size"]} if isinstance(target.get("hidden_size"),
                                                                                          int) else {})
    schema += check_aux_capture_flag(draft, "sglang", where)
    schema += check_vocab_size(draft.get("vocab_size"), target.get("vocab_size"), where=where)
    return [check_algorithm(flag_value(cmd_or_args, "speculative_algorithm"), eagle3=is_eagle3_draft(draft),
                            where=where),
            *schema_verdict(schema, draft, where),
            check_context(draft.get("max_position_embeddings"),
                          flag_value(cmd_or_args, "context_length") or target.get("max_position_embeddings"),
                          where=where, overridden=env.get(LONGER_CONTEXT_ENV, "").lower() in ("1", "true")),
            check_aux_layers(draft, "sglang", num_layers=target.get("num_hidden_layers"),
                             target_arch=(target.get("architectures") or [None])[0], trained=None, where=where)]


def assert_preflight(findings: list[Finding]) -> None:
    """Raise PreflightError naming every failed check."""
    failed = [f for f in findings if f.status == "fail"]
    if failed:
        raise PreflightError(failed)


def target_config_for(target: TargetConfig, target_path: str | Path) -> dict[str, Any]:
    """The target's config.json when it is here, else the shape the config declares."""
    path = Path(target_path) / "config.json"
    if path.is_file():
        return json.loads(path.read_text())
    declared = {"num_hidden_layers": target.num_hidden_layers, "hidden_size": target.hidden_size,
                "vocab_size": target.vocab_size, "max_position_embeddings": target.context_length}
    if target.source == "tiny":  # the seeded tiny target's shape is fully configured
        declared = {k: getattr(target.tiny, k) for k in declared} | {
            k: v for k, v in declared.items() if v is not None}
    return {k: v for k, v in declared.items() if v is not None}


# --- launching (the process code lives in steps/lib/serving/launch.py) ------------------------------------------

def health_url_for(cfg: PipelineConfig, port: int | None = None) -> str:
    # a server bound to all interfaces is still reached over loopback from here
    host = "127.0.0.1" if cfg.serve.host in ("0.0.0.0", "::") else cfg.serve.host
    return f"http://{host}:{cfg.serve.port if port is None else port}/health_generate"


def baseline_command(cmd: Sequence[str]) -> list[str]:
    """The same launch without a draft: every `--speculative-*` flag and its value removed."""
    out, skip = [], False
    for token in cmd:
        if skip:
            skip = False
        elif token.startswith("--speculative-"):
            skip = "=" not in token
        else:
            out.append(token)
    return out


def smoke_test(cfg: PipelineConfig, base_url: str, input_ids: list[int]) -> dict[str, Any]:
    """One /generate with the spec meta_info; live τ at zero acceptance raises (F9, usually caused by F1/F4)."""
    r = post_json(f"{base_url}/generate", {"input_ids": input_ids, "sampling_params": {
        "max_new_tokens": cfg.verify.max_new_tokens, "temperature": 0.0}})
    meta = r["meta_info"]
    if "spec_verify_ct" not in meta:
        raise SmokeTestError(f"{base_url}/generate: meta_info has no spec_verify_ct (got {sorted(meta)}); the "
                             "server is not decoding speculatively — check --speculative-algorithm")
    tau = acceptance_length_from_requests([meta])
    verdict = check_live_tau(tau, where=base_url)
    if verdict.status == "fail":
        raise SmokeTestError(f"{verdict}")
    return {"tau": tau, "completion_tokens": meta["completion_tokens"], "spec_verify_ct": meta["spec_verify_ct"]}


def start(cfg: PipelineConfig, store: Any, export_id: str, target_id: str, *, baseline: bool = False,
          port: int | None = None, env: Mapping[str, str] | None = None) -> tuple[Any, Server]:
    """Preflight, launch (F6 retry), smoke-test, and record a `serve` artifact; the server keeps running, on
    `port` (default serve.port) or, when that one is taken, on a free port (`server.base_url` says which).

    The caller stops it with `server.stop()`. `baseline=True` serves the target alone (no draft,
    no preflight, no smoke test) for the benchmark's no-draft comparison.
    """
    tdir, draft_dir = target_dir(store, target_id), export_dir(store, export_id, "sglang")
    launcher = LAUNCHERS[cfg.serve.engine]
    # `port` (default serve.port) is the preferred one: taken by another server, a free one is used instead
    port = available_port(cfg.serve.host, cfg.serve.port if port is None else port)

    def command_for(disable: bool) -> list[str]:
        cmd = build_sglang_command(cfg, target_path=tdir, draft_dir=draft_dir, port=port,
                                   disable_cuda_graph=disable, launcher=launcher)
        return baseline_command(cmd) if baseline else cmd

    if not baseline:   # refuse before anything starts (F1, F4, F5, F7)
        assert_preflight(preflight(draft_dir, command_for(False), target_config=target_config_for(cfg.target, tdir)))
    inputs = {"export": export_id, "target": target_id}
    # a running process is an event, not a pure function of its inputs: every start is its own artifact
    serve_id = artifact_id("serve", {**config_dict(cfg.serve), "baseline": baseline, "started": utc_now()}, inputs)
    log_dir = store.cache_dir / "serve-logs" / serve_id            # live logs keep growing: not in the artifact
    server = launch_with_fallback(command_for, log_dir=log_dir, health_url=health_url_for(cfg, port),
                                  timeout_s=cfg.serve.startup_timeout_s, env=env)
    try:
        smoke = {} if baseline else smoke_test(cfg, server.base_url, _smoke_prompt(cfg, tdir))
        manifest = _record(store, serve_id, cfg, inputs, server, smoke=smoke, baseline=baseline)
    except BaseException:
        server.stop()
        raise
    return manifest, server


def _smoke_prompt(cfg: PipelineConfig, tdir: Path) -> list[int]:
    """The first held-out verify prompt, so the smoke τ is comparable with the offline τ."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tdir, trust_remote_code=cfg.target.trust_remote_code)
    return held_out_prompts(cfg, tokenizer)[0][1]


def _record(store: Any, serve_id: str, cfg: PipelineConfig, inputs: dict[str, str], server: Server, *,
            smoke: dict[str, Any], baseline: bool) -> Any:
    """The serve artifact: command, every attempt, the endpoint, and a snapshot of each attempt's log."""
    writer = store.begin("serve", serve_id, step="serve", inputs=inputs, config=cfg.serve)
    for a in server.attempts:
        log = Path(a["log"])
        writer.path(f"logs/{log.name}").write_bytes(log.read_bytes() if log.is_file() else b"")
    writer.path("attempts.json").write_text(json.dumps(server.attempts, indent=2))
    info = get_json(f"{server.base_url}/server_info")
    return writer.commit(metrics={"smoke_tau": smoke.get("tau"), "attempts": len(server.attempts)},
                         meta={"command": shlex.join(server.command), "attempts": server.attempts,
                               "endpoint": server.base_url, "engine": cfg.serve.engine, "baseline": baseline,
                               "pid": server.process.pid, "live_log": str(server.log_path), "smoke": smoke,
                               "server_version": info.get("version"),
                               "logs": [f"logs/{Path(a['log']).name}" for a in server.attempts]})


