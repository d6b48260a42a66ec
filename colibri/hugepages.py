"""Weights on 2 MiB pages: fewer TLB misses while decode streams them from RAM.

Decode on the CPU reads every chosen expert's weights from memory at each step. On 4 KiB
pages a stream misses the TLB every 4 KiB and the hardware prefetchers stop at each page
boundary. `collapse(tree)` asks Linux (6.1 or later, `madvise(MADV_COLLAPSE)`) to move the
memory of every large CPU array in a pytree onto transparent huge pages, in place: contents,
addresses and JAX's view of the arrays are unchanged, so results are bitwise the same. It
works whatever /sys/kernel/mm/transparent_hugepage/enabled says (`madvise` is the common
default, under which nothing allocated by XLA gets huge pages). Where the kernel cannot (older
kernel, another OS, no free huge pages, memory that is not anonymous) the arrays simply stay
on small pages. `COLIBRI_HUGE_PAGES=0` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

import jax

log = logging.getLogger(__name__)

HUGE = 2 << 20  # bytes in a huge page (x86-64 and arm64 with 4 KiB base pages)
MADV_COLLAPSE = 25  # linux/mman.h, Linux 6.1
_MIN_BYTES = HUGE  # smaller arrays hold no whole huge page

_state: dict = {}  # "madvise": the libc function (None: no libc to call)


def enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get("COLIBRI_HUGE_PAGES", "1") != "0"


def _madvise():
    if "madvise" not in _state:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fn = libc.madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _state["madvise"] = fn
    return _state["madvise"]


def span(address: int, nbytes: int) -> tuple[int, int]:
    """The whole huge pages inside [address, address + nbytes): (start, length), length 0 if
    there are none."""
    lo = -(-address // HUGE) * HUGE
    hi = (address + nbytes) // HUGE * HUGE
    return lo, max(hi - lo, 0)


def collapse(tree) -> int:
    """Move the large CPU arrays of `tree` onto huge pages where the kernel can; returns the
    bytes now on huge pages (0 when off, not Linux, or nothing large enough)."""
    done = 0
    for a in jax.tree_util.tree_leaves(tree):
        if not isinstance(a, jax.Array) or a.nbytes < _MIN_BYTES:
            continue
        if any(d.platform != "cpu" for d in a.devices()) or len(a.addressable_shards) != 1:
            continue
        done += collapse_range(a.unsafe_buffer_pointer(), a.nbytes)
    return done


def collapse_range(address: int, nbytes: int) -> int:
    """The same for the memory [address, address + nbytes) of this process (a numpy array's
    `ctypes.data`, say): bytes now on huge pages."""
    fn = _madvise() if enabled() else None
    start, length = span(address, nbytes)
    if fn is None or length == 0:
        return 0
    if fn(start, length, MADV_COLLAPSE) == 0:
        return length
    # No free huge pages now, memory that is not anonymous, or an older kernel.
    log.debug("huge pages refused for %d bytes: %s", length, os.strerror(ctypes.get_errno()))
    return 0
