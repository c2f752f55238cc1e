"""Credentials never leave the process: user-info and tokens are stripped from URLs before they reach a
manifest, a log line, an error message or a Prefect artifact.

`redact(obj)` rewrites every URL inside a string, dict or list (`http://admin:pw@host/x?token=t` →
`http://host/x?token=***`); `RedactingFilter` does the same to every log record a handler emits. The
store applies `redact` to every manifest it writes (`steps/lib/store/manifest.py`); `step_main` installs the
filter and redacts its one-line errors; flows redact the records they publish.
"""

from __future__ import annotations

import logging
import re
from typing import Any

#: query parameters whose values are credentials (case-insensitive; `X-Amz-Signature`, `api_key`, ...).
SECRET_PARAMS = re.compile(r"(?i)^(x-amz-(signature|credential|security-token)|.*(token|secret|password|passwd|"
                           r"api[_-]?key|apikey|access[_-]?key|signature|sig|auth).*)$")
#: a URL's scheme and authority up to the first `/ ? #` (or whitespace, a quote or the end).
_URL = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<auth>[^/?#\s\"'<>]*)(?P<rest>[^\s\"'<>]*)")
_QUERY_PAIR = re.compile(r"(?P<sep>[?&;])(?P<key>[^=&;#\s]+)=(?P<value>[^&;#\s]*)")
MASK = "***"


def _one(m: re.Match[str]) -> str:
    auth = m["auth"].rsplit("@", 1)[-1]     # user:password@host → host
    rest = _QUERY_PAIR.sub(lambda q: f"{q['sep']}{q['key']}={MASK if SECRET_PARAMS.match(q['key']) else q['value']}",
                           m["rest"])
    return f"{m['scheme']}{auth}{rest}"


def redact_text(text: str) -> str:
    """`text` with the user-info and secret query values of every URL in it removed."""
    return _URL.sub(_one, text) if "://" in text else text


def redact(obj: Any) -> Any:
    """`obj` (str, dict, list, tuple; anything else as is) with `redact_text` applied to every string in it."""
    if isinstance(obj, str):
        return redact_text(obj)
    if isinstance(obj, dict):
        return {redact(k) if isinstance(k, str) else k: redact(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(redact(v) for v in obj)
    return obj


class RedactingFilter(logging.Filter):
    """A handler filter: the formatted message of every record, redacted (its arguments are merged in first,
    so a URL passed as `%s` is caught too)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact_text(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


def install_log_redaction(logger: logging.Logger | None = None) -> None:
    """Add `RedactingFilter` to every handler of `logger` (default: the root logger), once."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


__all__ = ["MASK", "RedactingFilter", "install_log_redaction", "redact", "redact_text"]
