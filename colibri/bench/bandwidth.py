"""The machine's memory bandwidth, probed as the peers benchmark's roofline reads it, and the
disk's: a cold pread of a checkpoint's files, as the offload benchmarks' bounds read it."""

from __future__ import annotations

import ctypes
import os
import resource
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from colibri import hugepages, kernels
from colibri.experts.disk import drop_page_cache


def probe_array(gib: float) -> np.ndarray:
    """`gib` GiB of float32 ones on huge pages, as colibri's experts are held
    (colibri/hugepages.py): what the probes read."""
    a = hugepages.empty(int(gib * (1 << 30)) // 4, np.float32)
    a[:] = 1.0
    return a


def call_rate(call, nbytes: int, tries: int) -> float:
    """GB/s of the fastest of `tries` runs of `call()`, which reads `nbytes`."""
    best = 0.0
    for _ in range(tries):
        t = time.perf_counter()
        call()
        best = max(best, nbytes / (time.perf_counter() - t) / 1e9)
    return best


def fma_ceiling(repeats: int = 1) -> float:
    """GFLOP/s of multiply-adds on all cores on the wider of the vectors the build has (512-bit
    where it has AVX-512), the best of `repeats` probes of each: the ceiling of the tiles'
    arithmetic (0 without the kernels)."""
    return max(kernels.fma_peak(n) for n in (8, 16) for _ in range(repeats))


def read_rate(a: np.ndarray, read=None) -> float:
    """GB/s of one read of `a` by every core at once, each over its share: `read` a function of
    a contiguous array (default: `kernels.read_sum`, eight 8-lane sums and nothing else)."""
    threads = os.cpu_count() or 1
    parts = np.array_split(a, threads)
    started = threading.Barrier(threads)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda _: started.wait(), range(threads)))  # every thread before the clock
        t = time.perf_counter()
        list(pool.map(read or kernels.read_sum, parts))
        return a.nbytes / (time.perf_counter() - t) / 1e9


class PassProbe:
    """Before each pass of a side-by-side run (replay.alternate's before_pass): a plain read of
    `gib` GiB on huge pages by every core (read_rate, the best of two), its GB/s kept in
    `rates`. On a machine whose memory changes speed from one minute to the next it says which
    minute each pass met."""

    def __init__(self, gib: float = 1.0):
        self.array = probe_array(gib)
        self.rates: list[float] = []

    def __call__(self) -> None:
        self.rates.append(max(read_rate(self.array) for _ in range(2)))


def memory_bandwidth(gib: float = 1.0, repeats: int = 5, columns: tuple[int, ...] = ()) -> dict:
    """Read bandwidth GB/s: the best of plain reads over every core's share (`kernels.read_sum`:
    eight 8-lane sums, nothing else), numpy sums, OpenBLAS gemv, XLA's matrix-vector product
    (x @ A, A [K, N]: its fastest layout here) and colibri's own linear kernel on one row (its
    streams a quarter of the matrix apart read faster than one sequential pass here). The array
    is on huge pages, as colibri's experts are (colibri/hugepages.py). Also the arithmetic rate
    of that kernel on 16 rows over the same array (`kernel_16_gflop_s`): what the cores compute
    when every weight meets 16 inputs as it streams in from DRAM; and the ceiling of that
    arithmetic, the cores' multiply-add rate on 256-bit and (where the build has them) 512-bit
    vectors (`fma_peak_gflop_s`, `fma_peak_512_gflop_s`). `columns`: that 16-row rate also over
    rows of each of these widths (`kernel_16_gflop_s_at`, by width: a model's hidden size)."""
    a = probe_array(gib)
    best_sum = best_read = 0.0
    for _ in range(repeats):
        best_sum = max(best_sum, read_rate(a, np.sum))
        if kernels.available():
            best_read = max(best_read, read_rate(a))
    m = a.reshape(-1, 4096)
    v = np.ones(4096, np.float32)
    best_gemv = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        m @ v
        best_gemv = max(best_gemv, a.nbytes / (time.perf_counter() - t) / 1e9)

    dev = jnp.asarray(m.reshape(4096, -1))  # the same memory (JAX takes it without a copy)
    vec = jnp.ones((1, 4096), jnp.float32)
    xla_gemv = jax.jit(lambda a, x: x @ a)
    xla_gemv(dev, vec).block_until_ready()
    best_xla = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        xla_gemv(dev, vec).block_until_ready()
        best_xla = max(best_xla, a.nbytes / (time.perf_counter() - t) / 1e9)
    del dev
    best_kernel = 0.0
    if kernels.available():
        w = jnp.asarray(m)  # [rows, 4096], the same memory again
        kernel_gemv = jax.jit(kernels.linear)
        kernel_gemv(vec, w).block_until_ready()
        for _ in range(repeats):
            t = time.perf_counter()
            kernel_gemv(vec, w).block_until_ready()
            best_kernel = max(best_kernel, a.nbytes / (time.perf_counter() - t) / 1e9)
        del w
    return {
        "read_gb_s": best_read,
        "sum_gb_s": best_sum,
        "gemv_gb_s": best_gemv,
        "xla_gemv_gb_s": best_xla,
        "kernel_gemv_gb_s": best_kernel,
        "gb_s": max(best_read, best_sum, best_gemv, best_xla, best_kernel),
        "kernel_16_gflop_s": tiles_rate(a, 4096, repeats=repeats),
        "kernel_16_gflop_s_at": {str(c): tiles_rate(a, c, repeats=repeats) for c in columns},
        "fma_peak_gflop_s": max(kernels.fma_peak(8) for _ in range(repeats)),
        "fma_peak_512_gflop_s": max(kernels.fma_peak(16) for _ in range(repeats)),
    }


@jax.jit
def _linear_over(x: jax.Array, ws: list) -> list:
    """colibri's linear kernel on x over every matrix of ws, in one program (a value of each
    kept, so that every call runs)."""
    return [kernels.linear(x, w)[0, 0] for w in ws]


def tiles_rate(
    a: np.ndarray, columns: int, rows: int = 16, repeats: int = 2, chunk_rows: int = 8192
) -> float:
    """GFLOP/s of colibri's linear kernel on `rows` inputs over `a` (a probe_array: from DRAM)
    taken as matrices of `chunk_rows` rows of `columns` floats (an lm_head's size), the best of
    `repeats` runs that fault no page in: what the cores' tiles compute when every weight meets
    that many inputs as it streams in, the rate a many-row step's arithmetic can go at (0
    without the kernels). The process's allocator keeps the memory its runs free from then on
    (keep_freed_memory): results in fresh pages took the calls over rows of 512 columns about
    1.15x the time, faulting them in, where the engine's decode steps fault none."""
    if not kernels.available():
        return 0.0
    n = a.size // (chunk_rows * columns)
    flat = a[: n * chunk_rows * columns].reshape(n, chunk_rows, columns)
    ws = [jax.device_put(m) for m in flat]  # the same memory (aligned: no copy)
    x = jnp.ones((rows, columns), jnp.float32)
    keep_freed_memory()
    jax.block_until_ready(_linear_over(x, ws))  # compiled on the first call of each shape
    best = best_faulting = 0.0
    runs = kept = 0
    while kept < repeats and runs < repeats + 8:
        faults = _minor_faults()
        t = time.perf_counter()
        jax.block_until_ready(_linear_over(x, ws))
        rate = rows * 2 * flat.size / (time.perf_counter() - t) / 1e9
        runs += 1
        if _minor_faults() == faults:
            kept += 1
            best = max(best, rate)
        else:
            best_faulting = max(best_faulting, rate)
    return best or best_faulting


def _minor_faults() -> int:
    """Pages this process has faulted in so far without reading them from disk."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def keep_freed_memory() -> None:
    """Have glibc's allocator keep the memory this process frees, never trimming its heap nor
    mapping blocks under 64 MiB fresh, so that a program run again finds its buffers' pages in
    place (no effect elsewhere). A benchmark's rates then leave out page faults that its first
    run pays and the engine's steps never do."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD: a thread's heap holds up to 64 MiB


def widen_rate(w: jax.Array, in_features: int, threads: int | None = None, tries: int = 5) -> float:
    """GB/s at which the cores (`threads` of them at once, default every core) put the rows
    of `w` (held as the engine holds them: float32, bfloat16 bits, FP8, int4 or int8 rows;
    [O, ...] of `in_features` columns, ~256 KiB, so that they stay in L2) through the tiles
    of colibri's one-row calls (kernels.widen_peak): the rate of their widening and
    multiply-adds with memory out of the way, each core on its own; the best of `tries`
    tenths of a second (a core's rate moved by a fifth between them). Timing the linear
    kernel's calls instead adds their own costs, and a call of ~256 KiB of held rows is
    shared out: the kernels count its work as float32."""
    rows = np.asarray(w)
    return max(kernels.widen_peak(rows, in_features, 0.1, threads) for _ in range(tries))


def pread_bandwidth(
    files: list[Path], threads: int, chunk: int = 4 << 20, max_bytes: int | None = None
) -> float:
    """GB/s of cold os.pread over the files with `threads` readers, in `chunk`-byte requests.
    `max_bytes`: read at most about this many bytes, whole chunks spread evenly over the files
    (None: every byte of them)."""
    drop_page_cache(files)
    jobs = [(p, off) for p in files for off in range(0, p.stat().st_size, chunk)]
    if max_bytes is not None and len(jobs) * chunk > max_bytes:
        keep = max(1, max_bytes // chunk)
        jobs = [jobs[i * len(jobs) // keep] for i in range(keep)]

    def read(job):
        fd = os.open(job[0], os.O_RDONLY)
        try:
            return len(os.pread(fd, chunk, job[1]))
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, jobs))
    return total / (time.perf_counter() - t0) / 1e9
