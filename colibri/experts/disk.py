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
    """pread of one expert's three byte ranges; counts bytes, thread-seconds and busy wall time.

    `busy_seconds` is the wall-clock time during which at least one read was in flight (the
    union of the reads' intervals), so `bytes_read / busy_seconds` is the bandwidth the disk
    delivered while loading, apart from the time the compute thread spent on anything else.
    """

    def __init__(self, ckpt: Checkpoint, cfg: ModelConfig, threads: int = 4, direct: bool = False):
        self.ckpt, self.cfg = ckpt, cfg
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="colibri-disk")
        self.bytes_read = 0
        self.reads = 0
        self.thread_seconds = 0.0  # t_edisk
        self._busy = 0.0  # closed intervals with a read in flight
        self._active = 0  # reads in flight now
        self._busy_since = 0.0
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

    @property
    def busy_seconds(self) -> float:
        """Wall seconds with at least one read in flight, including the interval open now."""
        with self._lock:
            open_now = time.perf_counter() - self._busy_since if self._active else 0.0
            return self._busy + open_now

    def read(self, layer: int, expert: int) -> Weights:
        t0 = time.perf_counter()
        slab = self.slab(layer, expert)
        F, D = self.cfg.moe.moe_ff, self.cfg.hidden
        parts = self._read_parts(slab)
        w = (parts[0].reshape(F, D), parts[1].reshape(F, D), parts[2].reshape(D, F))
        with self._lock:
            self.bytes_read += slab.nbytes
            self.reads += 1
            self.thread_seconds += time.perf_counter() - t0
        return w

    def _begin(self) -> None:
        with self._lock:
            if self._active == 0:
                self._busy_since = time.perf_counter()
            self._active += 1

    def _end(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._busy += time.perf_counter() - self._busy_since

    def _read_parts(self, slab: ExpertSlab) -> list[np.ndarray]:
        """The slab's three matrices; one read when they sit close together in one file.

        transformers writes an expert's down/gate/up tensors next to each other, so one
        request of ~3 matrices replaces three smaller ones.
        """
        starts = [t.offset + off for t, off, _ in slab.parts]
        ends = [s + n for s, (_, _, n) in zip(starts, slab.parts, strict=True)]
        one_file = len({t.path for t, _, _ in slab.parts}) == 1
        lo, hi = min(starts), max(ends)
        if one_file and hi - lo <= 2 * slab.nbytes:
            path = slab.parts[0][0].path
            return self._with_span(
                path,
                lo,
                hi - lo,
                [(t.dtype, s - lo, n) for (t, _, n), s in zip(slab.parts, starts, strict=True)],
            )
        return [
            self._with_span(t.path, s, n, [(t.dtype, 0, n)])[0]
            for (t, _, n), s in zip(slab.parts, starts, strict=True)
        ]

    def _with_span(self, path: Path, start: int, n: int, pieces) -> list[np.ndarray]:
        """Read bytes [start, start+n) of path; float32 copies of (dtype, offset, nbytes) pieces."""
        if not self.direct:
            self._begin()
            try:
                buf = self.ckpt.pread(path, start, n)
            finally:
                self._end()
            return [_widen(buf, dt, off, m) for dt, off, m in pieces]
        lo = start - start % _ALIGN
        hi = -(-(start + n) // _ALIGN) * _ALIGN
        buf = mmap.mmap(-1, hi - lo)  # page-aligned, as O_DIRECT requires
        try:
            self._begin()
            try:
                got = os.preadv(self._direct_fd(path), [buf], lo)
            finally:
                self._end()
            if got < start + n - lo:
                raise CheckpointError(f"{path}: short read at byte {start}")
            return [_widen(buf, dt, start - lo + off, m) for dt, off, m in pieces]
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


def _widen(buf, dtype: str, offset: int, n: int) -> np.ndarray:
    """float32 copy of n raw bytes at offset; the view into buf dies with this frame."""
    dt = raw_dtype(dtype)
    return to_f32(np.frombuffer(buf, dtype=dt, count=n // dt.itemsize, offset=offset), dtype).copy()
