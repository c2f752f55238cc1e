"""Shared test setup: offline Hugging Face, a private Prefect home, small thread counts."""

from __future__ import annotations

import os
import tempfile

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
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="eaglenest-prefect-"))
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="eaglenest-hf-"))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls on a shared 2-core machine: a second torch thread only adds contention (mostly spin-waits).

    Opt in per module with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch  # here, not at the top: files that never touch torch do not pay for its import

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
