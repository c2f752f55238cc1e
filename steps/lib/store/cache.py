"""A bounded LRU of local copies of remote files (training reads shards through it)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path


class LocalCache:
    """A bounded LRU of local copies of remote files (training reads shards through it)."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self._entries: OrderedDict[Path, int] = OrderedDict()
        self.peak_bytes = 0

    @property
    def used_bytes(self) -> int:
        return sum(self._entries.values())

    def admit(self, path: Path, size: int, *, owned: bool) -> None:
        """Record a file now held locally; evict least recently used owned copies to fit."""
        if path in self._entries:
            self._entries.move_to_end(path)
            return
        while self._entries and self.used_bytes + size > self.budget:
            old, _ = self._entries.popitem(last=False)
            old.unlink(missing_ok=True)
        if owned:
            self._entries[path] = size
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def iter_paths(self) -> Iterator[Path]:
        return iter(self._entries)
