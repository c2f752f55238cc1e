"""steps/lib/runtime/redaction.py: URL credentials are stripped from manifests, log lines and errors."""

from __future__ import annotations

import base64
import logging
from pathlib import Path

import pytest

from steps.lib.http import json_request
from steps.lib.runtime.redaction import RedactingFilter, redact, redact_text
from steps.lib.store import MANIFEST, open_store


@pytest.mark.parametrize(("text", "want"), [
    ("http://admin:SECRET@10.0.0.1:30000/", "http://10.0.0.1:30000/"),
    ("see https://user@host/x and http://a:b:c@h2:1/y?q=1", "see https://host/x and http://h2:1/y?q=1"),
    ("http://h/v1?token=SECRET&model=m", "http://h/v1?token=***&model=m"),
    ("https://b.s3.amazonaws.com/k?X-Amz-Signature=SECRET&X-Amz-Credential=SECRET&x=1",
     "https://b.s3.amazonaws.com/k?X-Amz-Signature=***&X-Amz-Credential=***&x=1"),
    ("http://h/?api_key=SECRET", "http://h/?api_key=***"),
    ("s3://bucket/prefix file:///abs/path no url here", "s3://bucket/prefix file:///abs/path no url here"),
    ("http://u:p%40ss@h/", "http://h/"),
])
def test_urls_lose_user_info_and_secret_query_values(text: str, want: str):
    assert redact_text(text) == want
    assert redact_text(want) == want          # idempotent: reading a stored manifest back checks out


def test_redact_walks_dicts_and_lists_and_leaves_other_values():
    got = redact({"url": "http://a:SECRET@h/", "n": 3, "l": ["http://h/?token=SECRET", None]})
    assert got == {"url": "http://h/", "n": 3, "l": ["http://h/?token=***", None]}


def test_a_manifest_never_holds_a_url_secret_and_still_reads_back(tmp_path: Path):
    store = open_store(f"file://{tmp_path}/store", cache_dir=tmp_path / "cache")
    w = store.begin("hidden", "5ec0000000000002", step="extract",
                    config={"server_url": "http://admin:SECRET@h:1/", "final_server_url": "http://h:2/?token=SECRET"})
    w.path("a.bin").write_bytes(b"a")
    m = w.commit(meta={"servers": ["http://admin:SECRET@h:1/"]})
    raw = (tmp_path / "store" / store.key("hidden", m.id) / MANIFEST).read_bytes()
    assert b"SECRET" not in raw and b"http://h:1/" in raw
    assert store.manifest("hidden", m.id).config["final_server_url"] == "http://h:2/?token=***"


def test_log_records_are_redacted_with_their_arguments_merged(caplog: pytest.LogCaptureFixture):
    logger = logging.getLogger("eaglenest.test-secrets")
    caplog.handler.addFilter(RedactingFilter())
    with caplog.at_level(logging.INFO, logger=logger.name):
        logger.info("talking to %s", "http://admin:SECRET@h:1/generate")
    assert caplog.messages == ["talking to http://h:1/generate"]


def test_user_info_travels_as_a_basic_auth_header_not_in_the_url():
    req = json_request("http://admin:p%40ss@127.0.0.1:30000/generate", {"x": 1})
    assert req.full_url == "http://127.0.0.1:30000/generate"
    assert base64.b64decode(req.get_header("Authorization").split()[1]) == b"admin:p@ss"
    assert json_request("http://h:1/x").get_header("Authorization") is None
