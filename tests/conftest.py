"""Shared test setup: offline Hugging Face, a private Prefect home, small thread counts, and the S3 peer.

`s3_endpoint` is the one S3 test peer: moto's server on 127.0.0.1, spoken to over HTTP through boto3's
`endpoint_url` (never in-process mocks). boto3 and moto are plain imports inside it, so a missing test
dependency errors every test that needs S3 instead of skipping it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests run many small models and server processes side by side on 2 cores: one thread each
# avoids OpenMP spin-waiting (measured 10-40x slowdowns with 2 threads under contention).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
# Nothing a test run reads or writes outside its own folder may outlive it or come from an earlier run
# (a demo, the stack, another clone's tests): Prefect's home and database, Hugging Face's cache and the
# store's scratch (extraction rounds, serve logs, downloads) live in one fresh folder per session, and a
# store, cache or Prefect API set in the calling shell is not inherited.
SESSION_DIR = Path(tempfile.mkdtemp(prefix="eaglenest-tests-"))
os.environ["PREFECT_HOME"] = str(SESSION_DIR / "prefect")
os.environ["HF_HOME"] = str(SESSION_DIR / "hf")
os.environ["EAGLENEST_CACHE"] = str(SESSION_DIR / "cache")
for inherited in ("EAGLENEST_STORE", "PREFECT_API_URL", "PREFECT_PROFILE"):
    os.environ.pop(inherited, None)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls on a shared 2-core machine: a second torch thread only adds contention (mostly spin-waits).

    Opt in per module with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch  # here, not at the top: files that never touch torch do not pay for its import

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


#: the bucket `s3_endpoint` creates; tests use a fresh prefix of it each (`s3://{S3_BUCKET}/<uuid>`).
S3_BUCKET = "eaglenest-test"


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A moto S3 server on a free 127.0.0.1 port with the bucket `S3_BUCKET`; AWS settings isolated to it."""
    import boto3  # here, not at the top: only S3 tests pay for it (and fail, not skip, without it)
    from moto.server import ThreadedMotoServer

    mp = pytest.MonkeyPatch()
    no_files = tmp_path_factory.mktemp("aws") / "none"
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": str(no_files),
                        "AWS_SHARED_CREDENTIALS_FILE": str(no_files), "NO_PROXY": "127.0.0.1",
                        "no_proxy": "127.0.0.1"}.items():
        mp.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
                 "EAGLENEST_S3_ENDPOINT_URL"):
        mp.delenv(name, raising=False)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)  # port 0: the OS picks, no race
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=S3_BUCKET)
        yield endpoint
    finally:
        server.stop()
        mp.undo()


def pytest_collection_modifyitems(config, items):
    """End-to-end tests run last: the tiny pipeline they run is the one the orchestration tests already
    ran against the same stack and store, so its artifacts (content-addressed) are reused, not retrained."""
    items.sort(key=lambda item: "/tests/e2e/" in str(item.path).replace(os.sep, "/"))


@pytest.fixture(scope="session")
def prefect_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """The session's one real Prefect stack (`prefect server start` + a process worker, `flows.stack.Stack`,
    the same code as `eaglenest stack up`) on a free port with a temporary directory and `file://` store; no
    UI (it only slows the start) and no scheduler (tests start the runs they need). `.api_url`, `.env` (for
    `prefect ...` subprocesses), `.store_uri`, `.dir`. Torn down worker first, then server, even when
    start-up fails halfway."""
    from flows.stack import Stack
    from tests.builders import free_port

    root = tmp_path_factory.mktemp("prefect-stack")
    stack = Stack(dir=root / "stack", port=free_port(), store_uri=f"file://{root / 'store'}",
                  ui=False, scheduler=False)
    try:
        stack.up()
        yield stack
    finally:
        stack.down()


#: the session's tiny target: configs/tiny.yaml with this override (enough pretraining for the loss to fall well
#: below ln(vocab), tests/unit/test_target.py; datagen only needs a model that emits text).
TINY_PRETRAIN = "target.tiny.pretrain_steps=150"


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory):
    """configs/tiny.yaml's target, pretrained once per session (`TINY_PRETRAIN`) into its own `file://` store:
    (store, manifest, seconds the build took). Tests add their artifacts to that store or copy the target out."""
    import time

    from steps import target
    from steps.config import load_config
    from steps.store import open_store

    store = open_store(f"file://{tmp_path_factory.mktemp('tiny-target')}")
    started = time.perf_counter()
    manifest = target.run(load_config("configs/tiny.yaml", [TINY_PRETRAIN]), store)
    return store, manifest, time.perf_counter() - started
