"""EAGLENEST_HOME: the one folder where eaglenest keeps what a command makes when it is not told where.

    $EAGLENEST_HOME, else the source checkout eaglenest runs from (where `make install` ran: the folder
    with its pyproject.toml), else ~/.eaglenest

Under it, the same wherever a command is typed: the default store `out/store` (and any relative
`file://` store a config names), the local stack `out/stack` (`eaglenest stack up`), server logs
`out/serve`. A path typed on a command line is the shell's (relative to the working directory); only
defaults and the paths inside configs are the home's, so a dataset uploaded from /tmp lands in the store
the stack's runs read.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

#: the folder holding steps/ and flows/: a source checkout when pyproject.toml sits beside them
CODE_ROOT = Path(__file__).resolve().parents[2]


def home() -> Path:
    """The eaglenest home (absolute)."""
    if os.environ.get("EAGLENEST_HOME"):
        return Path(os.environ["EAGLENEST_HOME"]).expanduser().resolve()
    if (CODE_ROOT / "pyproject.toml").is_file():
        return CODE_ROOT
    return Path("~/.eaglenest").expanduser().resolve()


def under_home(path: str | Path) -> Path:
    """`path` as is when absolute, else under the home."""
    path = Path(path).expanduser()
    return path if path.is_absolute() else home() / path


def home_store_uri(uri: str) -> str:
    """A store URI from a config or a default: a relative `file://` folder (or plain path) under the home,
    anything else as is."""
    if "://" not in uri:
        return f"file://{under_home(uri)}"
    parsed = urlparse(uri)
    if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):   # file://out/store: relative
        return f"file://{under_home(parsed.netloc + parsed.path)}"
    return uri


def local_path(text: str) -> Path:
    """A local path typed as a path or as the `file://` URI eaglenest prints for it (`file:///abs/dir`,
    `file://localhost/abs/dir`): every path or URI it prints is accepted where a local path is read."""
    if text.startswith("file://"):
        parsed = urlparse(text)
        return Path(("" if parsed.netloc == "localhost" else parsed.netloc) + parsed.path)
    return Path(text).expanduser()
