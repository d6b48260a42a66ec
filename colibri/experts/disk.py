"""Reads routed experts from the checkpoint by byte range on a thread pool (optionally O_DIRECT)."""

from __future__ import annotations

import mmap
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from colibri.checkpoint import Checkpoint, CheckpointError, raw_dtype, to_f32
from colibri.config import ModelConfig
from colibri.experts.ram import Weights
from colibri.weights import ExpertSlab, expert_slab

_ALIGN = 4096


class DiskReader:
    """pread of one expert's three byte ranges; counts bytes and thread-seconds spent reading."""

    def __init__(self, ckpt: Checkpoint, cfg: ModelConfig, threads: int = 4, direct: bool = False):
        self.ckpt, self.cfg = ckpt, cfg
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="colibri-disk")
        self.bytes_read = 0
        self.reads = 0
        self.thread_seconds = 0.0  # t_edisk
        self._lock = threading.Lock()
        self._direct_fds: dict[Path, int] = {}
        self._slabs: dict[tuple[int, int], ExpertSlab] = {}

    def slab(self, layer: int, expert: int) -> ExpertSlab:
        key = (layer, expert)
        s = self._slabs.get(key)
        if s is None:
            s = self._slabs[key] = expert_slab(self.ckpt, self.cfg, layer, expert)
        return s

    def submit(self, layer: int, expert: int) -> Future:
        """Start reading expert `expert` of checkpoint layer `layer`; the future gives Weights."""
        return self.pool.submit(self.read, layer, expert)

    def read(self, layer: int, expert: int) -> Weights:
        t0 = time.perf_counter()
        slab = self.slab(layer, expert)
        F, D = self.cfg.moe.moe_ff, self.cfg.hidden
        parts = [self._read_part(t, off, n) for t, off, n in slab.parts]
        w = (parts[0].reshape(F, D), parts[1].reshape(F, D), parts[2].reshape(D, F))
        with self._lock:
            self.bytes_read += slab.nbytes
            self.reads += 1
            self.thread_seconds += time.perf_counter() - t0
        return w

    def _read_part(self, t, off: int, n: int) -> np.ndarray:
        if not self.direct:
            return self.ckpt.read_part(t, off, n)
        start = t.offset + off
        lo = start - start % _ALIGN
        hi = -(-(start + n) // _ALIGN) * _ALIGN
        buf = mmap.mmap(-1, hi - lo)  # page-aligned, as O_DIRECT requires
        try:
            got = os.preadv(self._direct_fd(t.path), [buf], lo)
            if got < start + n - lo:
                raise CheckpointError(f"{t.path}: short read of {t.name!r} at byte {start}")
            return _widen(buf, t.dtype, start - lo, n)
        finally:
            buf.close()

    def _direct_fd(self, path: Path) -> int:
        fd = self._direct_fds.get(path)
        if fd is None:
            fd = self._direct_fds[path] = os.open(path, os.O_RDONLY | os.O_DIRECT)
        return fd

    def drop_page_cache(self) -> None:
        """Ask the kernel to forget cached pages of every checkpoint file (cold-read benchmarks)."""
        for path in self.ckpt.files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for fd in self._direct_fds.values():
            os.close(fd)
        self._direct_fds.clear()


def _widen(buf: mmap.mmap, dtype: str, offset: int, n: int) -> np.ndarray:
    """float32 copy of n raw bytes at offset; the view into buf dies with this frame."""
    dt = raw_dtype(dtype)
    return to_f32(np.frombuffer(buf, dtype=dt, count=n // dt.itemsize, offset=offset), dtype).copy()
