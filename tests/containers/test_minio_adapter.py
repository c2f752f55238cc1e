"""flows/minio_adapter.py: a MinIO bucket notification (the shape MinIO's webhook target POSTs, keys
URL-encoded) becomes the same `eaglenest.dataset.uploaded` event the CLI and the sensor emit, and the
service delivers it to a real Prefect server (the session's, on 127.0.0.1), where it can be read back; and
`python -m flows.minio_adapter` itself starts, serves, and stops on Ctrl-C, or refuses bad settings with exit 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from flows.dataset_trigger import EVENT, dataset_event
from flows.minio_adapter import events_from_notification, make_server
from steps.lib.store import open_store
from tests.builders import free_port

ETAG = "5d41402abc4b2a76b9719d911017c592"


def minio_notification(key: str, *, bucket: str = "eaglenest", event: str = "s3:ObjectCreated:Put",
                       etag: str = ETAG, size: int = 2048) -> dict:
    """One record as MinIO's webhook sends it (docs: "Bucket Notifications", event structure)."""
    return {
        "EventName": event,
        "Key": f"{bucket}/{key}",
        "Records": [{
            "eventVersion": "2.0", "eventSource": "minio:s3", "awsRegion": "", "eventTime": "2026-11-29T14:00:00.000Z",
            "eventName": event, "userIdentity": {"principalId": "eaglenest"},
            "requestParameters": {"principalId": "eaglenest", "region": "", "sourceIPAddress": "172.18.0.1"},
            "responseElements": {"x-amz-id-2": "dd9025bab4ad464b049177c95eb6ebf374d3b3fd1af9251148b658df7ac2e3e8",
                                 "x-amz-request-id": "187C3C5C0A1F2B3E", "x-minio-deployment-id": "d1f0",
                                 "x-minio-origin-endpoint": "http://172.18.0.3:9000"},
            "s3": {"s3SchemaVersion": "1.0", "configurationId": "Config",
                   "bucket": {"name": bucket, "ownerIdentity": {"principalId": "eaglenest"},
                              "arn": f"arn:aws:s3:::{bucket}"},
                   "object": {"key": urllib.request.quote(key, safe="").replace("%20", "+"), "size": size,
                              "eTag": etag, "contentType": "application/jsonl",
                              "userMetadata": {"content-type": "application/jsonl"}, "sequencer": "187C3C5C0A2E7D1A"}},
            "source": {"host": "172.18.0.1", "port": "", "userAgent": "MinIO (linux; amd64) minio-go/v7.0.95"},
        }],
    }


def without_time(event: dict) -> dict:
    return {k: v for k, v in event.items() if k != "occurred"}


# --- notification → event ------------------------------------------------------------------------------

def test_a_put_under_datasets_becomes_the_contract_event():
    store = open_store("s3://eaglenest")
    key = "datasets/support-chats/prompts v2.jsonl"
    [event] = events_from_notification(minio_notification(key), store)
    uri = "s3://eaglenest/datasets/support-chats/prompts v2.jsonl"
    assert without_time(event) == without_time(dataset_event(uri, "support-chats", ETAG, 2048, "s3://eaglenest"))
    assert event["event"] == EVENT
    assert event["id"] == str(uuid.uuid5(uuid.NAMESPACE_URL, f"{uri}@{ETAG}"))
    assert event["resource"]["prefect.resource.id"] == "eaglenest.dataset.support-chats"
    assert event["payload"] == {"uri": uri, "name": "support-chats", "version": ETAG, "size": 2048,
                                "store": "s3://eaglenest", "pipeline": "tiny"}


def test_a_put_under_a_pipelines_prefix_is_announced_for_that_pipeline():
    store = open_store("s3://eaglenest")
    [event] = events_from_notification(minio_notification("datasets/smollm2/support-chats/p.jsonl"), store)
    assert event["payload"]["pipeline"] == event["resource"]["eaglenest.pipeline"] == "smollm2"
    assert event["payload"]["name"] == "support-chats"
    assert events_from_notification(minio_notification("datasets/nosuch/support-chats/p.jsonl"), store) == []


def test_the_uri_is_the_stores_own_object_uri_so_cli_sensor_and_adapter_agree():
    store = open_store("s3://eaglenest/team-a/")
    [event] = events_from_notification(minio_notification("team-a/datasets/chats/p.jsonl"), store)
    assert event["payload"]["uri"] == store.object_uri("datasets/chats/p.jsonl") == "s3://eaglenest/team-a/datasets/chats/p.jsonl"
    assert event["payload"]["store"] == store.uri


@pytest.mark.parametrize(("key", "bucket", "event"), [
    ("datasets/chats/p.jsonl", "eaglenest", "s3:ObjectRemoved:Delete"),   # not a new object
    ("datasets/chats/p.jsonl", "other-bucket", "s3:ObjectCreated:Put"),   # another bucket
    ("datasets/p.jsonl", "eaglenest", "s3:ObjectCreated:Put"),            # no <name>/ folder
    ("datasets/chats/old/p.jsonl", "eaglenest", "s3:ObjectCreated:Put"),  # deeper than datasets/<name>/<file>
    ("artifacts/draft/abc/manifest.json", "eaglenest", "s3:ObjectCreated:Put"),
])
def test_records_that_are_not_new_dataset_objects_are_ignored(key, bucket, event):
    notification = minio_notification(key, bucket=bucket, event=event)
    assert events_from_notification(notification, open_store("s3://eaglenest")) == []


def test_an_object_outside_the_store_prefix_is_ignored():
    notification = minio_notification("datasets/chats/p.jsonl")
    assert events_from_notification(notification, open_store("s3://eaglenest/team-a")) == []


def test_a_record_without_an_etag_is_an_error_naming_the_field():
    with pytest.raises(ValueError, match=r"s3\.object\.eTag"):
        events_from_notification(minio_notification("datasets/chats/p.jsonl", etag=""), open_store("s3://eaglenest"))


# --- the service against a real Prefect server -------------------------------------------------------------

@pytest.fixture(scope="module")
def prefect_api(prefect_stack) -> Iterator[str]:
    """The session's Prefect server (tests/conftest.py `prefect_stack`), its dataset automations paused meanwhile:
    the events sent here name objects of a bucket no test serves, and must not start pipeline runs on the
    session's worker (tests/integration/test_dataset_trigger.py covers event → run). Yields the API URL."""
    from prefect.client.orchestration import SyncPrefectClient

    with SyncPrefectClient(prefect_stack.api_url) as client:
        paused = [a.id for a in client.read_automations() if a.name.startswith("eaglenest-dataset-uploaded")
                  and a.enabled]
        for automation_id in paused:
            client.pause_automation(automation_id)
    try:
        yield prefect_stack.api_url
    finally:
        with SyncPrefectClient(prefect_stack.api_url) as client:
            for automation_id in paused:
                client.resume_automation(automation_id)


@pytest.fixture
def adapter(prefect_api):
    server = make_server("127.0.0.1", 0, store="s3://eaglenest", api_url=prefect_api, token="s3cret")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def post(url: str, body: dict, token: str | None = "s3cret") -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def stored_events(api: str, event_id: str, timeout_s: float = 90) -> list[dict]:
    """Poll the server's event store (events are persisted in batches) until the id shows up."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = httpx.post(f"{api}/events/filter", json={"filter": {"event": {"name": [EVENT]}}, "limit": 50},
                           timeout=30).json()["events"]
        matching = [e for e in found if e["id"] == event_id]
        if matching or time.monotonic() > deadline:
            return matching
        time.sleep(1)


def test_the_adapter_delivers_the_event_to_prefect(adapter, prefect_api):
    key = f"datasets/support-chats/{uuid.uuid4().hex}.jsonl"
    status, body = post(f"{adapter}/", minio_notification(key))
    assert status == 200, body
    [event_id] = body["events"]
    [stored] = stored_events(prefect_api, event_id)
    assert stored["event"] == EVENT
    assert stored["resource"]["prefect.resource.id"] == "eaglenest.dataset.support-chats"
    assert stored["payload"]["uri"] == f"s3://eaglenest/{key}" and stored["payload"]["version"] == ETAG


def test_the_adapter_refuses_a_request_without_the_token_and_answers_health(adapter):
    status, body = post(f"{adapter}/", minio_notification("datasets/a/b.jsonl"), token=None)
    assert status == 401 and "Bearer" in body["error"]
    status, _ = post(f"{adapter}/", minio_notification("datasets/a/b.jsonl"), token="wrong")
    assert status == 401
    with urllib.request.urlopen(f"{adapter}/health", timeout=10) as response:
        assert response.status == 200


def test_an_unreachable_prefect_gives_502_so_minio_retries(tmp_path):
    server = make_server("127.0.0.1", 0, store="s3://eaglenest", api_url=f"http://127.0.0.1:{free_port()}/api")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        status, body = post(f"http://127.0.0.1:{server.server_address[1]}/", minio_notification("datasets/a/b.jsonl"),
                            token=None)
    finally:
        server.shutdown()
        server.server_close()
    assert status == 502 and "cannot reach the Prefect API" in body["error"]


def test_a_file_store_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"expected s3://BUCKET"):
        make_server("127.0.0.1", 0, store=f"file://{Path.cwd()}/out/store", api_url="http://127.0.0.1:1/api")


def test_main_serves_notifications_until_interrupted(prefect_api, tmp_path):
    """`python -m flows.minio_adapter` as compose runs it: settings from the environment, a notification in, the
    event stored by Prefect, and SIGINT (Ctrl-C) ends it with exit 0 — started as a shell's background job
    starts it, with SIGINT ignored (a CI run under `nohup … &` did, and the adapter never stopped)."""
    port = free_port()
    env = {**os.environ, "EAGLENEST_STORE": "s3://eaglenest", "PREFECT_API_URL": prefect_api,
           "EAGLENEST_ADAPTER_TOKEN": "s3cret"}
    log = tmp_path / "adapter.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "flows.minio_adapter", "--port", str(port)], env=env,
                                stdout=out, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[2],
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        key = f"datasets/main-test/{uuid.uuid4().hex}.jsonl"
        status, body = post(f"{url}/", minio_notification(key))
        assert status == 200, body
        [event_id] = body["events"]
        [stored] = stored_events(prefect_api, event_id)
        assert stored["payload"]["uri"] == f"s3://eaglenest/{key}"
        assert post(f"{url}/", minio_notification(key), token=None)[0] == 401       # the token came from the env
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert f"listening on http://127.0.0.1:{port}" in text and f"events to {prefect_api}" in text
    assert f"event {event_id}" in text


def test_main_refuses_missing_settings_and_a_file_store_with_exit_2(monkeypatch, capsys):
    from flows.minio_adapter import main

    for name in ("EAGLENEST_STORE", "PREFECT_API_URL", "EAGLENEST_ADAPTER_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--store and --api-url" in err and "EAGLENEST_STORE, PREFECT_API_URL" in err
    assert main(["--store", "file:///tmp/store", "--api-url", "http://127.0.0.1:1/api"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expected s3://BUCKET" in err
