"""The test session's own folder (tests/conftest.py `SESSION_DIR`: Prefect's home, Hugging Face's cache, the
store's scratch) is gone once the session's process has exited, whatever the tests wrote into it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

WRITER = '''
import os
from pathlib import Path


def test_writes_into_the_session_folder():
    for name in ("PREFECT_HOME", "HF_HOME", "EAGLENEST_CACHE"):
        Path(os.environ[name]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ[name]) / "left.txt").write_text("x")
    print("SESSION", Path(os.environ["EAGLENEST_CACHE"]).parent)
'''


def test_the_session_folder_is_removed_when_the_session_ends(tmp_path: Path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    (tmp_path / "test_writer.py").write_text(WRITER)
    # a pytest session of its own, with this repository's conftest as a plugin and a private TMPDIR
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "tests.conftest", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), str(tmp_path / "test_writer.py")], cwd=REPO,
                         env={**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    session = Path(next(line.split(" ", 1)[1] for line in run.stdout.splitlines() if line.startswith("SESSION ")))
    assert session.parent == tmp and session.name.startswith("eaglenest-tests-"), session
    assert not session.exists(), sorted(p.name for p in session.rglob("*"))
