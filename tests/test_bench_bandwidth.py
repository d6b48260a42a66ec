"""The bandwidth probe's arithmetic rate (colibri.bench.bandwidth.tiles_rate): the rate of runs
that fault no page in, as the engine's decode steps fault none."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import pytest

from colibri import kernels
from colibri.bench import bandwidth


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_program_run_again_faults_no_page_in_once_freed_memory_is_kept():
    bandwidth.keep_freed_memory()
    big = jax.jit(lambda x: [x + float(i) for i in range(4)])  # 4 results of 8 MiB each
    x = jnp.ones((2048, 1024), jnp.float32)
    faults = []
    for _ in range(6):
        before = bandwidth._minor_faults()
        jax.block_until_ready(big(x))
        faults.append(bandwidth._minor_faults() - before)
    assert faults[0] > 0, "the first run's results are in fresh pages"
    assert 0 in faults[1:], f"every run faulted its results' pages in anew: {faults}"


@pytest.mark.skipif(not kernels.available(), reason="the native kernels' linear calls")
def test_tiles_rate_is_the_16_row_linear_kernels_rate():
    a = bandwidth.probe_array(1 / 32)
    rate = bandwidth.tiles_rate(a, 512, rows=16, repeats=2, chunk_rows=1024)
    assert 0 < rate < 10 * kernels.fma_peak(16)
