"""Progress of long work (datagen, extract, train): a terminal bar, and listeners for everything else.

Steps never import Prefect, yet the Prefect UI should show their progress. So a step reports
progress here, once; a terminal gets a tqdm bar, and whoever orchestrates the step (flows/) may
register a listener that turns the same numbers into a progress artifact. Listeners are throttled
(at most one call per `min_interval_s`, plus the final one) so a fast loop never floods an API.

    with progress.bar(total=n, desc="extract", unit="tok") as bar:
        for batch in ...:
            bar.update(len(batch))
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: listener(desc, done, total, unit, note) — called from the step's thread; `note` is the bar's latest
#: status line ("" when none), e.g. train's "tau_sim 1.52 (best 1.55 @ step 200)".
Listener = Callable[[str, float, float, str, str], None]

_listeners: list[Listener] = []


def add_listener(fn: Listener) -> None:
    _listeners.append(fn)


def remove_listener(fn: Listener) -> None:
    if fn in _listeners:
        _listeners.remove(fn)


@contextmanager
def listening(fn: Listener) -> Iterator[None]:
    """Register `fn` for the duration of a block (a flow wraps one step call in this)."""
    add_listener(fn)
    try:
        yield
    finally:
        remove_listener(fn)


class Bar:
    """A tqdm bar that also notifies listeners (throttled); use through `bar(...)`."""

    def __init__(self, total: float, desc: str, unit: str, initial: float = 0, min_interval_s: float = 2.0,
                 disable: bool | None = None):
        from tqdm import tqdm

        self.total, self.desc, self.unit, self.n = float(total), desc, unit, float(initial)
        self.min_interval_s, self._last, self.note = min_interval_s, 0.0, ""
        self._tqdm = tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr, disable=disable)
        self._notify(force=True)

    def update(self, n: float = 1) -> None:
        self.n += n
        self._tqdm.update(n)
        self._notify(force=self.n >= self.total)

    def set_postfix(self, **kwargs: object) -> None:
        self._tqdm.set_postfix(**kwargs)

    def set_note(self, note: str) -> None:
        """A status line for listeners and the terminal (printed above the bar), sent at once."""
        self.note = note
        self._tqdm.write(f"{self.desc}: {note}", file=sys.stderr)
        self._notify(force=True)

    def _notify(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.min_interval_s:
            return
        self._last = now
        for fn in list(_listeners):
            try:
                fn(self.desc, self.n, self.total, self.unit, self.note)
            except Exception as err:   # a UI hiccup must never fail the computation
                print(f"progress listener failed: {err}", file=sys.stderr)

    def close(self) -> None:
        self._notify(force=True)
        self._tqdm.close()


@contextmanager
def bar(total: float, desc: str, unit: str = "it", initial: float = 0, disable: bool | None = None) -> Iterator[Bar]:
    b = Bar(total, desc, unit, initial=initial, disable=disable)
    try:
        yield b
    finally:
        b.close()
