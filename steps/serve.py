"""Serve: start SGLang (or any server speaking its API) for an exported EAGLE-3 draft.

Reads: an exported SGLang draft directory (`config.json`, `model.safetensors`), the target model
path and its `config.json`, and the `serve` / `target` config sections.
Writes: the server log (stdout + stderr) and a record of every start attempt
`{command, cuda_graph, outcome, seconds}`; `start`/`run` also write a `serve` artifact (command,
attempts, endpoint, log snapshots, smoke-test τ). `serve.engine: reference` launches
`steps.reference_server` with the very same argv, so the pipeline runs for real on a CPU.

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
- F1/F9 after launch: a smoke /generate on a held-out prompt; live τ ≤ 1.1 stops the server and fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from steps import formats
from steps.artifacts import export_dir, target_dir
from steps.config import PipelineConfig, TargetConfig, config_dict, find_config, load_config
from steps.launch import (
    HEALTH_POLL_INTERVAL_S,
    HEALTH_REQUEST_TIMEOUT_S,
    STOP_GRACE_S,
    Server,
    ServerStartError,
    attempt_record,
    get_json,
    health_status,
    launch,
    launch_with_fallback,
    post_json,
    stop_process_group,
)
from steps.layers import check_capturable, from_engine
from steps.metrics import acceptance_length_from_requests
from steps.prompts import held_out_prompts
from steps.store import artifact_id, utc_now

#: how the server is started: the module SGLang documents as its entry point.
SGLANG_LAUNCHER = ("python3", "-m", "sglang.launch_server")

#: draft `architectures[0]` → the SGLang speculative algorithm that serves it. A table, not
#: substring matching: an unknown architecture is an error naming the known ones. EAGLE-3 drafts
#: need EAGLE3, which makes the target capture its aux layers for the draft's `fc` (F1).
ALGORITHM_BY_ARCHITECTURE: dict[str, str] = {
    "LlamaForCausalLMEagle3": "EAGLE3",
}

#: what fixes a draft directory whose config.json is wrong: it is written by the export step only.
REEXPORT_FIX = "re-export the draft with `python -m steps.export` (it writes the SGLang config from the target)"

#: algorithms SGLang resolves to plain EAGLE (`NEXTN` is an alias): no aux capture (F1).
NON_AUX_ALGORITHMS = frozenset({"EAGLE", "NEXTN"})

#: target architectures whose SGLang model adds +1 to `eagle_config` ids only when the first id is 1
#: (models/deepseek_v2.py since PR #25454; also Kimi-K2 checkpoints, which declare DeepseekV3).
PLUS_ONE_ONLY_IF_FIRST_IS_ONE = frozenset({"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"})

#: the environment override that lets SGLang start with a too-short draft context (F5).
LONGER_CONTEXT_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"

#: flags the preflight reads back from a command. argparse accepts unambiguous prefixes
#: (`--speculative-algo EAGLE` parses), so each flag lists the shortest prefix that is unambiguous
#: in SGLang 0.5.23's parser (pinned by tests/integration/test_sglang_parser.py).
WATCHED_FLAGS: dict[str, tuple[str, str]] = {
    "speculative_algorithm": ("--speculative-algorithm", "--speculative-al"),
    "context_length": ("--context-length", "--context-l"),
}

Status = Literal["pass", "fail", "warn", "skip"]


@dataclass(frozen=True)
class Finding:
    """One preflight check: `id` is the failure-catalogue row (F1…F9)."""
    id: str
    status: Status
    evidence: str
    fix: str = ""

    def __str__(self) -> str:
        fix = f"\n      fix: {self.fix}" if self.fix and self.status != "pass" else ""
        return f"[{self.id} {self.status.upper()}] {self.evidence}{fix}"


class PreflightError(ValueError):
    """The command would start a server that serves the draft wrongly; the message lists why."""

    def __init__(self, findings: list[Finding]):
        self.findings = findings
        super().__init__("serve preflight refused the launch:\n  " + "\n  ".join(str(f) for f in findings))


# --- reading the draft ----------------------------------------------------------------------------

def read_draft_config(draft_dir: str | Path) -> dict[str, Any]:
    path = Path(draft_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no draft config.json; pass the exported SGLang directory "
                                "(artifacts/export/<id>/sglang)")
    return json.loads(path.read_text())


def draft_architecture(draft_config: dict[str, Any]) -> str | None:
    archs = draft_config.get("architectures") or [None]
    return archs[0]


def is_eagle3_draft(draft_config: dict[str, Any]) -> bool:
    """An EAGLE-3 draft by its declared architecture, or by its EAGLE-3 `eagle_config` (a mislabelled one)."""
    if ALGORITHM_BY_ARCHITECTURE.get(draft_architecture(draft_config) or "") == "EAGLE3":
        return True
    eagle_config = draft_config.get("eagle_config") or {}
    return "eagle_aux_hidden_state_layer_ids" in eagle_config or bool(eagle_config.get("use_aux_hidden_state"))


def speculative_algorithm(draft_config: dict[str, Any], where: str = "draft config.json") -> str:
    """The algorithm that serves this draft, from the architecture table (F1)."""
    arch = draft_architecture(draft_config)
    if arch not in ALGORITHM_BY_ARCHITECTURE:
        raise KeyError(f"{where}: architectures[0]={arch!r} has no known SGLang algorithm; known: "
                       f"{', '.join(ALGORITHM_BY_ARCHITECTURE)}. Re-export the draft with steps.export")
    return ALGORITHM_BY_ARCHITECTURE[arch]


# --- the launch command -----------------------------------------------------------------------------

def build_sglang_command(cfg: PipelineConfig, *, target_path: str | Path, draft_dir: str | Path,
                         port: int | None = None, disable_cuda_graph: bool = False,
                         launcher: Sequence[str] = SGLANG_LAUNCHER) -> list[str]:
    """The SGLang 0.5.23 launch argv, derived from the exported draft and the config."""
    serve, target = cfg.serve, cfg.target
    algorithm = speculative_algorithm(read_draft_config(draft_dir), f"{Path(draft_dir) / 'config.json'}")
    cmd = [*launcher,
           "--model-path", str(target_path),
           "--speculative-algorithm", algorithm,
           "--speculative-draft-model-path", str(draft_dir),
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

def check_algorithm(draft: dict[str, Any], argv: Sequence[str], where: str) -> Finding:
    algorithm = (flag_value(argv, "speculative_algorithm") or "").upper()
    if not is_eagle3_draft(draft):
        return Finding("F1", "skip", f"{where}: not an EAGLE-3 draft; algorithm {algorithm or 'unset'}")
    if algorithm in NON_AUX_ALGORITHMS:
        return Finding("F1", "fail",
                       f"{where}: EAGLE-3 draft served with --speculative-algorithm {algorithm}",
                       "use EAGLE3 — the target would capture no aux layers and the draft's fc would be "
                       "skipped silently (accept length 1.00); build the command with steps.serve")
    if algorithm != "EAGLE3":
        return Finding("F1", "fail", f"{where}: EAGLE-3 draft but --speculative-algorithm is "
                       f"{algorithm or 'not set'}", "pass --speculative-algorithm EAGLE3")
    return Finding("F1", "pass", f"{where}: EAGLE-3 draft served with EAGLE3")


def check_draft_schema(draft: dict[str, Any], target: dict[str, Any], where: str) -> list[Finding]:
    """F7 and friends through the export's own strict config checker (steps/formats.py), plus the target's shape."""
    expect = {k: target[k] for k in ("vocab_size", "hidden_size") if isinstance(target.get(k), int)}
    problems = formats.check_config(draft, "sglang", where) + formats.check_expectations(draft, "sglang", expect,
                                                                                         where)
    findings = [Finding(p.row or "F7", "fail", str(p), REEXPORT_FIX) for p in problems]
    return findings or [Finding("F7", "pass", f"{where}: {formats.ARCHITECTURES['sglang'][0]} config with an "
                                "explicit draft_vocab_size, as SGLang needs")]


def check_context(draft: dict[str, Any], argv: Sequence[str], target: dict[str, Any], where: str,
                  env: Mapping[str, str]) -> Finding:
    serving = flag_value(argv, "context_length") or target.get("max_position_embeddings")
    draft_mpe = draft.get("max_position_embeddings")
    if serving is None or draft_mpe is None:
        return Finding("F5", "skip" if draft_mpe else "fail",
                       f"{where}: max_position_embeddings={draft_mpe!r}, serving context {serving!r}",
                       "" if draft_mpe else "re-export with steps.export (it sets it from the target)")
    if int(draft_mpe) >= int(serving):
        return Finding("F5", "pass", f"{where}: max_position_embeddings={draft_mpe} ≥ serving context {serving}")
    overridden = env.get(LONGER_CONTEXT_ENV, "").lower() in ("1", "true")
    return Finding("F5", "warn" if overridden else "fail",
                   f"{where}: max_position_embeddings={draft_mpe} < serving context length {serving}"
                   + (f" ({LONGER_CONTEXT_ENV}=1 overrides it; acceptance degrades past the trained length)"
                      if overridden else " (SGLang refuses to start)"),
                   f"re-export the draft with target.context_length={serving}, or lower --context-length to "
                   f"{draft_mpe}, or set {LONGER_CONTEXT_ENV}=1")


def check_aux_layers(draft: dict[str, Any], target: dict[str, Any], where: str) -> Finding:
    eagle_config = draft.get("eagle_config") or {}
    sglang_ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if sglang_ids is None:
        if "eagle_aux_hidden_state_layer_ids" in draft:
            return Finding("F4", "fail", f"{where}: aux layer ids only at the top level "
                           f"({draft['eagle_aux_hidden_state_layer_ids']}); SGLang reads capture ids from "
                           "eagle_config only and would capture its defaults",
                           "re-export with steps.export (writes eagle_config.eagle_aux_hidden_state_layer_ids)")
        return Finding("F4", "warn", f"{where}: no eagle_config.eagle_aux_hidden_state_layer_ids; SGLang "
                       "captures its defaults", "re-export with steps.export to pin the trained layers")
    n_layers = target.get("num_hidden_layers")
    if n_layers is None:
        return Finding("F4", "skip", f"{where}: target num_hidden_layers unknown; aux ids {sglang_ids} unchecked")
    try:
        check_capturable(from_engine(list(sglang_ids), "sglang"), int(n_layers))
    except ValueError as err:
        return Finding("F4", "fail", f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids={sglang_ids} "
                       f"(SGLang convention = internal − 1): {err}",
                       "re-extract and retrain with aux layers this target can capture, or export for the "
                       "target the draft was trained on")
    target_arch = (target.get("architectures") or [None])[0]
    if target_arch in PLUS_ONE_ONLY_IF_FIRST_IS_ONE and sglang_ids[0] != 1:
        return Finding("F4", "fail", f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids={sglang_ids} with a "
                       f"{target_arch} target: SGLang adds +1 for this family only when the first id is 1, so it "
                       f"would capture internal {list(sglang_ids)} instead of the trained "
                       f"{from_engine(list(sglang_ids), 'sglang')}",
                       "train with aux layer ids starting at internal 2 (the default [2, N//2, N-3])")
    return Finding("F4", "pass", f"{where}: aux ids {sglang_ids} capturable in a {n_layers}-layer target")


def preflight(draft_dir: str | Path, cmd_or_args: Sequence[str], *, target_config: Mapping[str, Any],
              env: Mapping[str, str] | None = None) -> list[Finding]:
    """Check a launch command against the draft's config.json and the target's config (F1, F4, F5, F7)."""
    where = str(Path(draft_dir) / "config.json")
    draft = read_draft_config(draft_dir)
    target = dict(target_config)
    env = os.environ if env is None else env
    return [check_algorithm(draft, cmd_or_args, where),
            *check_draft_schema(draft, target, where),
            check_context(draft, cmd_or_args, target, where, env),
            check_aux_layers(draft, target, where)]


def assert_preflight(findings: list[Finding]) -> None:
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


# --- launching (the process code lives in steps/launch.py) ------------------------------------------

def health_url_for(cfg: PipelineConfig, port: int | None = None) -> str:
    # a server bound to all interfaces is still reached over loopback from here
    host = "127.0.0.1" if cfg.serve.host in ("0.0.0.0", "::") else cfg.serve.host
    return f"http://{host}:{cfg.serve.port if port is None else port}/health_generate"


# --- the serve step: start, smoke-test, record ----------------------------------------------------------

#: `serve.engine` → the launcher; the reference server takes the very argv SGLang would.
LAUNCHERS: dict[str, tuple[str, ...]] = {"sglang": SGLANG_LAUNCHER,
                                         "reference": (sys.executable, "-m", "steps.reference_server")}
#: live τ at or below this on the smoke prompt means serving is misconfigured, not training (F1, F9).
SMOKE_MIN_TAU = 1.1


class SmokeTestError(RuntimeError):
    """The server is up but speculative decoding does not work through it (F1/F9)."""


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
    """One /generate with the spec meta_info; live τ ≤ SMOKE_MIN_TAU raises (F1, F9)."""
    r = post_json(f"{base_url}/generate", {"input_ids": input_ids, "sampling_params": {
        "max_new_tokens": cfg.verify.max_new_tokens, "temperature": 0.0}})
    meta = r["meta_info"]
    if "spec_verify_ct" not in meta:
        raise SmokeTestError(f"{base_url}/generate: meta_info has no spec_verify_ct (got {sorted(meta)}); the "
                             "server is not decoding speculatively — check --speculative-algorithm")
    tau = acceptance_length_from_requests([meta])
    if tau <= SMOKE_MIN_TAU:
        raise SmokeTestError(f"{base_url}: live τ = {tau:.2f} on the smoke prompt (≤ {SMOKE_MIN_TAU}); a draft "
                             "that passed verify accepting nothing live means serving is misconfigured (F1: "
                             "EAGLE instead of EAGLE3, F4: aux layers) — compare with the verify artifact's τ")
    return {"tau": tau, "completion_tokens": meta["completion_tokens"], "spec_verify_ct": meta["spec_verify_ct"]}


def start(cfg: PipelineConfig, store: Any, export_id: str, target_id: str, *, baseline: bool = False,
          port: int | None = None, env: Mapping[str, str] | None = None) -> tuple[Any, Server]:
    """Preflight, launch (F6 retry), smoke-test, and record a `serve` artifact; the server keeps running.

    The caller stops it with `server.stop()`. `baseline=True` serves the target alone (no draft,
    no preflight, no smoke test) for the benchmark's no-draft comparison.
    """
    tdir, draft_dir = target_dir(store, target_id), export_dir(store, export_id, "sglang")
    launcher = LAUNCHERS[cfg.serve.engine]

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
    parser = argparse.ArgumentParser(prog="python -m steps.serve",
                                     description="Start SGLang for an exported EAGLE-3 draft (flags derived, "
                                                 "preflight-checked)")
    parser.add_argument("--config", default="configs/tiny.yaml", help="a YAML config path or a name in configs/")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override a config field (repeatable)")
    parser.add_argument("--draft", required=True, help="the exported SGLang draft directory")
    parser.add_argument("--target-path", default=None,
                        help="the target model directory to serve (default: target.path of an hf_dir config)")
    parser.add_argument("--port", type=int, default=None, help="override serve.port")
    parser.add_argument("--disable-cuda-graph", action="store_true", help="start with CUDA graphs off")
    parser.add_argument("--print-command", action="store_true", help="print the launch command and exit")
    parser.add_argument("--log-dir", default="out/serve", help="where server logs go")
    args = parser.parse_args(argv)

    cfg = load_config(find_config(args.config), args.overrides)
    args.target_path = args.target_path or cfg.target.path
    if not args.target_path:
        print(f"serve: {args.config}: target.source={cfg.target.source} names no model directory; pass "
              "--target-path (the target's local HF directory, e.g. `eaglenest target` prints its artifact)",
              file=sys.stderr)
        return 2
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
    def command_for(disable: bool) -> list[str]:
        return build_sglang_command(cfg, target_path=args.target_path, draft_dir=args.draft, port=args.port,
                                    disable_cuda_graph=disable or args.disable_cuda_graph)

    try:
        server = launch_with_fallback(command_for, log_dir=args.log_dir, health_url=health_url_for(cfg, args.port),
                                      timeout_s=cfg.serve.startup_timeout_s)
    except ServerStartError as err:
        print(json.dumps(err.attempts, indent=2), file=sys.stderr)
        print(err, file=sys.stderr)
        return 1
    print(json.dumps(server.attempts, indent=2))
    print(f"serving at {server.base_url}; Ctrl-C stops it", flush=True)
    try:
        server.process.wait()
    except KeyboardInterrupt:
        pass
    return server.stop()


__all__ = ["ALGORITHM_BY_ARCHITECTURE", "Finding", "PreflightError", "Server", "ServerStartError", "SmokeTestError",
           "start", "run", "baseline_command", "smoke_test", "health_status", "stop_process_group", "post_json",
           "get_json", "attempt_record", "HEALTH_POLL_INTERVAL_S", "HEALTH_REQUEST_TIMEOUT_S", "STOP_GRACE_S",
           "assert_preflight", "build_sglang_command", "launch", "launch_with_fallback", "preflight",
           "speculative_algorithm", "target_config_for", "health_url_for"]


if __name__ == "__main__":
    raise SystemExit(main())
