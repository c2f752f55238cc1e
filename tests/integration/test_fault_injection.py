"""The fault-injection harness (tests/fault/fault_injection.py) in CI, short: three SIGKILLs at random moments
(extract on file://, train on file://, extract uploading onto S3 on moto) and one run through the faulty S3
proxy; it must exit non-zero on any corrupt, lost, doubled or recomputed artifact, and zero here."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tests" / "fault" / "fault_injection.py"


def _harness():
    spec = importlib.util.spec_from_file_location("fault_injection", HARNESS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_harness_fails_on_any_broken_promise():
    harness = _harness()
    clean = {k: 0 for k in harness.MUST_BE_ZERO}
    assert harness.failures(clean) == {}
    for field in harness.MUST_BE_ZERO:
        assert harness.failures({**clean, field: 1}) == {field: 1}


def test_a_short_fault_run_loses_and_corrupts_nothing(tmp_path):
    out = tmp_path / "trials.jsonl"
    run = subprocess.run([sys.executable, str(HARNESS), "--kills", "3", "--proxy-runs", "1", "--seed", "1",
                          "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=1500,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(next(line for line in run.stdout.splitlines() if line.startswith('{"summary"')))
    assert summary["kill_trials"] == 3 and summary["proxy_runs"] == 1
    assert summary["corrupt"] == summary["lost_shards"] == summary["duplicated_shards"] == 0
    assert len(out.read_text().splitlines()) == 4
