"""Small files that survive a kill or a full disk (steps/lib/files.py)."""

from __future__ import annotations

import errno
import os

import pytest

from steps.lib.errors import ArtifactError
from steps.lib.files import append_jsonl, read_jsonl, write_atomic


def test_a_write_cut_off_by_a_full_disk_leaves_the_old_file_whole_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    write_atomic(path, '{"step": 3}')

    def full_disk(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError) as e:
        write_atomic(path, '{"step": 6}')
    assert e.value.errno == errno.ENOSPC
    assert path.read_text() == '{"step": 3}'
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_torn_last_line_is_dropped_and_a_damaged_earlier_one_is_named(tmp_path, caplog):
    path = tmp_path / "log.jsonl"
    append_jsonl(path, {"step": 0})
    with path.open("a") as f:
        f.write('{"step": 1, "lo')
    with caplog.at_level("WARNING"):
        assert read_jsonl(path) == [{"step": 0}]
    assert f"{path}:2: dropped a torn last line" in caplog.text
    append_jsonl(path, {"step": 2})               # the torn line is now in the middle: damage, not a torn write
    with pytest.raises(ArtifactError, match=f"{path}:2: not a JSON line"):
        read_jsonl(path)
    assert read_jsonl(tmp_path / "absent.jsonl") == []

