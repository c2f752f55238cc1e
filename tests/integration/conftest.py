"""Integration fixtures: one real Prefect stack (`prefect server start` + a process worker) per session.

The stack is `flows.stack.Stack`, the same code as `eaglenest stack up`, on a free port with a temporary
directory and a temporary `file://` store; no UI (it only slows the start) and no scheduler (tests start
the runs they need). It tears down worker first, then server, even when start-up fails halfway.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from flows.stack import Stack
from tests.builders import free_port


@pytest.fixture(scope="session")
def prefect_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A running stack: `.api_url`, `.env` (for `prefect ...` subprocesses), `.store_uri`, `.dir`."""
    root = tmp_path_factory.mktemp("prefect-stack")
    stack = Stack(dir=root / "stack", port=free_port(), store_uri=f"file://{root / 'store'}",
                  ui=False, scheduler=False)
    try:
        stack.up()
        yield stack
    finally:
        stack.down()
