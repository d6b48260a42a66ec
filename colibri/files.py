"""Durable writes for the engine's state files (`.coli_usage`, the KV files): a crash or a full
disk never leaves a torn file, nor the temporary file behind."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: str | Path, data: bytes) -> None:
    """Replace the file's content: written to a temporary file beside it, fsynced, renamed over
    it, the folder fsynced. On any error the temporary file is removed, the file keeps its last
    content, and the error is raised."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def append_durable(path: str | Path, data: bytes) -> None:
    """Append and fsync. On an error the file is cut back to its length before, so a reader
    never meets part of a record, and the error is raised."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        size = os.fstat(fd).st_size
        try:
            _write_all(fd, data)
            os.fsync(fd)
        except BaseException:
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass  # the reader's checksums still find the torn tail
            raise
    finally:
        os.close(fd)


def fsync_dir(folder: str | Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
