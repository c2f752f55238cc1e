"""The `eaglenest` console script: one entry point, dispatching to each step's `main(argv)`.

    eaglenest <step> --config configs/tiny.yaml [--store URI] [--set section.field=value ...]

Step commands run the step module in this process (no Prefect needed, as in a container);
`pipeline` and `demo` run the Prefect flow. Flags shared by every step are defined once here.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from steps.config import ConfigError, PipelineConfig, find_config, load_config
from steps.store import Store, open_store, store_uri_for

#: command → (module with a `main(argv) -> int`, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "target": ("steps.target", "make the target artifact (SmolLM2 from its package, tiny, or a local HF dir)"),
    "datagen": ("steps.datagen", "regenerate assistant turns with the target"),
    "extract": ("steps.extract", "capture aux + final hidden states in rounds under a disk budget"),
    "mapping": ("steps.mapping", "build the draft vocab map (d2t / t2d)"),
    "train": ("steps.train", "train the EAGLE-3 draft with training-time test"),
    "export": ("steps.export", "write SGLang and vLLM draft directories, strictly checked"),
    "verify": ("steps.verify", "offline τ of an exported draft with the reference engine"),
    "serve": ("steps.serve", "derive the SGLang launch command from an export, preflight it, launch it"),
    "benchmark": ("steps.benchmark", "baseline vs speculative tokens/s, live τ, latency; JSON, markdown, plot"),
    "doctor": ("steps.doctor", "diagnose any EAGLE-3 draft dir (and optionally a live server) against F1–F9"),
    "convert": ("steps.convert", "convert a draft between the SGLang/official and speculators layouts"),
    "pipeline": ("flows.pipeline_cli", "run the whole chain as a Prefect flow"),
    "demo": ("flows.demo", "the whole chain on the embedded default, with a summary"),
    "stack": ("flows.stack", "a local Prefect server + worker with every deployment registered (up|down|status)"),
    "dataset": ("flows.dataset_trigger", "upload a dataset to the store and start a pipeline run (upload|list)"),
}


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """--config / --store / --set, shared by every step CLI."""
    parser.add_argument("--config", default="configs/tiny.yaml",
                        help="a YAML config path or a name in configs/ (e.g. tiny, smollm2-135m)")
    parser.add_argument("--store", default=None,
                        help="store URI (file://PATH or s3://BUCKET/PREFIX); default: EAGLENEST_STORE or the config's")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override a config field (repeatable); re-validated by the schema")


def config_and_store(args: argparse.Namespace) -> tuple[PipelineConfig, Store]:
    cfg = load_config(find_config(args.config), args.overrides)
    return cfg, open_store(store_uri_for(args.store, cfg.store))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: eaglenest <command> [options]\n\ncommands:")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:10s} {help_text}")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"eaglenest: unknown command {command!r}; known: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    try:
        return int(module.main(rest) or 0)
    except ConfigError as err:
        print(f"eaglenest {command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
