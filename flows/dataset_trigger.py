"""New datasets start pipeline runs: `eaglenest dataset upload|list` and the `dataset-sensor` flow.

    eaglenest dataset upload prompts.jsonl --name support-chats [--pipeline smollm2] [--store URI] [--no-event]
    eaglenest dataset list [--store URI]

`upload` reads a local JSONL or parquet prompt file, refuses it unless `steps.lib.data.prompts` can read
every row (the error names the line and the field; nothing is uploaded), puts it under the store
root and emits the event `eaglenest.dataset.uploaded` to the Prefect API.

Which pipeline trains on it is chosen by the object's prefix (the same for every way in: this CLI,
`aws s3 cp`, the MinIO console):

    datasets/<name>/<file name>              the default pipeline, `tiny` (DEFAULT_PIPELINE)
    datasets/<pipeline>/<name>/<file name>   `<pipeline>` one of PIPELINES: `tiny`, `smollm2`

The event's resource carries the label `eaglenest.pipeline: <pipeline>`, and each `eagle3-pipeline`
deployment's trigger matches its own (deploy/prefect.yaml), so the run has `dataset=<the object's URI>`
on the deployment of that pipeline; the run is named after the dataset (`support-chats/prompts.jsonl`).
The `dataset-sensor` flow lists `datasets/` and emits the same event for objects that arrived by other
means into a store that sends no notifications (a plain copy into a file store); its schedule is off
by default (no run every few minutes): run it by hand, or resume its schedule.

One object version, one run. The event id is `uuid5(NAMESPACE_URL, f"{uri}@{version}")`
(version = the object's ETag, md5 hex; the file store computes the md5), so the CLI, the sensor
and the MinIO adapter emit the same event for the same bytes. That id is only the second line of
defence: Prefect 3.9.1's trigger service remembers seen event ids in memory, for 30 minutes, and
forgets them on a server restart (verified: the same id posted after a restart started a second
run). The first line is a Prefect Variable per announced version, `eaglenest-dataset-<event id>`,
written after the event is accepted and read before any event is sent.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import os
import re
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
from prefect import flow, get_run_logger
from prefect.settings import get_current_settings

from flows.parameters import described
from steps.lib.config import find_config, load_config
from steps.lib.data.prompts import DEFAULT_MAX_PROMPT_TOKENS, load_file, row_byte_bound
from steps.lib.data.size import answers_of, size_warning
from steps.lib.store import Store, md5_file, open_store

EVENT = "eaglenest.dataset.uploaded"
#: objects live at datasets/<name>/<file name> under the store root (ARCHITECTURE.md, Orchestration).
PREFIX = "datasets"
#: what `steps.lib.data.prompts.load_file` reads as a single file (.json is read as JSONL there too).
DATASET_SUFFIXES = (".jsonl", ".json", ".parquet")
#: dataset prefix → `eagle3-pipeline` deployment whose trigger starts on it (deploy/prefect.yaml matches the
#: label `eaglenest.pipeline`); objects right under `datasets/<name>/` go to DEFAULT_PIPELINE.
PIPELINES = ("tiny", "smollm2")
DEFAULT_PIPELINE = "tiny"
#: the config each pipeline's deployment trains with (deploy/prefect.yaml: its trigger's `config`)
PIPELINE_CONFIGS = {"tiny": "configs/tiny.yaml", "smollm2": "configs/smollm2-135m.yaml"}
#: a dataset name is one path segment and part of the event's resource id.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: one Variable per announced object version (a Variable value holds at most 5000 characters,
#: too few for one list of every version ever seen).
VARIABLE_PREFIX = "eaglenest-dataset-"
API_TIMEOUT_S = 30.0


# --- the event: the contract shared with the MinIO adapter and the deployment trigger -------------------

def event_id(uri: str, version: str) -> str:
    """The same object version always gives the same event id."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"{uri}@{version}"))


def dataset_event(uri: str, name: str, version: str, size: int, store: str,
                  pipeline: str = DEFAULT_PIPELINE) -> dict[str, Any]:
    """The `eaglenest.dataset.uploaded` event for one object version, as the JSON Prefect accepts."""
    return {
        "id": event_id(uri, version),
        "occurred": dt.datetime.now(dt.UTC).isoformat(),
        "event": EVENT,
        "resource": {"prefect.resource.id": f"eaglenest.dataset.{name}", "prefect.resource.name": name,
                     "eaglenest.pipeline": pipeline},
        "payload": {"uri": uri, "name": name, "version": version, "size": int(size), "store": store,
                    "pipeline": pipeline},
    }


def dataset_key(pipeline: str, name: str, file_name: str) -> str:
    """Where a dataset for `pipeline` lives under the store root (the default pipeline's needs no prefix)."""
    middle = "" if pipeline == DEFAULT_PIPELINE else f"{pipeline}/"
    return f"{PREFIX}/{middle}{name}/{file_name}"


def parse_key(key: str) -> tuple[str, str, str] | None:
    """(pipeline, name, file name) of a dataset key under the store root; None for any other key."""
    parts = key.split("/")
    if parts[0] != PREFIX or not all(parts) or len(parts) not in (3, 4):
        return None
    if len(parts) == 3:
        return DEFAULT_PIPELINE, parts[1], parts[2]
    return (parts[1], parts[2], parts[3]) if parts[1] in PIPELINES else None


def api_request(api_url: str, method: str, path: str, *, ok: tuple[int, ...] = (), **kwargs: Any) -> httpx.Response:
    """One call to the Prefect REST API; ConnectionError (naming the URL and the answer) on failure
    or on a status >= 300 that is not in `ok`."""
    headers = {}
    auth = os.environ.get("PREFECT_API_AUTH_STRING")  # a server started with basic auth
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    url = f"{api_url.rstrip('/')}{path}"
    try:
        response = httpx.request(method, url, headers=headers, timeout=API_TIMEOUT_S, **kwargs)
    except httpx.HTTPError as err:
        raise ConnectionError(f"cannot reach the Prefect API at {url}: {err}; is the server up "
                              "(`eaglenest stack status`)?") from None
    if response.status_code >= 300 and response.status_code not in ok:
        raise ConnectionError(f"{method} {url}: HTTP {response.status_code}: {response.text[:300]}")
    return response


def post_events(api_url: str, events: list[dict[str, Any]]) -> None:
    """POST events to `{api_url}/events`; raises ConnectionError unless the server accepts them."""
    if events:
        api_request(api_url, "POST", "/events", json=events)


def prefect_api_url() -> str | None:
    """PREFECT_API_URL from the environment or the active Prefect profile."""
    return get_current_settings().api.url


# --- memory of announced versions ---------------------------------------------------------------------
# Plain REST calls on `api_url` (not prefect.variables, which follows the active profile), so whoever
# posts the events — the CLI, the sensor, the MinIO adapter — records them on the same server.

def variable_name(event: dict[str, Any]) -> str:
    return f"{VARIABLE_PREFIX}{event['id']}"


def was_announced(api_url: str, event: dict[str, Any]) -> bool:
    response = api_request(api_url, "GET", f"/variables/name/{variable_name(event)}", ok=(404,))
    return response.status_code == 200


def remember_announced(api_url: str, events: list[dict[str, Any]]) -> None:
    for event in events:
        value = {k: event["payload"][k] for k in ("uri", "version", "size")} | {"announced": event["occurred"]}
        # 409: another announcer recorded the same version first, which is just as good.
        api_request(api_url, "POST", "/variables/", json={"name": variable_name(event), "value": value,
                                                          "tags": ["eaglenest", "dataset"]}, ok=(409,))


def announce(api_url: str, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Send the events not announced before, then remember them; returns those sent."""
    new = [e for e in events if not was_announced(api_url, e)]
    post_events(api_url, new)
    remember_announced(api_url, new)  # after the POST: a crash in between re-sends the same id, never loses one
    return new


# --- the store side -----------------------------------------------------------------------------------

def check_name(name: str) -> str:
    if not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"dataset name {name!r}: use letters, digits, '.', '_' or '-' (at most 128, not "
                         "starting with '.', '_' or '-'); it becomes datasets/<name>/ and the event's resource id")
    if name in PIPELINES:
        raise ValueError(f"dataset name {name!r} is a pipeline's prefix (datasets/{name}/<name>/); pick another "
                         f"name, and --pipeline {name} to train that pipeline on it")
    return name


def check_dataset(path: Path, max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS) -> int:
    """The number of prompts in a dataset file; raises, naming the line and field, unless every row reads. The
    file is read a line at a time; a row over `row_byte_bound(max_prompt_tokens)` is refused unparsed."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (a JSONL or parquet prompt dataset)")
    if path.suffix not in DATASET_SUFFIXES:
        raise ValueError(f"{path}: unknown dataset format {path.suffix!r}; expected one of {DATASET_SUFFIXES}")
    return len(load_file(path, max_prompt_tokens))


def dataset_record(store: Store, key: str, stat: dict[str, Any]) -> dict[str, Any]:
    pipeline, name, file_name = parse_key(key) or ("?", "?", "?")
    return {"name": name, "file": file_name, "key": key, "uri": store.object_uri(key), "pipeline": pipeline,
            "size": stat["size"], "version": stat["etag"]}


def list_datasets(store: Store) -> list[dict[str, Any]]:
    """Every dataset object (`datasets/[<pipeline>/]<name>/<file>`) with its size and version; other keys
    are skipped."""
    keys = [k for k in store.list_objects(f"{PREFIX}/") if parse_key(k)]
    records = []
    for key in keys:
        stat = store.stat(key)
        if stat is not None:  # deleted between list and stat
            records.append(dataset_record(store, key, stat))
    return records


def upload_dataset(store: Store, path: Path, name: str,
                   pipeline: str = DEFAULT_PIPELINE) -> tuple[dict[str, Any], bool]:
    """Put a checked file at datasets/[<pipeline>/]<name>/<file name>; returns its record and whether bytes
    were sent. The same bytes already there are not sent again (same version, same event id)."""
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline {pipeline!r}: one of {', '.join(PIPELINES)} (the eagle3-pipeline deployments "
                         "with a dataset trigger)")
    key = dataset_key(pipeline, check_name(name), path.name)
    before = store.stat(key)
    if before is not None and before["etag"] == md5_file(path):
        return dataset_record(store, key, before), False
    return dataset_record(store, key, store.put_object(key, path)), True


def event_for(store: Store, record: dict[str, Any]) -> dict[str, Any]:
    return dataset_event(record["uri"], record["name"], record["version"], record["size"], store.uri,
                         pipeline=record["pipeline"])


# --- the sensor ---------------------------------------------------------------------------------------

@flow(name="dataset-sensor")
@described
def dataset_sensor(store: str | None = None) -> list[str]:
    """Emit `eaglenest.dataset.uploaded` once per object version under datasets/; returns the ids sent."""
    logger = get_run_logger()
    st = open_store(store)
    api_url = prefect_api_url()
    if not api_url:
        raise RuntimeError("dataset-sensor: no Prefect API configured (PREFECT_API_URL)")
    records = list_datasets(st)
    sent = announce(api_url, [event_for(st, r) for r in records])
    for event in sent:
        logger.info("new dataset version %s (%s): event %s", event["payload"]["uri"], event["payload"]["version"],
                    event["id"])
    logger.info("%d dataset objects under %s/%s/, %d new", len(records), st.uri, PREFIX, len(sent))
    return [e["id"] for e in sent]


# --- CLI ----------------------------------------------------------------------------------------------

NO_API = ("no Prefect API configured: set PREFECT_API_URL (`eaglenest stack up` prints it), or pass --no-event "
          "and let the dataset-sensor deployment announce the file")


def too_small(rows: int, pipeline: str, file_name: str) -> str | None:
    """The warning for a dataset far below what its pipeline's config needs (steps/lib/data/size.py), or None."""
    cfg = load_config(find_config(PIPELINE_CONFIGS[pipeline]))
    return size_warning(answers_of(rows, cfg), cfg, what=f"{file_name} for eagle3-pipeline/{pipeline}")


def cmd_upload(args: argparse.Namespace) -> int:
    path = Path(args.file)
    try:
        check_name(args.name)
        rows = check_dataset(path, args.max_prompt_tokens)
    except (ValueError, FileNotFoundError) as err:
        print(f"eaglenest dataset upload: {' '.join(str(err).split())}; nothing was uploaded", file=sys.stderr)
        return 2
    api_url = None if args.no_event else prefect_api_url()
    if not args.no_event and not api_url:
        print(f"eaglenest dataset upload: {NO_API}; nothing was uploaded", file=sys.stderr)
        return 2
    store = open_store(args.store)
    record, sent = upload_dataset(store, path, args.name, args.pipeline)
    what = "uploaded" if sent else "already in the store (same bytes, not sent again)"
    print(f"{record['uri']}: {what}; {rows} prompts, {record['size']} bytes, version {record['version']}")
    small = too_small(rows, args.pipeline, path.name)
    if small:
        print(f"warning: {small}", file=sys.stderr)
    event = event_for(store, record)
    if args.no_event:
        print(f"no event sent (--no-event); the dataset-sensor will announce it as event {event['id']}")
        return 0
    try:
        new = announce(api_url, [event])
    except ConnectionError as err:
        print(f"eaglenest dataset upload: the file is in the store but the event was not sent: {err}\n"
              "run this command again once the server is up (nothing is uploaded twice), or let the "
              "dataset-sensor announce it", file=sys.stderr)
        return 1
    if new:
        print(f"event {EVENT} {event['id']} sent to {api_url}: eagle3-pipeline/{record['pipeline']} starts a run")
    else:
        print(f"event {event['id']} was announced before: this version already started its run; no second one")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    store = open_store(args.store)
    records = list_datasets(store)
    if not records:
        print(f"no datasets under {store.uri}/{PREFIX}/")
    for r in records:
        print(f"{r['pipeline']:8s} {r['name']:24s} {r['file']:28s} {r['size']:>12d} B  {r['version']}  {r['uri']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eaglenest dataset", description="upload prompt datasets that start runs")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("upload", help="check a JSONL/parquet prompt file, put it under datasets/, emit the event")
    up.add_argument("file", help="a local .jsonl or .parquet prompt dataset")
    up.add_argument("--name", required=True, help="dataset name: the object goes to datasets/<name>/<file name>")
    up.add_argument("--pipeline", default=DEFAULT_PIPELINE, choices=PIPELINES,
                    help=f"which eagle3-pipeline deployment trains on it (default {DEFAULT_PIPELINE}); "
                         "the object goes to datasets/<pipeline>/<name>/ for any but the default")
    up.add_argument("--no-event", action="store_true", help="upload only; the dataset-sensor announces it later")
    up.add_argument("--max-prompt-tokens", type=int, default=DEFAULT_MAX_PROMPT_TOKENS,
                    help=f"the pipeline's datagen.max_prompt_tokens (default {DEFAULT_MAX_PROMPT_TOKENS}): a row "
                         f"over {row_byte_bound(1)} bytes per token is refused")
    ls = sub.add_parser("list", help="datasets in the store with size and version")
    for p in (up, ls):
        p.add_argument("--store", default=None,
                       help="store URI (file://PATH or s3://BUCKET/PREFIX); default: EAGLENEST_STORE or file://out/store")
    args = parser.parse_args(argv)
    return cmd_upload(args) if args.command == "upload" else cmd_list(args)


if __name__ == "__main__":
    raise SystemExit(main())
