"""The one table of steps, and the one CLI every step shares.

`STEPS` names each step once: its module (`steps.<name>`), the artifact ids its `run()` takes (in
order), the keyword options `run()` accepts, the artifact kind it writes, its hardware class and its
one-line help. Everything else derives from it: `flows/step_flows.py` (the flows and their
deployments' names), `flows/cli.py` (the `eaglenest` commands), the container entrypoint (it asks
`eaglenest --commands`), and the tests that pin `deploy/prefect.yaml` to it.

`step_main(step, argv)` is the CLI of every step (`eaglenest <step>` and `python -m steps.<step>`):

    eaglenest <step> [--config C] [--store URI] [--set SECTION.FIELD=VALUE ...] [--<input> ID ...]
                     [--<option> V ...] [--json] [--debug] [--version]

Expected errors (a missing artifact, a bad store URI, an unreadable or invalid config) print one line
on stderr naming the problem and the fix, exit 2; `--debug` re-raises them with the traceback.

This module names step modules only as strings and imports them when a command runs: it is library
(imports point down, docs/ARCHITECTURE.md), and `--help` must not pay for torch.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

#: one default for every step, the flows and `eaglenest pipeline`: the tiny config runs offline on a CPU
#: in seconds, so a bare `eaglenest <step>` does something real and cheap instead of refusing to start.
DEFAULT_CONFIG = "configs/tiny.yaml"

Hardware = Literal["cpu", "gpu", "serve"]


@dataclass(frozen=True)
class Option:
    """A command-line argument beyond the shared ones: `--<name with dashes>`, stored as `name`."""

    name: str
    help: str
    type: Callable[[str], Any] = str
    flag: bool = False       # a store_true switch
    cli: bool = True         # False: a keyword run() accepts from flows only (serve's `env` mapping)

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        flag = "--" + self.name.replace("_", "-")
        if self.flag:
            parser.add_argument(flag, dest=self.name, action="store_true", help=self.help)
        else:
            parser.add_argument(flag, dest=self.name, type=self.type, default=None, help=self.help)


@dataclass(frozen=True)
class Step:
    name: str
    inputs: tuple[str, ...]             # artifact ids run() takes, in order; each is a `--<input> ID` flag
    output: str                         # the artifact kind it writes
    hardware: Hardware                  # the image and work pool it runs on (DESIGN.md)
    help: str
    options: tuple[Option, ...] = ()    # keyword options of run()
    #: CLI-only arguments, read by `hook` (a function of the step module) before the store is opened:
    #: `hook(cfg, args) -> int | None`; an int ends the command with that exit code, None goes on to run().
    cli_args: tuple[Option, ...] = ()
    hook: str | None = None
    #: a function of the step module `(manifest) -> int` for a step whose result is a verdict (gate).
    exit_code: str | None = None
    #: torchrun-aware: only rank 0 prints, and the process group is shut down however run() ends.
    distributed: bool = False
    description: str = field(default="", repr=False)

    @property
    def module(self) -> str:
        return f"steps.{self.name}"

    @property
    def option_names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.options)


_ROWS = (
    Step("target", (), "target", "cpu",
         "make the target artifact (SmolLM2 from its package, tiny, or a local HF dir)"),
    Step("datagen", ("target",), "dataset", "gpu", "regenerate assistant turns with the target"),
    Step("extract", ("target", "dataset"), "hidden", "gpu",
         "capture aux + final hidden states in rounds under a disk budget", distributed=True),
    Step("mapping", ("dataset", "target"), "vocab", "cpu", "build the draft vocab map (d2t / t2d)"),
    Step("train", ("target", "hidden", "vocab"), "draft", "gpu",
         "train the EAGLE-3 draft with training-time test (several GPUs: torchrun -m steps.train)",
         distributed=True),
    Step("export", ("draft", "target"), "export", "cpu", "write SGLang and vLLM draft directories, strictly checked"),
    Step("verify", ("export", "target"), "verify", "gpu", "offline τ of an exported draft with the reference engine"),
    Step("serve", ("export", "target"), "serve", "serve",
         "start SGLang for an export (flags derived, preflight-checked); --draft DIR launches a directory",
         options=(Option("env", "extra server environment", cli=False),),
         cli_args=(Option("draft", "an exported SGLang draft: its directory or export id; launch it and stay up "
                          "(no artifact; the target comes from the export's lineage)"),
                   Option("target_path", "the target model directory (default: the one the export was trained "
                                         "for, from the store)"),
                   Option("port", "override serve.port", type=int),
                   Option("disable_cuda_graph", "start with CUDA graphs off", flag=True),
                   Option("print_command", "print the launch command and exit", flag=True),
                   Option("log_dir", "where server logs go (default: out/serve)")),
         hook="launch_directory"),
    Step("benchmark", ("export", "target"), "benchmark", "serve",
         "baseline vs speculative tokens/s, live τ, latency; JSON, markdown, plot",
         options=(Option("baseline_url", "a running no-draft server (default: start one)"),
                  Option("spec_url", "a running speculative server (default: start one)"),
                  Option("attempt", "retry number, recorded in the artifact", type=int))),
    Step("gate", ("export", "target", "benchmark"), "gate", "serve",
         "promote the export if it beats production (exit 1 when it does not)",
         options=(Option("spec_url", "the externally run server that was benchmarked, if any"),),
         exit_code="exit_code"),
)
STEPS: dict[str, Step] = {s.name: s for s in _ROWS}


def skipped(step: str, cfg: Any) -> bool:
    """A step this config leaves out of the pipeline: extract, when train computes the hidden states online
    (`train.hidden_states: online`; train's `hidden` input is then the dataset the target runs over)."""
    return step == "extract" and cfg.train.hidden_states == "online"

#: the tools: their own argument shapes (a directory, not artifact ids), same `eaglenest` dispatch.
TOOLS: dict[str, str] = {
    "doctor": "diagnose any EAGLE-3 draft dir (and optionally a live server) against F1–F9",
    "convert": "convert a draft between the SGLang/official and speculators layouts",
    "plan": "before any GPU hour: tokens, bytes, disk rounds, hours per step, object-store bytes of a config",
}


def version() -> str:
    """The installed package's version; a source checkout that was never installed has CODE_VERSION."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("eaglenest")
    except PackageNotFoundError:
        from steps.lib.store import CODE_VERSION

        return CODE_VERSION


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """--config / --store / --set: the same flags, defaults and precedence for every step and flow CLI."""
    parser.add_argument("--config", default=DEFAULT_CONFIG,
                        help=f"a YAML config path or a name in configs/ (tiny, smollm2-135m); default {DEFAULT_CONFIG}")
    parser.add_argument("--store", default=None,
                        help="store URI (file://PATH or s3://BUCKET/PREFIX); default: $EAGLENEST_STORE, else the "
                             "config's `store`")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override a config field (repeatable); re-validated by the schema")


def parser_for(step: Step) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"eaglenest {step.name}", description=step.help)
    add_common_args(parser)
    for name in step.inputs:
        default = " (default: the target this config names)" if name == "target" else ""
        parser.add_argument(f"--{name}", default=None, metavar="ID", help=f"{name} artifact id{default}")
    for opt in (*step.options, *step.cli_args):
        if opt.cli:
            opt.add_to(parser)
    parser.add_argument("--json", action="store_true",
                        help="print the step's record as one JSON line: kind, id, uri, seconds, metrics, meta")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an expected error")
    parser.add_argument("--version", action="version", version=f"eaglenest {version()}")
    return parser


class UsageError(Exception):
    """An expected error: printed as one line with its fix, exit 2."""


def _expected_errors() -> tuple[type[BaseException], ...]:
    import yaml

    from steps.lib.config import ConfigError, InputError
    from steps.lib.store import ArtifactError

    return (UsageError, ConfigError, InputError, ArtifactError, OSError, json.JSONDecodeError, yaml.YAMLError,
            *_s3_errors())


def _s3_errors() -> tuple[type[BaseException], ...]:
    """botocore's errors of a store that cannot be reached or refuses us (only when boto3 is loaded: a
    file:// run never imports it)."""
    if "botocore" not in sys.modules:
        return ()
    from botocore.exceptions import BotoCoreError, ClientError

    return (BotoCoreError, ClientError)


def _one_line(err: BaseException) -> str:
    """The problem and its fix, on one line (URLs without their credentials)."""
    from steps.lib.config import ConfigError
    from steps.lib.runtime.redaction import redact_text
    from steps.lib.store import ArtifactError

    if isinstance(err, UsageError):
        return redact_text(str(err))
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:     # the file, its filesystem, what to change
        from steps.lib.files import disk_full_line

        return redact_text(disk_full_line(err))
    if isinstance(err, ConfigError):
        fix = "--config takes a name in configs/ or a YAML path; --set SECTION.FIELD=VALUE"
    elif isinstance(err, ArtifactError | FileNotFoundError):
        fix = "check the ids (each step prints the id it wrote; --json) and that --store is the store they are in"
    elif isinstance(err, ConnectionError | TimeoutError) or type(err).__name__ == "EndpointConnectionError":
        fix = ("check that the server or endpoint is up and its URL (an S3 store's: EAGLENEST_S3_ENDPOINT_URL "
               "or AWS_ENDPOINT_URL)")
    elif type(err).__name__ in ("NoCredentialsError", "ClientError"):
        fix = "check the S3 credentials (AWS_ACCESS_KEY_ID / AWS_PROFILE), the bucket and its permissions"
    elif type(err).__module__.startswith("botocore"):
        fix = ("the S3 store failed mid-request; re-run the step (what it uploaded is verified and resumed, "
               "and nothing half-written is ever committed)")
    elif isinstance(err, OSError):
        fix = "check the path and its permissions"
    else:
        fix = "fix the file it names"
    text = " ".join(str(err).split())  # a multi-line message (YAML marks) becomes the one line
    return redact_text(f"{text} — {fix}")


def _open_store(explicit: str | None, configured: str) -> Any:
    from steps.lib.store import open_store, store_uri_for

    uri = store_uri_for(explicit, configured)
    try:
        return open_store(uri)
    except ValueError as err:  # only the URI's shape: a ValueError from a step is a bug, not a usage error
        raise UsageError(f"{err} — pass --store file://PATH or s3://BUCKET/PREFIX, or set EAGLENEST_STORE") from err


def _input_ids(step: Step, args: argparse.Namespace, cfg: Any, store: Any) -> list[str]:
    ids = []
    for name in step.inputs:
        value = getattr(args, name)
        if value is None and name == "target":
            # the target is a function of the config: name it, never run the target step (a step never runs
            # another); the store says whether it exists
            from steps.lib.artifacts import target_artifact_id

            value = target_artifact_id(cfg)
            if not store.exists("target", value):
                raise UsageError(f"no target artifact {value} for {args.config} in {store.uri} — run `eaglenest "
                                 "target` with the same --config and --store first, or pass --target ID")
        producer = next(s.name for s in STEPS.values() if s.output == name)
        if value is None:
            raise UsageError(f"missing --{name} ID — pass the id `eaglenest {producer}` printed for this config")
        _check_input_id(store, name, value, producer)
        ids.append(value)
    return ids


def _check_input_id(store: Any, kind: str, value: str, producer: str) -> None:
    """An input id is exactly 16 hex digits (nothing path-like reaches the store) and names a committed
    artifact of that kind: its manifest says so (a hidden id passed as --draft is refused here)."""
    from steps.lib.store import ARTIFACT_ID

    if not ARTIFACT_ID.fullmatch(value):
        raise UsageError(f"--{kind} {value!r} is not an artifact id — ids are 16 hex digits, as `eaglenest "
                         f"{producer}` printed them (--json gives its record)")
    store.manifest(kind, value)


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _run(step: Step, args: argparse.Namespace) -> int:
    from steps.lib.config import find_config, load_config

    cfg = load_config(find_config(args.config), args.overrides)
    module = step_module(step)
    if step.hook is not None:
        code = getattr(module, step.hook)(cfg, args)
        if code is not None:
            return int(code)
    store = _open_store(args.store, cfg.store)
    ids = _input_ids(step, args, cfg, store)
    options = {o.name: getattr(args, o.name) for o in step.options if o.cli and getattr(args, o.name) is not None}
    start = time.perf_counter()
    try:
        manifest = module.run(cfg, store, *ids, **options)
    finally:
        if step.distributed:
            from steps.lib.runtime import distributed

            distributed.shutdown()
    if step.distributed and not _is_rank_zero():  # one answer per torchrun job
        return 0
    done = record(step.name, store, manifest, time.perf_counter() - start)
    if args.json:
        # one line: a flow running the step as a process reads it back (flows/step_process.py)
        print(json.dumps(done, default=str), flush=True)
    else:
        print(f"{step.name}: {manifest.kind} {manifest.id} in {done['seconds']:.1f} s → {done['uri']}")
    return int(getattr(module, step.exit_code)(manifest)) if step.exit_code else 0


def step_module(step: Step) -> Any:
    """The step's module. Under `python -m steps.<step>` it is already running as `__main__`: that module,
    not a second import of the same file (which would execute it twice and give its classes two
    identities, so an error raised by one copy would not be the other's)."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) == step.module:
        return main
    return importlib.import_module(step.module)


def record(step: str, store: Any, manifest: Any, seconds: float) -> dict[str, Any]:
    """What a step run returns to whoever ran it (`--json`, the step flows): the artifact's kind, id and URI,
    the seconds `run()` took, its metrics and meta (the gate's decision, serve's endpoint) — never a tensor."""
    return {"step": step, "kind": manifest.kind, "id": manifest.id,
            "uri": store.artifact_uri(manifest.kind, manifest.id), "seconds": round(seconds, 2),
            "metrics": manifest.metrics, "meta": manifest.meta}


# --- in-process calls (flows, benchmarks): a step's run() with its inputs by name -------------------------

def open_config(config: str, overrides: list[str] | None, store_uri: str | None) -> tuple[Any, Any]:
    """(the config, the store it names or `store_uri` overrides)."""
    from steps.lib.config import find_config, load_config
    from steps.lib.store import open_store, store_uri_for

    cfg = load_config(find_config(config), overrides)
    return cfg, open_store(store_uri_for(store_uri, cfg.store))


def call_step(step: str, cfg: Any, store: Any, inputs: dict[str, str],
              options: dict[str, Any] | None = None) -> dict[str, Any]:
    """`steps.<step>.run(cfg, store, *inputs, **options)` -> its record (id, uri, seconds, metrics, meta)."""
    row = STEPS[step]
    check_call(step, inputs, options)
    module = step_module(row)
    start = time.perf_counter()
    manifest = module.run(cfg, store, *(inputs[n] for n in row.inputs),
                          **{k: v for k, v in (options or {}).items() if v is not None})
    return record(step, store, manifest, time.perf_counter() - start)


def check_call(step: str, inputs: dict[str, str], options: dict[str, Any] | None) -> None:
    """A step call names every artifact id the step's run() takes and only options it accepts (in-process
    here, or as a process: flows/step_process.py)."""
    row = STEPS[step]
    missing = [n for n in row.inputs if n not in inputs]
    if missing:
        raise ValueError(f"step {step!r} needs artifact ids {list(row.inputs)}; missing {missing}")
    unknown = sorted(set(options or {}) - set(row.option_names))
    if unknown:
        raise ValueError(f"step {step!r} takes options {list(row.option_names)}; got unknown {unknown}")


def run_step(step: str, config: str, overrides: list[str] | None, store_uri: str | None,
             inputs: dict[str, str], options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load the config, open the store, call the step (no Prefect: benchmarks run this on the GPU machine)."""
    cfg, store = open_config(config, overrides, store_uri)
    return call_step(step, cfg, store, inputs, options)


def step_main(name: str, argv: list[str] | None = None) -> int:
    """The CLI of step `name`; returns the exit code (0, 1 for a gate that refuses, 2 for a usage error)."""
    step = STEPS[name]
    args = parser_for(step).parse_args(sys.argv[1:] if argv is None else argv)
    # steps log their progress (rounds, losses) with `logging`: to stderr, so stdout is only the result
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    from steps.lib.runtime import progress
    from steps.lib.runtime.processes import install_reaper
    from steps.lib.runtime.redaction import install_log_redaction

    install_reaper()          # a SIGTERM stops the servers this step starts, from whichever thread
    install_log_redaction()   # a server URL's user-info or token never reaches a log line
    progress.install_from_environment()
    try:
        return _run(step, args)
    except _expected_errors() as err:
        if args.debug:
            raise
        print(f"eaglenest {name}: {_one_line(err)}", file=sys.stderr)
        return 2


__all__ = ["DEFAULT_CONFIG", "Option", "Step", "STEPS", "TOOLS", "add_common_args", "call_step", "check_call",
           "open_config", "parser_for", "record", "run_step", "step_main", "step_module", "version",
           "UsageError"]
