"""The extraction's host side: batches arrive in any order and land in shard order, local disk never holds
more than the budget while writes and uploads overlap, a failing thread's error reaches the caller."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from steps.lib.extraction.capture import done
from steps.lib.extraction.shard_writer import ShardJob, ShardWriter

W = 4


def _rows(values: list[int], lengths: list[int]):
    """A captured batch: sequence i is `lengths[i]` rows filled with `values[i]`."""
    rows = torch.cat([torch.full((n, W), float(v)) for v, n in zip(values, lengths, strict=True)])
    return done({"aux_hidden": rows, "final_hidden": rows[:, :1].clone()}, lengths)


def test_batches_in_length_order_land_in_shard_order(tmp_path):
    lengths = [3, 1, 5, 2]
    job = ShardJob(tmp_path / "s", [[0] * n for n in lengths], [[1] * n for n in lengths], bytes_bound=10)
    seen = {}

    def write(j: ShardJob) -> int:
        seen.update({k: v.clone() for k, v in j.rows.items()})
        return 7
    with ShardWriter(write, budget_bytes=10) as w:
        w.submit(job, [1, 3], _rows([1, 3], [1, 2]))          # the short sequences first, as extract batches
        w.submit(job, [0, 2], _rows([0, 2], [3, 5]))
        w.finish(job)
    expect = torch.cat([torch.full((n, W), float(i)) for i, n in enumerate(lengths)])
    assert torch.equal(seen["aux_hidden"], expect) and torch.equal(seen["final_hidden"], expect[:, :1])
    assert w.bytes_written == 7


def test_writes_wait_for_uploads_so_local_bytes_stay_under_the_budget(tmp_path):
    on_disk, peak, lock = set(), [0], threading.Lock()
    uploaded = []

    def write(j: ShardJob) -> int:
        with lock:
            on_disk.add(j.path)
            peak[0] = max(peak[0], sum(30 for _ in on_disk))
        return 30

    def upload(j: ShardJob) -> None:
        time.sleep(0.02)                                     # a slow store
        with lock:
            on_disk.discard(j.path)
        uploaded.append(j.tag)

    with ShardWriter(write, budget_bytes=70, upload=upload) as w:   # room for two 30-byte shards
        for i in range(8):
            job = ShardJob(tmp_path / f"s{i}", [[0, 0]], [[1, 1]], bytes_bound=30, tag=i)
            w.submit(job, [0], _rows([i], [2]))
            w.finish(job)
    assert uploaded == list(range(8))
    assert 30 <= peak[0] <= 60 and w.budget.used == 0


def test_a_failed_write_is_raised_to_the_caller_and_frees_the_host_buffers(tmp_path):
    released, submitted = [], []

    def write(j: ShardJob) -> int:
        raise OSError("disk full")
    w = ShardWriter(write, budget_bytes=100)
    with pytest.raises(OSError, match="disk full"):
        for i in range(20):                                  # far more than the queue holds: never blocks
            job = ShardJob(tmp_path / f"s{i}", [[0]], [[1]], bytes_bound=1)
            pending = _rows([i], [1])
            pending._on_release = lambda i=i: released.append(i)
            w.submit(job, [0], pending)
            submitted.append(i)
            w.finish(job)
        w.close()
    w.close(raise_error=False)
    assert 1 <= len(submitted) < 20 and sorted(released) == submitted   # every queued batch handed back
