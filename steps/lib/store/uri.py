"""From a store URI to a `Store`: which store a run uses, its backend, its scratch folder."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from urllib.parse import urlparse

from steps.lib.home import home_store_uri
from steps.lib.store.backends import FileBackend, S3Backend
from steps.lib.store.store import Store

#: the store of a command told none (under EAGLENEST_HOME)
DEFAULT_STORE = "file://out/store"


def store_uri_for(explicit: str | None, configured: str) -> str:
    """The store a run uses: an explicit URI, else $EAGLENEST_STORE (set by workers and containers), else
    the config's `store` (a relative folder there is under EAGLENEST_HOME, `steps/lib/home.py`). One rule for
    every CLI, flow and worker."""
    return explicit or os.environ.get("EAGLENEST_STORE") or home_store_uri(configured)


def default_cache_dir(store_key: str) -> Path:
    """`<tmp>/eaglenest-cache/<store>`: scratch (extraction rounds, serve logs, downloads) of one store.

    Keyed by the store, so two stores on one machine (`make demo` in two clones, the tests beside a
    demo) never meet in each other's scratch; EAGLENEST_CACHE (or `cache_dir`) overrides it."""
    digest = hashlib.sha256(store_key.encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / "eaglenest-cache" / digest


def open_store(uri: str | None = None, *, cache_dir: str | Path | None = None,
               endpoint_url: str | None = None) -> Store:
    """`file://path` (relative or absolute), a plain folder path, or `s3://bucket/prefix`; env EAGLENEST_STORE as
    default."""
    uri = uri or os.environ.get("EAGLENEST_STORE") or home_store_uri(DEFAULT_STORE)
    explicit_cache = cache_dir or os.environ.get("EAGLENEST_CACHE")
    if "://" not in uri:            # a plain folder path, as the store's own paths are printed
        uri = f"file://{Path(uri).expanduser().resolve()}"
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        # file://out/store parses as host "out" + path "/store": a relative folder. file://localhost/x
        # is the RFC 8089 spelling of the absolute file:///x.
        netloc = "" if parsed.netloc == "localhost" else parsed.netloc
        root_text = netloc + parsed.path
        if not root_text:
            raise ValueError(f"store URI {uri!r}: file:// needs a folder (file://out/store or file:///abs/path)")
        root = Path(root_text)
        root.mkdir(parents=True, exist_ok=True)
        resolved = f"file://{root.resolve()}"
        return Store(resolved, FileBackend(root), Path(explicit_cache or default_cache_dir(resolved)))
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"store URI {uri!r}: s3:// needs a bucket (s3://bucket/prefix)")
        endpoint = endpoint_url or os.environ.get("EAGLENEST_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")
        return Store(uri.rstrip("/"), S3Backend(parsed.netloc, parsed.path, endpoint),
                     Path(explicit_cache or default_cache_dir(f"{endpoint or ''}|{uri.rstrip('/')}")))
    raise ValueError(f"store URI {uri!r}: expected file://PATH, a folder path or s3://BUCKET/PREFIX")
