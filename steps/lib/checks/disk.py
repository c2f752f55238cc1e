"""F8, local disk: hidden states of a large dataset do not fit on the machine that extracts them.

Extraction runs in rounds planned under `extract.disk_budget` (extract → upload → verify → delete);
this check confirms afterwards that the measured local peak stayed under the budget.
"""

from __future__ import annotations

from steps.lib.checks.finding import Finding


def check_disk_budget(peak_local_bytes: int, disk_budget_bytes: int, *, where: str) -> Finding:
    """F8: the local peak of an extraction against its disk budget."""
    if peak_local_bytes <= disk_budget_bytes:
        return Finding("F8", "pass", where, f"local peak {peak_local_bytes} bytes ≤ disk budget {disk_budget_bytes}")
    return Finding("F8", "fail", where, f"local peak {peak_local_bytes} bytes > disk budget {disk_budget_bytes}: "
                   "the rounds did not bound local disk use",
                   "report a bug: extract's plan_rounds sizes rounds from shards.shard_bytes_bound")
