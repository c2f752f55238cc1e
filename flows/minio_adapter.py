"""MinIO → Prefect: a bucket notification on `datasets/` becomes the `eaglenest.dataset.uploaded` event.

    python -m flows.minio_adapter --store s3://eaglenest [--host 127.0.0.1] [--port 8080]

MinIO's webhook target POSTs one S3-style notification per created object (`{"EventName", "Key",
"Records": [{"eventName", "s3": {"bucket": {"name"}, "object": {"key", "size", "eTag"}}}]}`, the
object key URL-encoded). For every record that names a dataset object (`datasets/<name>/<file name>`, or
`datasets/<pipeline>/<name>/<file name>`: `flows/dataset_trigger.py` says which pipeline trains on it)
under the store root, this service builds the event with `flows.dataset_trigger.dataset_event` — the same
builder the `eaglenest dataset upload` CLI and the `dataset-sensor` flow use, so the same object
version gets the same event id and Prefect starts one run — and sends it with
`flows.dataset_trigger.announce` to `$PREFECT_API_URL/events` (skipping object versions the CLI or the
sensor already announced: one version, one run, whichever path saw it first).

Reads: notifications over HTTP (`POST /`, any path); `GET /health` answers 200.
Writes: events to the Prefect API; nothing else. A record outside `datasets/<name>/` or not a
creation is ignored (and logged). When Prefect cannot be reached the answer is 502, so MinIO keeps
the notification in its queue and delivers it again. With `--token` (or EAGLENEST_ADAPTER_TOKEN)
a request must carry `Authorization: Bearer <token>`, which MinIO sends when the webhook target
is configured with the same `auth_token`.
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote_plus

from flows.dataset_trigger import PREFIX, announce, dataset_event, parse_key
from steps.lib.store import Store, open_store

log = logging.getLogger("eaglenest.minio_adapter")

#: MinIO's event names for a new object version (Put, Post, Copy, CompleteMultipartUpload).
CREATED_PREFIX = "s3:ObjectCreated:"
#: a notification is a few KB; anything far larger is not one.
MAX_BODY_BYTES = 1 << 20


# --- notification → events (pure) ---------------------------------------------------------------------

def dataset_key(store: Store, bucket: str, object_key: str) -> str | None:
    """The key under the store root if the object is a dataset (`datasets/[<pipeline>/]<name>/<file>`) in the
    store's bucket, else None."""
    store_bucket, _, prefix = store.uri.removeprefix("s3://").partition("/")
    if bucket != store_bucket:
        return None
    key = unquote_plus(object_key)  # MinIO URL-encodes keys in records (`datasets%2Fa%2Fb.jsonl`)
    if prefix:
        if not key.startswith(prefix + "/"):
            return None
        key = key[len(prefix) + 1:]
    return key if parse_key(key) else None


def events_from_notification(notification: dict[str, Any], store: Store) -> list[dict[str, Any]]:
    """One `eaglenest.dataset.uploaded` event per created `datasets/<name>/<file>` object in the notification."""
    events = []
    for record in notification.get("Records") or []:
        name = record.get("eventName", "")
        s3 = record.get("s3") or {}
        bucket = (s3.get("bucket") or {}).get("name", "")
        obj = s3.get("object") or {}
        key = dataset_key(store, bucket, obj.get("key", "")) if name.startswith(CREATED_PREFIX) else None
        if key is None:
            log.info("ignored %s on %s/%s: not a new object under %s/%s/<name>/", name or "?", bucket,
                     obj.get("key"), store.uri, PREFIX)
            continue
        version = str(obj.get("eTag", "")).strip('"')  # S3 quotes ETags in headers; MinIO's records do not
        if not version:
            raise ValueError(f"MinIO record for s3://{bucket}/{key}: field s3.object.eTag is missing; "
                             "the event id needs the object version")
        pipeline, dataset, _ = parse_key(key)
        events.append(dataset_event(store.object_uri(key), dataset, version, int(obj.get("size", 0)), store.uri,
                                    pipeline=pipeline))
    return events


# --- the HTTP service -----------------------------------------------------------------------------------

class AdapterServer(ThreadingHTTPServer):
    """Holds what every request needs: the store (for URIs), the Prefect API URL, the optional token."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], *, store: Store, api_url: str, token: str | None):
        super().__init__(address, NotificationHandler)
        self.store, self.api_url, self.token = store, api_url, token


class NotificationHandler(BaseHTTPRequestHandler):
    server: AdapterServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._answer(200 if self.path.split("?")[0] == "/health" else 404, {"ok": True})

    def do_POST(self) -> None:  # noqa: N802
        if not self._authorized():
            self._answer(401, {"error": "missing or wrong Authorization: Bearer token"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self._answer(413, {"error": f"body of {length} bytes; a MinIO notification is a few KB"})
            return
        try:
            notification = json.loads(self.rfile.read(length) or b"{}")
            events = events_from_notification(notification, self.server.store)
        except (ValueError, TypeError, AttributeError) as err:
            self._answer(400, {"error": f"not a MinIO bucket notification: {err}"})
            return
        try:
            events = announce(self.server.api_url, events)
        except ConnectionError as err:
            log.error("%s", err)
            self._answer(502, {"error": str(err)})  # MinIO retries from its queue
            return
        for event in events:
            log.info("event %s for %s (version %s)", event["id"], event["payload"]["uri"], event["payload"]["version"])
        self._answer(200, {"events": [e["id"] for e in events]})

    def _authorized(self) -> bool:
        if not self.server.token:
            return True
        given = self.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.server.token}".encode())

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        log.debug(format, *args)


def make_server(host: str, port: int, *, store: str, api_url: str, token: str | None = None) -> AdapterServer:
    """The adapter bound to host:port (port 0 picks a free one: `server.server_address[1]`)."""
    opened = open_store(store)
    if not opened.uri.startswith("s3://"):
        raise ValueError(f"--store {store!r}: MinIO notifications name S3 objects; expected s3://BUCKET[/PREFIX]")
    return AdapterServer((host, port), store=opened, api_url=api_url, token=token)


class _StderrHandler(logging.Handler):
    """Writes to `sys.stderr` as it is when the line is written (a StreamHandler keeps the stream it was
    made with, which may be closed by then: a test's captured stderr)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 — logging must never raise
            self.handleError(record)


def _log_to_stderr() -> None:
    """The adapter's own lines on stderr. Its own handler, not the root logger's: importing Prefect has already
    configured logging (so `basicConfig` would do nothing), and replacing the root handlers would re-route
    every other logger of the process (Prefect's included)."""
    if not log.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flows.minio_adapter", description=__doc__.splitlines()[0])
    p.add_argument("--store", default=os.environ.get("EAGLENEST_STORE"),
                   help="the store the bucket holds, s3://BUCKET[/PREFIX] (default: $EAGLENEST_STORE)")
    p.add_argument("--api-url", default=os.environ.get("PREFECT_API_URL"),
                   help="the Prefect API, e.g. http://prefect-server:4200/api (default: $PREFECT_API_URL)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (compose: 0.0.0.0 inside its network)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--token", default=os.environ.get("EAGLENEST_ADAPTER_TOKEN") or None,
                   help="require `Authorization: Bearer TOKEN` (MinIO's webhook auth_token); default: "
                        "$EAGLENEST_ADAPTER_TOKEN")
    args = p.parse_args(argv)
    _log_to_stderr()
    missing = [flag for flag, value in (("--store", args.store), ("--api-url", args.api_url)) if not value]
    if missing:
        print(f"minio_adapter: {' and '.join(missing)} not given and not in the environment "
              "(EAGLENEST_STORE, PREFECT_API_URL)", file=sys.stderr)
        return 2
    try:
        server = make_server(args.host, args.port, store=args.store, api_url=args.api_url, token=args.token)
    except ValueError as err:
        print(f"minio_adapter: {err}", file=sys.stderr)
        return 2
    log.info("listening on http://%s:%d for notifications on %s/%s/, events to %s", *server.server_address[:2],
             server.store.uri, PREFIX, args.api_url)
    # Ctrl-C and `docker stop` (SIGTERM) end it cleanly, also where it was started with SIGINT ignored
    # (a shell's background job: Python then installs no KeyboardInterrupt handler of its own)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
