"""Shared test setup: offline Hugging Face, a private Prefect home, small thread counts, and the S3 peer.

`s3_endpoint` is the one S3 test peer: moto's server on 127.0.0.1, spoken to over HTTP through boto3's
`endpoint_url` (never in-process mocks). boto3 and moto are plain imports inside it, so a missing test
dependency errors every test that needs S3 instead of skipping it.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from uuid import UUID

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
REPO = Path(__file__).resolve().parents[1]
SESSION_DIR = Path(tempfile.mkdtemp(prefix="eaglenest-tests-"))
# removed when this process exits: atexit runs its handlers last-registered first, so Prefect's temporary
# server (registered later, on first use) is stopped before its database here goes
atexit.register(shutil.rmtree, SESSION_DIR, ignore_errors=True)
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


def process_alive(pid: int) -> bool:
    """A live process (a zombie has exited; only its parent has not reaped it yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def eaglenest(*argv: str, timeout_s: float = 900) -> subprocess.CompletedProcess:
    """`eaglenest ARGV` in a subprocess from the repository root (as a user types it); output captured."""
    return subprocess.run([sys.executable, "-m", "flows.cli", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s)


@pytest.fixture(scope="session")
def prefect_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """The session's one real Prefect stack (`prefect server start` + a process worker), started and stopped with
    the very commands users type: `eaglenest stack up` (a free port, a temporary directory and `file://` store; no
    UI, it only slows the start; no schedules, tests start the runs they need; the Prefect profile left alone) and
    `eaglenest stack down`, which must exit 0 and leave neither process nor the API behind (else the session
    ends with an error). Yields a `flows.stack.Stack` for that directory: `.api_url`, `.env` (for `prefect ...`
    subprocesses), `.store_uri`, `.dir`, `.status()`."""
    from flows.stack import Stack
    from tests.builders import free_port

    root = tmp_path_factory.mktemp("prefect-stack")
    stack = Stack(dir=root / "stack", port=free_port(), store_uri=f"file://{root / 'store'}",
                  ui=False, scheduler=False)
    up = eaglenest("stack", "up", "--dir", str(stack.dir), "--port", str(stack.port), "--store", stack.store_uri,
                   "--no-ui", "--no-schedules", "--no-profile")
    pids = [stack.status()[f"{name}_pid"] for name in ("server", "worker")]
    try:
        assert up.returncode == 0 and f"Prefect API:  {stack.api_url}" in up.stdout, (up.stdout + up.stderr)[-3000:]
        yield stack
    finally:
        down = eaglenest("stack", "down", "--dir", str(stack.dir), timeout_s=300)
        left = [pid for pid in pids if pid and process_alive(pid)]
        assert down.returncode == 0 and down.stdout.strip() == "worker stopped, server stopped", \
            (down.stdout + down.stderr)[-2000:]
        assert not left and not stack.status()["healthy"], f"`eaglenest stack down` left {left} running"


#: the deployment the orchestration tests run (deploy/prefect.yaml), and how long one run may take on a 2-core
#: machine: ~10 child runs × (worker pick-up + a Python start) + compute.
DEPLOYMENT = "eagle3-pipeline/tiny"
RUN_TIMEOUT_S = 1500


def prefect(stack, *args: str, timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    """`prefect ARGS` against `stack` (a `flows.stack.Stack`), output captured."""
    # a wide "terminal": the CLI's console wraps log lines at 80 columns when its output is not a tty
    return subprocess.run([str(Path(sys.executable).parent / "prefect"), *args], env={**stack.env, "COLUMNS": "1000"},
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def run_pipeline(stack, *params: str) -> tuple[int, UUID, str]:
    """`prefect deployment run 'eagle3-pipeline/tiny' --watch` on the stack's store: (exit code, flow run id,
    output)."""
    args = ["deployment", "run", DEPLOYMENT, "--watch", "-p", f"store={stack.store_uri}"]
    for p in params:
        args += ["-p", p]
    out = prefect(stack, *args)
    text = out.stdout + out.stderr
    match = re.search(r"UUID:\s*([0-9a-f-]{36})", text)
    assert match, text[-3000:]
    return out.returncode, UUID(match.group(1)), text


@pytest.fixture(scope="session")
def tiny_pipeline_run(prefect_stack) -> tuple[int, UUID, str]:
    """The session's one plain run of the tiny deployment on the session's stack and store (`run_pipeline`):
    it stores the tiny chain (target … verify) and points `production` at the export it promoted. Every test
    that needs either requests this, rather than relying on an earlier test's run: each passes alone and in
    any order. (exit code, flow run id, `--watch` output); the test of that run asserts on them."""
    return run_pipeline(prefect_stack)


#: the session's tiny target: configs/tiny.yaml with this override (enough pretraining for the loss to fall well
#: below ln(vocab), tests/unit/test_target.py; datagen only needs a model that emits text).
TINY_PRETRAIN = "target.tiny.pretrain_steps=150"


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory):
    """configs/tiny.yaml's target, pretrained once per session (`TINY_PRETRAIN`) into its own `file://` store:
    (store, manifest, seconds the build took). Tests add their artifacts to that store or copy the target out."""
    import time

    from steps import target
    from steps.lib.config import load_config
    from steps.lib.store import open_store

    store = open_store(f"file://{tmp_path_factory.mktemp('tiny-target')}")
    started = time.perf_counter()
    manifest = target.run(load_config("configs/tiny.yaml", [TINY_PRETRAIN]), store)
    return store, manifest, time.perf_counter() - started
