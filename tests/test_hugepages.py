"""Weights moved onto 2 MiB pages: in place, values unchanged, only where the kernel can."""

from __future__ import annotations

import ctypes
import mmap
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from colibri import hugepages
from colibri.hugepages import HUGE, span


def kernel_collapses() -> bool:
    """Whether this kernel moves a fresh anonymous mapping onto huge pages on request."""
    if not sys.platform.startswith("linux"):
        return False
    m = mmap.mmap(-1, 3 * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = ctypes.c_char.from_buffer(m)
    try:
        m.write(b"x" * (3 * HUGE))
        start, length = span(ctypes.addressof(buf), 3 * HUGE)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise(start, length, hugepages.MADV_COLLAPSE) == 0
    finally:
        del buf
        m.close()


def huge_kib_at(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_span_is_the_whole_huge_pages_inside():
    assert span(0, 3 * HUGE) == (0, 3 * HUGE)
    assert span(1, 3 * HUGE) == (HUGE, 2 * HUGE)  # the first page is cut
    assert span(HUGE - 4096, HUGE + 8192) == (HUGE, HUGE)
    assert span(HUGE + 1, HUGE) == (2 * HUGE, 0)  # no whole page
    assert span(5 * HUGE, 0) == (5 * HUGE, 0)


@pytest.mark.skipif(not kernel_collapses(), reason="this kernel has no MADV_COLLAPSE")
def test_large_arrays_move_onto_huge_pages_in_place():
    rng = np.random.default_rng(0)
    big = jnp.asarray(rng.standard_normal((3, 1024, 1024), np.float32))  # 12 MiB
    small = jnp.asarray(rng.standard_normal((64, 64), np.float32))
    before = np.asarray(big).copy()
    where = big.unsafe_buffer_pointer()
    start, length = span(where, big.nbytes)
    assert length >= 4 * HUGE

    assert hugepages.collapse({"w": [big, small], "n": 3}) == length

    assert big.unsafe_buffer_pointer() == where
    assert huge_kib_at(start) * 1024 >= length
    np.testing.assert_array_equal(np.asarray(big), before)
    np.testing.assert_array_equal(np.asarray(big * 2), before * 2)  # still usable by XLA


def test_off_switch_and_small_arrays(monkeypatch):
    big = jnp.zeros((4 * HUGE // 4,), jnp.float32)
    monkeypatch.setenv("COLIBRI_HUGE_PAGES", "0")
    assert hugepages.collapse([big]) == 0
    monkeypatch.delenv("COLIBRI_HUGE_PAGES")
    assert hugepages.collapse([jnp.zeros((1000,), jnp.float32), np.zeros(HUGE)]) == 0
