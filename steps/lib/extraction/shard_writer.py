"""Writing shards while the target runs: the extraction's host side (the library of `steps/extract.py`).

The GPU captures batch k+1 while this module's threads turn batch k into files:
- the **writer** thread waits for a batch's rows to land in host memory (`capture.Pending`), copies
  each sequence's rows to its place in the shard (shard order, whatever order the batches came in),
  hands the pinned buffers back, and writes the shard once its last batch is in;
- the **uploader** thread uploads each written shard, verifies it and deletes the local copy.

Local disk is bounded by a byte budget (F8): a shard is written only once its size bound fits beside
the shards still waiting for upload; an upload gives its bytes back. Peak local bytes therefore never
exceed the budget, while capture, writes and uploads overlap. The queue to the writer is bounded
too (`QUEUE_BATCHES`), so a slow disk slows the GPU down instead of filling host memory.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from steps.lib.extraction.capture import Pending

#: batches waiting for the writer; with the backend's double-buffered host memory, what bounds host use.
QUEUE_BATCHES = 4


@dataclass
class ShardJob:
    """One shard in flight: its sequences in shard order and where each one's rows go."""
    path: Path
    input_ids: list[list[int]]
    loss_masks: list[list[int]]
    bytes_bound: int
    tag: Any = None                       # the caller's (extract: the ShardPlan), handed back to `upload`
    offsets: list[int] = field(init=False)
    rows: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.offsets, at = [], 0
        for s in self.input_ids:
            self.offsets.append(at)
            at += len(s)
        self.tokens = at

    def fill(self, keys: list[int], pending: Pending) -> None:
        """Copy batch rows (sequences `keys` of this shard, in the batch's order) to their places."""
        host = pending.wait()
        for name, x in host.items():
            if name not in self.rows:
                self.rows[name] = torch.empty((self.tokens, *x.shape[1:]), dtype=x.dtype)
            dst = self.rows[name]
            for k, (start, n) in zip(keys, pending.spans, strict=True):
                dst[self.offsets[k]:self.offsets[k] + n] = x[start:start + n]


class ByteBudget:
    """Bytes of local disk that shards may hold at once; `acquire` waits for uploads to free some."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self._cv = threading.Condition()

    def acquire(self, n: int, failed: Callable[[], bool]) -> None:
        with self._cv:
            while self.used and self.used + n > self.limit and not failed():
                self._cv.wait(timeout=0.5)
            self.used += n

    def release(self, n: int) -> None:
        with self._cv:
            self.used -= n
            self._cv.notify_all()


class ShardWriter:
    """`submit(job, keys, pending)` per captured batch, `finish(job)` after a shard's last batch;
    `close()` waits for every write and upload and raises the first error of either thread.

    `write(job)` writes `job.rows` to `job.path` (returns the bytes written); `upload(job)` (optional)
    uploads, verifies and deletes the file; `written(job)` (optional) runs on the writer thread after
    each write (extract measures the scratch folder there)."""

    def __init__(self, write: Callable[[ShardJob], int], *, budget_bytes: int,
                 upload: Callable[[ShardJob], Any] | None = None,
                 written: Callable[[ShardJob], None] | None = None):
        self._write, self._upload, self._written = write, upload, written
        self.budget = ByteBudget(budget_bytes)
        self._todo: queue.Queue = queue.Queue(maxsize=QUEUE_BATCHES)
        self._uploads: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self.bytes_written = 0
        self._threads = [threading.Thread(target=self._writer, name="shard-writer", daemon=True)]
        if upload is not None:
            self._threads.append(threading.Thread(target=self._uploader, name="shard-uploader", daemon=True))
        for t in self._threads:
            t.start()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(raise_error=exc[0] is None)

    def _failed(self) -> bool:
        return self._error is not None

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def submit(self, job: ShardJob, keys: list[int], pending: Pending) -> None:
        self._check()
        self._todo.put(("batch", job, keys, pending))

    def finish(self, job: ShardJob) -> None:
        self._check()
        self._todo.put(("end", job, None, None))

    def close(self, raise_error: bool = True) -> None:
        self._todo.put(None)
        self._threads[0].join()
        self._uploads.put(None)
        for t in self._threads[1:]:
            t.join()
        if raise_error:
            self._check()

    def _writer(self) -> None:
        # After an error keep draining, handing pinned buffers back, so the capturing thread never blocks.
        while (item := self._todo.get()) is not None:
            what, job, keys, pending = item
            try:
                if self._error is None and what == "batch":
                    job.fill(keys, pending)
                elif self._error is None:
                    self.budget.acquire(job.bytes_bound, self._failed)
                    self.bytes_written += self._write(job)
                    job.rows.clear()
                    if self._written is not None:
                        self._written(job)
                    if self._upload is not None:
                        self._uploads.put(job)
                    else:
                        self.budget.release(job.bytes_bound)
            except BaseException as e:  # noqa: BLE001 - re-raised on the capturing thread
                self._error = self._error or e
            finally:
                if pending is not None:
                    pending.release()

    def _uploader(self) -> None:
        while (job := self._uploads.get()) is not None:
            if self._error is not None:
                continue
            try:
                self._upload(job)
                self.budget.release(job.bytes_bound)
            except BaseException as e:  # noqa: BLE001 - re-raised on the capturing thread
                self._error = self._error or e
