"""The one result type of every failure-catalogue check (DESIGN.md F1–F9)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Status = Literal["pass", "fail", "warn", "skip"]


@dataclass(frozen=True)
class Finding:
    """One check's verdict: `id` is the catalogue row (F1…F9, or LAYOUT for doctor's layout detection),
    `where` the file, field, key or server it is about, `evidence` what was found (expected vs got and
    the consequence), `fix` what to do about it (empty on a pass)."""
    id: str
    status: Status
    where: str
    evidence: str
    fix: str = ""

    @property
    def located(self) -> str:
        """`where: evidence`, the line a report prints."""
        return f"{self.where}: {self.evidence}" if self.where else self.evidence

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape doctor's --json and the gate's diagnosis have always had: where folded into evidence."""
        return {"id": self.id, "status": self.status, "evidence": self.located, "fix": self.fix}

    def __str__(self) -> str:
        fix = f"\n      fix: {self.fix}" if self.fix and self.status != "pass" else ""
        return f"[{self.id} {self.status.upper()}] {self.located}{fix}"
