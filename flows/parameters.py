"""The parameters of every eaglenest flow: one description each (the deployment's Run form shows it), and
their check before any step runs.

`described(fn)` writes a flow function's `Args:` section from `DESCRIPTIONS` (Prefect reads descriptions from
the docstring), so a parameter without a description cannot be deployed: it raises at import.

`check_pipeline(...)` loads the config with its overrides, opens the store and checks the rest; a parameter
that does not hold raises `BadParameter`: one line with the parameter, what the CLI would say (the file and
the field) and the fix as `-p NAME=...`. The flow returns it as its Failed state's message before any step
runs (no child run, no traceback: `Outcome`, `QuietOutcomes`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlparse

from steps.lib.config import PipelineConfig, find_config, load_config
from steps.lib.data.prompts import dataset_file, split_dataset_uri
from steps.lib.errors import ConfigError, InputError
from steps.lib.runtime.redaction import redact_text
from steps.lib.store import open_store, store_uri_for

#: where a step runs in `mode="deployments"` (flows/prefect_setup.py INFRASTRUCTURE: the pools' kinds)
POOL_KINDS = ("local", "docker", "k8s")

#: every parameter of every eaglenest flow, in the words the Run form shows
DESCRIPTIONS: dict[str, str] = {
    "config": "a config shipped in configs/ by name (tiny, smollm2-135m, llama-3.1-8b-instruct, ...) or the "
              "path of a YAML config",
    "overrides": 'config fields to change, each "SECTION.FIELD=VALUE" (e.g. ["train.epochs=2"]); checked '
                 "against the schema before any step runs",
    "store": "artifact store: file:///abs/path, a plain folder path, or s3://bucket/prefix (default: "
             "$EAGLENEST_STORE, else the config's `store`)",
    "mode": "deployments: each step its own flow run (a subflow on the local pool); local: every step inside "
            "this run's process",
    "pool": "where each step runs with mode=deployments: local (this machine), docker or k8s (the deployment "
            "<step>/<step>-<pool> on the pool of its hardware class)",
    "dataset": "store URI of an uploaded prompt file (<store>/datasets/<name>/<file>) that replaces the "
               "config's dataset.sources; the upload trigger fills it in",
    "spec_url": "a speculative server someone else runs, to benchmark instead of starting one (http://host:port)",
    "baseline_url": "a no-draft server someone else runs, to compare with instead of starting one",
    "through": "gate: the whole chain; verify: stop after the offline τ (no server, no gate)",
    "reuse": "answer steps whose artifact is already stored from the store's call index, without a child run "
             "(false: every step its own run)",
    "inputs": 'the step\'s input artifact ids by name, as its CLI flags take them ({"target": "<16 hex digits>"})',
    "options": "the step's keyword options (benchmark: spec_url, baseline_url, attempt; gate: spec_url)",
    "isolated": "run the step as its own `python -m steps.<step>` process (the pipeline's subflows do)",
    "flow_run_id": "the run that failed or crashed (prefect.flow-run.<id>); the automation fills it in",
    "reason": "why the rollback was started (the event's name); shown in its report",
}

F = TypeVar("F", bound=Callable[..., Any])


def described(fn: F) -> F:
    """`fn` with an `Args:` section for each of its parameters, from DESCRIPTIONS (KeyError naming a
    parameter that has none)."""
    names = list(inspect.signature(fn).parameters)
    missing = [n for n in names if n not in DESCRIPTIONS]
    if missing:
        raise KeyError(f"{fn.__qualname__}: no description for parameter(s) {missing} in flows/parameters.py "
                       "DESCRIPTIONS")
    doc = inspect.cleandoc(fn.__doc__ or "")
    fn.__doc__ = doc + "\n\nArgs:\n" + "\n".join(f"    {n}: {DESCRIPTIONS[n]}" for n in names)
    return fn


class BadParameter(ValueError):
    """A parameter of a run that does not hold: its name, why (one line) and what to pass instead."""

    def __init__(self, name: str, problem: str, fix: str):
        text = " ".join(str(problem).split())    # a schema error lists its fields on lines of their own
        super().__init__(redact_text(f"parameter {name}: {text} — {fix}"))
        self.name = name


def check_config(config: str, overrides: list[str] | None) -> PipelineConfig:
    """The config with its overrides, or BadParameter naming `config` (the file alone does not load) or
    `overrides` (it does, and an override breaks it)."""
    path = find_config(config)
    try:
        base = load_config(path)
    except ConfigError as err:
        raise BadParameter("config", err, "pass -p config=NAME (a shipped one) or the path of a YAML config") \
            from None
    if not overrides:
        return base
    try:
        return load_config(path, overrides)
    except ConfigError as err:
        raise BadParameter("overrides", err, "pass -p overrides='[\"SECTION.FIELD=VALUE\", ...]'") from None


def check_store(store: str | None, cfg: PipelineConfig) -> str:
    """The store URI a run uses (explicit > $EAGLENEST_STORE > the config's), opened once; BadParameter."""
    uri = store_uri_for(store, cfg.store)
    try:
        return open_store(uri).uri
    except (ValueError, OSError) as err:
        raise BadParameter("store", err, "pass -p store=file:///abs/path (or a plain path) or "
                                         "s3://bucket/prefix") from None


def check_url(name: str, url: str | None) -> None:
    if url is None:
        return
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise BadParameter(name, f"{url!r} is not a server address",
                           f"pass -p {name}=http://HOST:PORT of a running server, or leave it out to start one")


def check_dataset(dataset: str, config: str, overrides: list[str]) -> PipelineConfig:
    """The config with the dataset in place of its sources (`overrides` include it), once the dataset's object
    exists; else BadParameter naming `dataset`."""
    fix = "pass the URI `eaglenest dataset upload` printed (`eaglenest dataset list` shows them)"
    try:
        if "://" in dataset and "/datasets/" in dataset:       # an uploaded object: asked, not fetched
            root, key = split_dataset_uri(dataset)
            if open_store(root).stat(key) is None:
                raise InputError(f"{dataset}: no such object in the store")
        elif not dataset_file(dataset).exists():
            raise InputError(f"{dataset}: no such file or folder")
        return load_config(find_config(config), overrides)
    except (InputError, ConfigError, ValueError, OSError) as err:
        raise BadParameter("dataset", err, fix) from None


def check_pipeline(*, config: str, overrides: list[str], store: str | None, mode: str, pool: str,
                   spec_url: str | None, baseline_url: str | None, through: str) -> tuple[PipelineConfig, str]:
    """(the config, the store URI) of a pipeline run whose every parameter holds; else BadParameter."""
    for name, value, allowed in (("mode", mode, ("local", "deployments")), ("pool", pool, POOL_KINDS),
                                 ("through", through, ("verify", "gate"))):
        if value not in allowed:
            raise BadParameter(name, f"{value!r} is not one of {', '.join(allowed)}", f"pass -p {name}={allowed[0]}")
    cfg = check_config(config, overrides)
    check_url("spec_url", spec_url)
    check_url("baseline_url", baseline_url)
    return cfg, check_store(store, cfg)


# --- an expected end of a run: its message, never a traceback ------------------------------------------

class Outcome(Exception):
    """The data of a Failed state a flow returns on purpose (a parameter refused, a verdict): Prefect raises it
    when it reads the run's result at the end, and `QuietOutcomes` keeps that from logging a traceback."""


class Refused(Outcome):
    """The Outcome of a run refused for a parameter: the CLIs that run the flow print it and exit 2."""


class QuietOutcomes(logging.Filter):
    """Drops the engine's "exited with unexpected exception" record (and its traceback) when the exception is
    an `Outcome`: the run's state message already says it in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, Outcome)


def install_quiet_outcomes() -> None:
    """On the loggers the flow engine reports a run's end with (a flow run's, the engine's own)."""
    for name in ("prefect.flow_runs", "prefect.engine"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, QuietOutcomes) for f in logger.filters):
            logger.addFilter(QuietOutcomes())
