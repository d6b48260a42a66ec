"""Reads routed experts from the checkpoint by byte range, in pieces on a thread pool."""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import numpy as np

from colibri import hugepages
from colibri.checkpoint import Checkpoint, CheckpointError, Scales, raw_dtype, to_held
from colibri.config import ModelConfig
from colibri.experts.ram import Weights
from colibri.weights import ExpertSlab, expert_shapes, expert_slab, row_blocks

log = logging.getLogger("colibri")

_ALIGN = 4096  # O_DIRECT: offsets, lengths and buffer addresses on this boundary
PIECE = 512 << 10  # bytes per read request: one expert becomes several requests in flight
_SPARE = 256 << 20  # read buffers kept for reuse, at most
_COALESCE_SLACK = 2  # one range for a slab whose matrices span at most this many times its bytes


@dataclass(frozen=True)
class _Span:
    """Bytes [start, start + n) of one file, read to buffer offset `at` + (start - aligned lo)."""

    path: Path
    start: int
    n: int
    at: int  # buffer offset of the aligned span start; a multiple of _ALIGN

    @property
    def lo(self) -> int:
        return self.start - self.start % _ALIGN

    @property
    def hi(self) -> int:
        return -(-(self.start + self.n) // _ALIGN) * _ALIGN

    @property
    def data_at(self) -> int:
        """Where byte `start` lands in the buffer."""
        return self.at + self.start - self.lo


@dataclass
class _Load:
    """One request in flight: its buffer, the pieces not yet read, and what to make of it."""

    buf: mmap.mmap
    spans: list[_Span]
    finish: Callable[[mmap.mmap], object]
    nbytes: int  # useful bytes, counted once the request completes
    future: Future = field(default_factory=Future)
    left: int = 0
    error: BaseException | None = None
    thread_seconds: float = 0.0


class DiskReader:
    """Reads experts' byte ranges as pieces of `piece` bytes in parallel on `threads` threads.

    One expert is one to three byte ranges (~1.5 MB for a bf16 512x512 expert); read as a
    single request it would wait on one device round trip at a time, so each range is split
    into aligned pieces that are in flight together. Raw bytes land in reusable page-aligned
    buffers (huge pages where the kernel allows: O_DIRECT requests then travel as a few
    large segments instead of 4 KiB ones, measured 2x faster on a virtio disk) and are
    copied out as `held` (float32, bfloat16 bits or FP8 rows; weights.expert_dtype) by the thread
    that reads the last piece, after its read.

    Counters: `bytes_read` (useful bytes of completed requests), `thread_seconds` (t_edisk:
    reader thread time, reading and widening), and `busy_seconds`, the wall-clock time during
    which at least one read was in flight (the union of the reads' intervals), so
    `bytes_read / busy_seconds` is the bandwidth the disk delivered while loading.
    """

    def __init__(
        self,
        ckpt: Checkpoint,
        cfg: ModelConfig,
        threads: int = 4,
        direct: bool = False,
        piece: int = PIECE,
        held: np.dtype = np.float32,
    ):
        if piece < _ALIGN or piece % _ALIGN:
            raise ValueError(f"piece={piece} must be a positive multiple of {_ALIGN}")
        self.ckpt, self.cfg, self.held = ckpt, cfg, np.dtype(held)
        self.blocks = row_blocks(ckpt, cfg, self.held)  # scale block widths of held rows
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.piece = piece
        self._workers = _Workers(threads, self._piece)
        self._loads: dict[Future, _Load] = {}  # requests with pieces still to read
        self.bytes_read = 0
        self.reads = 0
        self.thread_seconds = 0.0  # t_edisk
        self._busy = 0.0  # closed intervals with a read in flight
        self._active = 0  # reads in flight now
        self._busy_since = 0.0
        self._lock = threading.Lock()
        self._fds: dict[Path, int] = {}
        self._fd_lock = threading.Lock()
        self._buffers = _Buffers(keep=_SPARE)
        self._slabs: dict[tuple[int, int], ExpertSlab] = {}

    # -- public --------------------------------------------------------------------------

    def slab(self, layer: int, expert: int) -> ExpertSlab:
        key = (layer, expert)
        s = self._slabs.get(key)
        if s is None:
            s = self._slabs[key] = expert_slab(self.ckpt, self.cfg, layer, expert)
        return s

    def submit(self, layer: int, expert: int, urgent: bool = True) -> Future:
        """Start reading expert `expert` of checkpoint layer `layer`; the future gives Weights.

        A request that is not `urgent` (a prefetch) waits while urgent pieces are queued.
        """
        slab = self.slab(layer, expert)
        ranges = _ranges(slab)
        spans = self._layout([r for r, _ in ranges])
        contents = [(span, parts) for span, (_, parts) in zip(spans, ranges, strict=True)]
        shapes = expert_shapes(self.cfg, self.held, self.blocks).values()
        # Quantized matrices: their scales, a few KiB read now (None for other dtypes).
        scales = [self.ckpt.scales(t, off, n) for t, off, n in slab.parts]
        parts = [(s, dt, off, n) for s, held in contents for dt, off, n in held]

        def finish(buf: mmap.mmap) -> Weights:
            flat = [
                _held(buf, dt, s.data_at + off, n, self.held, sc)
                for (s, dt, off, n), sc in zip(parts, scales, strict=True)
            ]
            return tuple(a.reshape(shape) for a, shape in zip(flat, shapes, strict=True))

        return self._start(spans, finish, slab.nbytes, urgent)

    def read(self, layer: int, expert: int) -> Weights:
        return self.submit(layer, expert).result()

    def read_bytes(self, path: Path, start: int, n: int) -> bytes:
        """Bytes [start, start + n) of `path`, read the way experts are (pieces, alignment)."""
        span = self._layout([(Path(path), start, n)])[0]
        return self._start(
            [span], lambda buf: bytes(buf[span.data_at : span.data_at + n]), n
        ).result()

    def in_flight(self) -> int:
        """Requests started and not yet complete (each holds a read buffer)."""
        with self._lock:
            return len(self._loads)

    def buffer_bytes(self, layer: int, expert: int) -> int:
        """The read buffer one request for (layer, expert) takes: its byte ranges' aligned
        covers, in whole huge pages."""
        spans = self._layout([r for r, _ in _ranges(self.slab(layer, expert))])
        size = sum(sp.hi - sp.lo for sp in spans)
        return max(hugepages.HUGE, -(-size // hugepages.HUGE) * hugepages.HUGE)

    def keep_spare(self, nbytes: int) -> None:
        """Keep at most `nbytes` of finished reads' buffers for reuse (default 256 MiB)."""
        self._buffers.keep = nbytes

    @property
    def busy_seconds(self) -> float:
        """Wall seconds with at least one read in flight, including the interval open now."""
        with self._lock:
            open_now = time.perf_counter() - self._busy_since if self._active else 0.0
            return self._busy + open_now

    def close(self) -> None:
        self._workers.close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._buffers.close()

    # -- requests and pieces -------------------------------------------------------------

    @staticmethod
    def _layout(ranges: list[tuple[Path, int, int]]) -> list[_Span]:
        """Place each byte range's aligned cover one after the other in a buffer."""
        spans, at = [], 0
        for path, start, n in ranges:
            s = _Span(path, start, n, at)
            spans.append(s)
            at += s.hi - s.lo
        return spans

    def _start(self, spans: list[_Span], finish, nbytes: int, urgent: bool = True) -> Future:
        size = sum(s.hi - s.lo for s in spans)
        load = _Load(self._buffers.take(size), spans, finish, nbytes)
        pieces = [(load, s, p, m) for s in spans for p, m in _split(s.lo, s.hi, self.piece)]
        load.left = len(pieces)
        with self._lock:
            self._loads[load.future] = load
        self._workers.put(pieces, urgent)  # all pieces at once: one request's queue depth
        return load.future

    def promote(self, future: Future) -> None:
        """A forward now waits on this read (a prefetch so far): its queued pieces go first."""
        with self._lock:
            load = self._loads.get(future)
        if load is not None:
            self._workers.promote(load)

    def _piece(self, load: _Load, s: _Span, offset: int, m: int) -> None:
        t0 = time.perf_counter()
        try:
            need = min(offset + m, s.start + s.n) - offset  # the rest may lie past the file end
            self._pread(s.path, load.buf, s.at + offset - s.lo, offset, m, need)
        except BaseException as e:  # handed to the request's future
            with self._lock:
                load.error = load.error or e
        with self._lock:
            load.thread_seconds += time.perf_counter() - t0
            load.left -= 1
            last = load.left == 0
        if last:
            self._complete(load)

    def _complete(self, load: _Load) -> None:
        """Widen (or copy out) a fully read request, free its buffer, resolve its future."""
        t0 = time.perf_counter()
        try:
            result = None if load.error else load.finish(load.buf)
        except BaseException as e:
            load.error = e
        self._buffers.give(load.buf)
        with self._lock:
            self._loads.pop(load.future, None)
            self.thread_seconds += load.thread_seconds + time.perf_counter() - t0
            if load.error is None:
                self.bytes_read += load.nbytes
                self.reads += 1
        if load.error is not None:
            load.future.set_exception(load.error)
        else:
            load.future.set_result(result)

    def _pread(self, path: Path, buf: mmap.mmap, at: int, offset: int, m: int, need: int) -> None:
        """Read up to m bytes at `offset` into buf[at:], insisting on the first `need`."""
        fd = self._fd(path)
        done = 0
        with memoryview(buf) as mv:
            while done < need:
                self._begin()
                try:
                    got = os.preadv(fd, [mv[at + done : at + m]], offset + done)
                finally:
                    self._end()
                done += got
                if done < need and (got == 0 or (self.direct and got % _ALIGN)):
                    raise CheckpointError(
                        f"{path}: file ends at byte {offset + done}, expected more"
                    )

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

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is not None:
            return fd
        with self._fd_lock:
            if path not in self._fds:
                self._fds[path] = self._open(path)
            return self._fds[path]

    def _open(self, path: Path) -> int:
        if self.direct:
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as e:  # e.g. tmpfs refuses O_DIRECT: read through the page cache
                log.warning("%s: O_DIRECT unavailable (%s); reading buffered", path, e)
        fd = os.open(path, os.O_RDONLY)
        if hasattr(os, "posix_fadvise"):  # no readahead: it read 1.5x the bytes asked for
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return fd


def drop_page_cache(files: list[Path]) -> None:
    """Ask the kernel to forget cached pages of `files` (cold-read benchmarks)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _split(lo: int, hi: int, piece: int) -> list[tuple[int, int]]:
    """(offset, length) pieces of the aligned range [lo, hi), all about `piece` bytes.

    Even sizes rather than `piece`-sized ones plus a sliver: a 1.5 MiB + 4 KiB expert becomes
    three 516 KiB reads, not three of 512 KiB and a fourth of 4 KiB.
    """
    pages = (hi - lo) // _ALIGN
    n = max(1, round((hi - lo) / piece))
    cuts = [lo + (pages * i // n) * _ALIGN for i in range(n + 1)]
    return [(a, b - a) for a, b in pairwise(cuts) if b > a]


class _Workers:
    """Up to `n` reader threads that take urgent pieces first (a forward never queues behind a
    prefetch). Threads start when work arrives and leave after `idle` seconds without any,
    so a reader that is never used, or dropped without `close`, holds none."""

    def __init__(self, n: int, run: Callable, idle: float = 10.0):
        self.n, self._run, self._idle_exit = n, run, idle
        self._urgent: deque = deque()
        self._later: deque = deque()
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting for work
        self._closed = False

    def put(self, items: list[tuple], urgent: bool) -> None:
        with self._cond:
            (self._urgent if urgent else self._later).extend(items)
            self._cond.notify(len(items))
            self._threads = [t for t in self._threads if t.is_alive()]
            queued = len(self._urgent) + len(self._later)
            for _ in range(min(self.n - len(self._threads), queued - self._idle)):
                t = threading.Thread(target=self._loop, name="colibri-disk", daemon=True)
                self._threads.append(t)
                t.start()

    def promote(self, load: _Load) -> None:
        with self._cond:
            mine = [it for it in self._later if it[0] is load]
            if mine:
                self._later = deque(it for it in self._later if it[0] is not load)
                self._urgent.extend(mine)

    def _loop(self) -> None:
        while (item := self._take()) is not None:
            self._run(*item)

    def _take(self) -> tuple | None:
        """The next piece; None once closed and drained, or after `idle` seconds without work."""
        with self._cond:
            self._idle += 1
            try:
                while not (self._urgent or self._later or self._closed):
                    if not self._cond.wait(self._idle_exit) and not (self._urgent or self._later):
                        self._threads.remove(threading.current_thread())
                        return None
                if not (self._urgent or self._later):
                    return None
                return (self._urgent or self._later).popleft()
            finally:
                self._idle -= 1

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            threads = list(self._threads)
        for t in threads:
            t.join()


def _ranges(slab: ExpertSlab) -> list[tuple[tuple[Path, int, int], list[tuple[str, int, int]]]]:
    """Byte ranges to read for a slab, each with the (dtype, offset in range, nbytes) it holds.

    One range when the three matrices sit close together in one file (transformers writes an
    expert's tensors next to each other), else one range per matrix.
    """
    starts = [t.offset + off for t, off, _ in slab.parts]
    ends = [s + n for s, (_, _, n) in zip(starts, slab.parts, strict=True)]
    lo, hi = min(starts), max(ends)
    if len({t.path for t, _, _ in slab.parts}) == 1 and hi - lo <= _COALESCE_SLACK * slab.nbytes:
        parts = [(t.dtype, s - lo, n) for (t, _, n), s in zip(slab.parts, starts, strict=True)]
        return [((slab.parts[0][0].path, lo, hi - lo), parts)]
    return [
        ((t.path, s, n), [(t.dtype, 0, n)]) for (t, _, n), s in zip(slab.parts, starts, strict=True)
    ]


def _held(
    buf, dtype: str, offset: int, n: int, held: np.dtype, scales: Scales | None = None
) -> np.ndarray:
    """n raw bytes at offset of buf, copied out as `held` (no view into buf survives); FP8
    and pack-quantized bytes dequantized with their `scales`."""
    dt = raw_dtype(dtype)
    raw = np.frombuffer(buf, dtype=dt, count=n // dt.itemsize, offset=offset)
    return to_held(raw, dtype, held, scales)


class _Buffers:
    """Reusable page-aligned read buffers in whole huge pages; keeps up to `keep` spare bytes."""

    def __init__(self, keep: int):
        self.keep = keep
        self.spare = 0
        self._free: dict[int, list[mmap.mmap]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> mmap.mmap:
        size = max(hugepages.HUGE, -(-nbytes // hugepages.HUGE) * hugepages.HUGE)  # whole pages
        with self._lock:
            free = self._free.get(size)
            if free:
                self.spare -= size
                return free.pop()
        return _new_buffer(size)

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            if self.spare + len(buf) <= self.keep:
                self._free.setdefault(len(buf), []).append(buf)
                self.spare += len(buf)
                return
        _close(buf)

    def close(self) -> None:
        with self._lock:
            bufs = [b for v in self._free.values() for b in v]
            self._free.clear()
            self.spare = 0
        for b in bufs:
            _close(b)


def _new_buffer(size: int) -> mmap.mmap:
    """Private anonymous memory (page-aligned), huge pages advised, every page touched once
    (keeps page faults out of the timed reads)."""
    buf = hugepages.mapping(size)
    for i in range(0, size, _ALIGN):
        buf[i] = 0
    return buf


def _close(buf: mmap.mmap) -> None:
    try:
        buf.close()
    except BufferError:  # a view still exists somewhere; the mapping goes with it
        pass
