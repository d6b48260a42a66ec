"""Host arrays on 2 MiB pages: fewer TLB misses while decode streams the weights from RAM.

Decode on the CPU reads every chosen expert's weights, and every dense weight, from memory at
each step. On 4 KiB pages
a stream misses the TLB every 4 KiB and the hardware prefetchers stop at each page boundary.
`empty(shape, dtype)` gives an uninitialised numpy array whose memory Linux is asked to back
with transparent huge pages (`madvise(MADV_HUGEPAGE)` on a private anonymous mapping aligned to
2 MiB, before anything is written, so nothing is copied). That is what the common THP setting
`madvise` (/sys/kernel/mm/transparent_hugepage/enabled) waits for; under `never`, or where
there are no free huge pages, the array simply gets small pages. JAX on the CPU takes such an
array without copying it (`jax.device_put` keeps using the memory), so the expert stacks the
engine loads stay where they were written. Elsewhere (another OS, small arrays,
`COLIBRI_HUGE_PAGES=0`) it is `np.empty`. `hold(tree)` moves arrays made elsewhere (the dense
weights as the checkpoint reader gives them) into such memory.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading

import numpy as np

log = logging.getLogger(__name__)

HUGE = 2 << 20  # bytes in a huge page (x86-64 and arm64 with 4 KiB base pages)
MADV_POPULATE_WRITE = 23  # linux/mman.h, Linux 5.14


def enabled() -> bool:
    return (
        sys.platform.startswith("linux")
        and hasattr(mmap, "MADV_HUGEPAGE")
        and os.environ.get("COLIBRI_HUGE_PAGES", "1") != "0"
    )


def mapping(nbytes: int) -> mmap.mmap:
    """Private anonymous memory of `nbytes` (page-aligned, zeros until written), advised for
    huge pages where they are enabled. A shared mapping (the mmap module's default) would not
    get transparent huge pages."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if enabled():
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError as err:  # a kernel without transparent huge pages
            log.debug("no huge pages: %s", err)
    return m


def empty(shape, dtype=np.float32) -> np.ndarray:
    """An uninitialised C-contiguous array, on memory advised for huge pages where it spans
    at least one (see the module docstring)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count * dtype.itemsize
    if nbytes < HUGE or not enabled():
        return np.empty(shape, dtype)
    # One huge page more than needed, the array starting on a 2 MiB boundary inside it.
    m = mapping(nbytes + HUGE)
    skip = -np.frombuffer(m, np.uint8, 1).ctypes.data % HUGE
    return np.frombuffer(m, dtype, count, offset=skip).reshape(shape)


def hold(tree):
    """Move the numpy arrays of a tree of dicts and lists (the dense weights) into one mapping
    advised for huge pages, each on a 4 KiB boundary, where together they span at least one:
    the linear calls stream these at every step as the expert calls stream the experts. In
    place: each entry is replaced by its copy as that is made, so that the original can be
    freed then (the tree is not held twice). Returns `tree`."""
    entries = []  # (container, key, bytes); the arrays themselves are read at the copy

    def walk(node):
        for key in node if isinstance(node, dict) else range(len(node)):
            leaf = node[key]
            if isinstance(leaf, dict | list):
                walk(leaf)
            elif isinstance(leaf, np.ndarray) and leaf.nbytes >= mmap.PAGESIZE:
                entries.append((node, key, -(-leaf.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE))

    walk(tree)
    total = sum(size for _, _, size in entries)
    if total < HUGE or not enabled():
        return tree
    m = mapping(total + HUGE)
    at = -np.frombuffer(m, np.uint8, 1).ctypes.data % HUGE
    for node, key, size in entries:
        a = node[key]
        copy = np.frombuffer(m, a.dtype, a.size, offset=at).reshape(a.shape)
        copy[...] = a
        node[key] = copy
        at += size
    return tree


def populate(arrays) -> threading.Thread | None:
    """Fault in the memory of these arrays (those `empty` put on huge pages) from a thread of
    its own, as if each page were written, without writing: the caller may fill them at the
    same time, and the faults, slow on some machines (a VM's first touch of a huge page), run
    beside the caller's work instead of inside its writes. Returns the thread (None when
    there is nothing to do); `madvise(MADV_POPULATE_WRITE)`, Linux 5.14 or later."""
    arrays = [a for a in arrays if a.nbytes >= HUGE]  # held until done: never unmapped under it
    if not arrays or not enabled():
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def run() -> None:
        for a in arrays:  # ctypes lets go of the GIL during each call
            if fn(a.ctypes.data, a.nbytes, MADV_POPULATE_WRITE) != 0:
                log.debug("populate: %s", os.strerror(ctypes.get_errno()))
                return

    thread = threading.Thread(target=run, name="colibri-populate", daemon=True)
    thread.start()
    return thread


def huge_bytes(ranges) -> int:
    """Bytes of the memory ranges (address, nbytes) that this process has on huge pages, from
    /proc/self/smaps (0 where that cannot be read): the AnonHugePages of each mapping a range
    falls in, capped by the overlap. Exact for arrays from `empty` (a mapping each); a range
    inside a larger mapping may be credited with huge pages elsewhere in it."""
    ranges = [(lo, lo + n) for lo, n in ranges]
    total, hits = 0, []
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    start, end = (int(v, 16) for v in head.split("-"))
                    hits = [min(end, hi) - max(start, lo) for lo, hi in ranges]
                    hits = [h for h in hits if h > 0]
                elif hits and head == "AnonHugePages:":
                    total += min(int(line.split()[1]) * 1024, sum(hits))
    except OSError:
        return 0
    return total
