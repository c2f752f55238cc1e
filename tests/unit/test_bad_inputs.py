"""The short form of tests/fault/bad_inputs.py: a few bad inputs across the CLIs, each one line, exit 2, no
traceback (the full harness runs every case; docs/RELIABILITY.md gives its figures)."""

from __future__ import annotations

from tests.fault.bad_inputs import run

SHORT = ["target config-a-list", "target config-binary", "doctor config-null", "convert truncated-weights",
         "doctor config-symlink-out", "convert weights-symlink-out", "dataset upload not-json"]


def test_bad_inputs_are_one_line_exit_2_and_no_traceback():
    figures = run(SHORT)
    assert figures["cases"] == len(SHORT) and not figures["failed"], figures["failed"]
