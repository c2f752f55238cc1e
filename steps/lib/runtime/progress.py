"""Progress of long work (datagen, extract, train): a terminal bar, and listeners for everything else.

Steps never import Prefect, yet the Prefect UI should show their progress. So a step reports
progress here, once; a terminal gets a tqdm bar, and whoever orchestrates the step (flows/) may
register a listener that turns the same numbers into a progress artifact. Listeners are throttled
(at most one call per `min_interval_s`, plus the final one) so a fast loop never floods an API.
A listener gets an `Update`: the numbers, the elapsed time, the ETA and the bar's postfix (train's loss),
and `Update.line()`, the plain one-line form for logs where no terminal draws the bar.

    with progress.bar(total=n, desc="extract", unit="tok") as bar:
        for batch in ...:
            bar.update(len(batch))
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Update:
    """One progress report: `done` of `total` `unit`s of `desc`, `initial` of them from before a resume."""
    desc: str
    done: float
    total: float
    unit: str
    elapsed_s: float = 0.0
    initial: float = 0.0
    postfix: dict[str, object] = field(default_factory=dict)

    @property
    def fraction(self) -> float:
        return min(1.0, self.done / self.total) if self.total else 1.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at this run's rate so far (work resumed from a checkpoint does not count); None
        before any work was timed."""
        rate = (self.done - self.initial) / self.elapsed_s if self.elapsed_s > 0 else 0.0
        return max(0.0, (self.total - self.done) / rate) if rate > 0 else None

    def postfix_items(self) -> list[tuple[str, str]]:
        """The postfix as text, floats with three decimals (an accuracy of 0.123456789 reads 0.123)."""
        return [(k, f"{v:.3f}" if isinstance(v, float) else str(v)) for k, v in self.postfix.items()]

    def line(self) -> str:
        """`train: 45/100 step (45%), 0:12 elapsed, ETA 0:15, loss=2.345`"""
        eta = self.eta_s
        extra = "".join(f", {k}={v}" for k, v in self.postfix_items())
        return (f"{self.desc}: {self.done:,.0f}/{self.total:,.0f} {self.unit} ({100 * self.fraction:.0f}%), "
                f"{clock(self.elapsed_s)} elapsed, ETA {clock(eta) if eta is not None else '?'}{extra}")


def clock(seconds: float) -> str:
    """`1:02:03`, `2:03`: a duration as a terminal bar prints it."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


#: listener(update) — called from the step's thread.
Listener = Callable[[Update], None]

_listeners: list[Listener] = []


def add_listener(fn: Listener) -> None:
    _listeners.append(fn)


def remove_listener(fn: Listener) -> None:
    if fn in _listeners:
        _listeners.remove(fn)


# --- progress across a process boundary --------------------------------------------------------------------
# A flow that runs a step as its own process (`python -m steps.<name>`, flows/step_process.py) sets
# LINES_ENV; the step's CLI then writes every update to stderr as one line, PREFIX + JSON, which the flow
# turns back into an `Update` for its own listeners. A terminal bar would be noise on that pipe (tqdm
# draws nothing when stderr is not a terminal).

LINES_ENV = "EAGLENEST_PROGRESS_LINES"
PREFIX = "eaglenest-progress: "


def write_line(update: Update) -> None:
    """A listener: the update as one PREFIX + JSON line on stderr."""
    print(PREFIX + json.dumps(asdict(update), default=str), file=sys.stderr, flush=True)


def parse_line(line: str) -> Update | None:
    """The update a `write_line` line carries, or None for any other line."""
    if not line.startswith(PREFIX):
        return None
    try:
        return Update(**json.loads(line[len(PREFIX):]))
    except (ValueError, TypeError):
        return None


def install_from_environment() -> None:
    """Called by the step CLI: when an orchestrator asked for progress lines (LINES_ENV), write them."""
    if os.environ.get(LINES_ENV) and write_line not in _listeners:
        add_listener(write_line)


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
        self.initial, self.postfix, self._started = float(initial), {}, time.monotonic()
        self.notes: dict[str, object] = {}
        self.min_interval_s, self._last = min_interval_s, 0.0
        self._tqdm = tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr, disable=disable)
        self._notify(force=True)

    def update(self, n: float = 1) -> None:
        self.n += n
        self._tqdm.update(n)
        self._notify(force=self.n >= self.total)

    def set_postfix(self, **kwargs: object) -> None:
        """What the bar shows after the count (e.g. the loss); replaced by the next call, notes stay."""
        self.postfix = {**kwargs, **self.notes}
        self._tqdm.set_postfix(**self.postfix)

    def set_note(self, **fields: object) -> None:
        """News worth sending at once (train's τ_sim after an evaluation): printed above the terminal bar,
        sent to listeners unthrottled, and kept in the postfix of every later update."""
        self.notes.update(fields)
        self._tqdm.write(f"{self.desc}: " + ", ".join(f"{k} {v}" for k, v in fields.items()), file=sys.stderr)
        self.set_postfix(**self.postfix)
        self._notify(force=True)

    def _notify(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.min_interval_s:
            return
        self._last = now
        update = Update(self.desc, self.n, self.total, self.unit, elapsed_s=now - self._started,
                        initial=self.initial, postfix=dict(self.postfix))
        for fn in list(_listeners):
            try:
                fn(update)
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
