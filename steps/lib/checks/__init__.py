"""The failure catalogue's checks (DESIGN.md F1–F9), each written once; see `steps/lib/checks/catalogue.py`."""

from steps.lib.checks.finding import Finding, Status

__all__ = ["Finding", "Status"]
