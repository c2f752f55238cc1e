"""Small local files that must survive a kill or a full disk: whole-file writes that are atomic, JSON-lines
logs appended a line at a time whose torn last line (a write cut off mid-line) is dropped on reading, and
listings of folders that other processes change while they are read."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from steps.lib.errors import ArtifactError

log = logging.getLogger(__name__)


def temp_name(path: Path) -> Path:
    """The temp file a writer in this process fills before renaming it onto `path`: a dot-file in the same
    folder (same filesystem, so the rename is atomic; hidden from store listings), named by the pid so
    `eaglenest store gc` can tell a dead writer's leftover from a live one's."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextlib.contextmanager
def naming(path: Path) -> Iterator[None]:
    """Give an OSError raised while writing `path` that path: a failed `f.write` (a full disk, ENOSPC) names
    no file, and the one line the step prints must say which file and filesystem filled up."""
    try:
        yield
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e


def disk_full_line(err: OSError) -> str:
    """ENOSPC as one line: the file, its filesystem's mount point and free bytes, and what to change."""
    # a copy's error names source then destination: the destination is the file that did not fit
    named = getattr(err, "filename2", None) or err.filename
    where = Path(named) if named else None
    probe = next((p for p in ([where, *where.parents] if where else []) if p.exists()), Path.cwd())
    mount = next((p for p in [probe, *probe.parents] if os.path.ismount(p)), Path("/"))
    free = shutil.disk_usage(probe).free
    what = f"writing {where}" if where else "writing a file the step did not name"
    return (f"no space left on device {what} (filesystem {mount}: {free} bytes free) — free space there, or "
            "move what fills it: the artifact store (--store / EAGLENEST_STORE), the scratch and cache dir "
            "(EAGLENEST_CACHE), or lower extraction's local peak (extract.disk_budget) or train.cache_budget")


def write_atomic(path: Path, data: bytes | str) -> None:
    """Replace `path` with `data` so a reader sees the old file or the new one, never a torn or empty one:
    the bytes go to a temp file in the same folder, are fsync'ed, then `os.replace`d onto the name. On any
    error (a full disk included) the temp file is removed and the old file, if any, is left as it was."""
    raw = data.encode() if isinstance(data, str) else data
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    try:
        with naming(path), open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def files_under(top: Path) -> list[Path]:
    """Every file below `top`, in string order (as S3 lists keys), while other processes add and remove files
    and folders there (a training step pruning its old checkpoints, an uploader deleting sent shards): what
    vanishes mid-walk is not listed, where `Path.rglob` raises FileNotFoundError for a folder removed between
    being seen and read."""
    found = []
    for folder, _, names in os.walk(top):       # os.walk skips a folder it can no longer open
        found.extend(p for p in (Path(folder, n) for n in names) if p.is_file())
    return sorted(found, key=str)             # Path order compares parts: 'a/x' before 'a-b/x'


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one record as one line with one write (a kill tears at most this last line). After a torn last
    line the record starts a line of its own, so it is never glued to the torn one and dropped with it."""
    with open(path, "a+b") as f:
        torn = f.tell() > 0 and f.seek(-1, os.SEEK_END) >= 0 and f.read(1) != b"\n"
        f.write((("\n" if torn else "") + json.dumps(record) + "\n").encode())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines log written by `append_jsonl` ([] when absent). A torn last line is
    dropped with a log line naming it; an unreadable line before it is not a torn write but damage."""
    if not path.exists():
        return []
    lines = path.read_text(errors="replace").splitlines()
    records = []
    for n, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if n < len(lines):
                raise ArtifactError(f"{path}:{n}: not a JSON line ({e}); delete {path.parent} to start over") from e
            log.warning("%s:%d: dropped a torn last line (%d bytes; a write cut off by a kill or a full disk)",
                        path, n, len(line))
    return records
