"""The one JSON-over-HTTP client: serve's smoke test, benchmark, doctor, the SGLang capture backend and
datagen's OpenAI-compatible server all talk through it. Credentials never travel in a URL that an error
or a log names: user-info becomes a Basic Authorization header, and a server that cannot be reached is a
`ConnectionError` naming the URL without them."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from steps.lib.runtime.redaction import redact_text


def json_request(url: str, body: Any = None) -> urllib.request.Request:
    """A request for `url` (a POST of `body` as JSON when given). User-info in the URL becomes a Basic
    Authorization header: urllib would take `user:password@host` for the host name, and the credentials
    must not travel in the URL that error messages and logs name."""
    parts = urllib.parse.urlsplit(url)
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if parts.username is not None:
        user = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(user.encode()).decode()
        host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else str(parts.hostname)
        url = urllib.parse.urlunsplit(parts._replace(netloc=host + (f":{parts.port}" if parts.port else "")))
    data = json.dumps(body).encode() if body is not None else None
    return urllib.request.Request(url, data=data, headers=headers)


def http_json(url: str, body: Any = None, timeout_s: float = 600.0) -> Any:
    """GET (or POST `body`) and parse the JSON answer. An HTTP error status raises `HTTPError` as is; a
    server that cannot be reached raises `ConnectionError` naming the URL without its credentials."""
    try:
        with urllib.request.urlopen(json_request(url, body), timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError:
        raise
    except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
        reason = getattr(err, "reason", err)
        raise ConnectionError(f"{redact_text(url)}: cannot reach the server ({reason}); start it, or fix the "
                              "URL in the config") from None


def post_json(url: str, body: dict[str, Any], timeout_s: float = 600.0) -> Any:
    return http_json(url, body, timeout_s)


def get_json(url: str, timeout_s: float = 30.0) -> dict[str, Any]:
    return http_json(url, None, timeout_s)


@contextmanager
def json_stream(url: str, body: Any, timeout_s: float = 600.0) -> Iterator[Any]:
    """POST `body` and hand over the open response to read line by line (server-sent events)."""
    try:
        response = urllib.request.urlopen(json_request(url, body), timeout=timeout_s)
    except urllib.error.HTTPError:
        raise
    except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
        reason = getattr(err, "reason", err)
        raise ConnectionError(f"{redact_text(url)}: cannot reach the server ({reason}); start it, or fix the "
                              "URL in the config") from None
    with response:
        yield response
