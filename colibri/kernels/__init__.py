"""Native CPU kernels, built on first use with the system C++ compiler and called through XLA FFI.

`moe_experts(gate, up, down, x, ids)` computes the routed experts of one layer (weights float32,
bfloat16 bits, FP8, int4 or int8 rows, widened exactly as they are loaded; or bfloat16 bits in
bfloat16 products, formats.BF16P) and
`linear(x, w)` a linear layer over a few rows, `attend(...)` decode attention read straight from
the KV cache (see cpu/cpu.cc); `cut_requested(step)` reads, inside a decode burst, the flag that
`request_cut(True)` raises to end the bursts running in this process after their current step.
The shared library is compiled once per source, JAX version and CPU into the user's cache
folder (`COLIBRI_KERNEL_CACHE`, default ~/.cache/colibri/kernels), written to a temporary name
and renamed, so concurrent processes never load a half-written file.
`COLIBRI_CPU_KERNELS=0` turns the kernels off (XLA's own loops run instead); so does a
machine without a compiler, with one warning on stderr. `COLIBRI_KERNEL_ISA=avx2` builds them
for AVX2 on a CPU that has AVX-512 (`ISA_LEVELS`; `avx512`: without VBMI), to compare: their
results are bitwise the same (cpu/cpu.cc, "Exactness"). `COLIBRI_KERNEL_TRACE=1` builds and
loads them timing every call (`take_traced_calls`; experiments/call_trace.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from colibri import formats

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("cpu")  # the kernels' source: headers and cpu.cc
SOURCE = SOURCE_DIR / "cpu.cc"  # its one translation unit, compiled on first use
_SOURCE_SUFFIXES = (".cc", ".h")  # the files of a source folder a build depends on


def symbol_suffix(suffix: str) -> str:
    """What the handler symbols of a held format's kernels end in, from the suffix of its
    targets: "_int4z" -> "Int4z" (ColibriMoeExpertsInt4z), "" -> "" (ColibriMoeExperts). It is
    the Name of the format's line in cpu/formats.h's COLIBRI_HELD_FORMATS."""
    return suffix[1:].capitalize()


def _targets() -> dict[str, str]:
    """XLA target -> the library's handler symbol: an expert kernel, a linear one and MLA's two
    per-head products for each held format of colibri/formats.py, then attention, the small
    kernels and the cut flag."""
    kernels = {
        "colibri_moe_experts": "ColibriMoeExperts",
        "colibri_linear": "ColibriLinear",
        "colibri_linear_heads": "ColibriLinearHeads",
        "colibri_linear_heads_t": "ColibriLinearHeadsT",
    }
    targets = {
        target + f.suffix: handler + symbol_suffix(f.suffix)
        for target, handler in kernels.items()
        for f in formats.FORMATS
    }
    targets["colibri_attend"] = "ColibriAttend"
    targets["colibri_attend_write"] = "ColibriAttendWrite"
    targets["colibri_mla_attend"] = "ColibriMlaAttend"
    targets["colibri_route_softmax"] = "ColibriRouteSoftmax"
    targets["colibri_rms_norm"] = "ColibriRmsNorm"
    targets["colibri_greedy"] = "ColibriGreedy"
    targets["colibri_cut_requested"] = "ColibriCutRequested"
    return targets


_TARGETS = _targets()

# How SOURCE is compiled (benchmarks that build programs around it use these too), and made a
# shared library.
CXX_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-std=c++17"]
_LIBRARY_FLAGS = ["-shared", "-fPIC"]

# Instruction-set levels a build can be narrowed to: name -> (the CPU flag it needs, the
# compiler flags that keep the build to it). "native" is everything the CPU has; "avx2" turns
# AVX-512 off (16 vector registers, VEX encodings), as on a CPU without it.
ISA_LEVELS = {
    "native": ("", []),
    "avx2": ("avx2", ["-mno-avx512f"]),
    "avx512": ("avx512vbmi", ["-mno-avx512vbmi"]),  # AVX-512 as CPUs without VBMI have it
}


def isa_levels() -> list[str]:
    """The levels of ISA_LEVELS this CPU runs, "native" first; "avx2" only where it differs
    from native (the CPU has AVX-512), "avx512" only where the CPU has AVX-512 VBMI."""
    flags = set(_cpu_id().split())
    return ["native"] + [
        name
        for name, (needs, _) in ISA_LEVELS.items()
        if needs and needs in flags and "avx512f" in flags
    ]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(os.environ.get("COLIBRI_KERNEL_CACHE") or Path(base) / "colibri" / "kernels")


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU's vendor, family, model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    heads = ("vendor_id", "cpu family", "model name", "flags")
    keep = [ln for ln in text.splitlines() if ln.startswith(heads)]
    return "\n".join(sorted(set(keep)))


def tuning() -> dict[str, int]:
    """Tile and thread choices the kernels take by the CPU, as defines of cpu/'s headers: on
    Intel cores rows of 384 columns and more meet 9 to 16 inputs two groups a pass
    (COLIBRI_TWO_GROUPS_FROM), rows of up to 768 columns go whole, a tile's rows a third of the
    matrix apart (COLIBRI_ONE_BLOCK_TO; pairs.h), one input's tiles prefetch their rows 4 KiB
    ahead (COLIBRI_ONE_INPUT_FETCH; tiles.h), and the helpers of a decode step's calls wait 200
    µs for the next call (COLIBRI_LINGER_NS; gang.h); on AMD Zen 4 (family 25 with AVX-512)
    rows of up to 768 columns go whole too, rows of 384 columns and more meet 9 to 16 inputs
    two groups a pass (COLIBRI_TWO_GROUPS_ALONE_FROM), one input's tiles prefetch 1 KiB ahead,
    and held rows (int4, int8, FP8) meet one to four inputs in the 8-lane tiles instead of the
    row pairs (COLIBRI_HELD_PAIRS); elsewhere the headers' defaults. Results are the same bits
    either way."""
    cpu = _cpu_id()
    if "GenuineIntel" in cpu:
        return {
            "COLIBRI_TWO_GROUPS_FROM": 384,
            "COLIBRI_ONE_BLOCK_TO": 768,
            "COLIBRI_ONE_INPUT_FETCH": 4096,
            "COLIBRI_LINGER_NS": 200_000,
        }
    lines = (ln.split(":", 1) for ln in cpu.splitlines() if ":" in ln)
    fields = {k.strip(): v.split() for k, v in lines}
    zen4 = fields.get("cpu family") == ["25"] and "avx512f" in fields.get("flags", [])
    if "AuthenticAMD" in cpu and zen4:
        return {
            "COLIBRI_TWO_GROUPS_ALONE_FROM": 384,
            "COLIBRI_ONE_BLOCK_TO": 768,
            "COLIBRI_ONE_INPUT_FETCH": 1024,
            "COLIBRI_HELD_PAIRS": 0,
        }
    return {}


def tile_flags(tiles: dict[str, int] | None = None) -> list[str]:
    """The compiler's defines for `tiles` (default: this CPU's `tuning()`), for anything built
    from cpu/'s headers."""
    tiles = tuning() if tiles is None else tiles
    return [f"-D{name}={value}" for name, value in sorted(tiles.items())]


def compiler() -> str | None:
    """The C++ compiler to build with: $CXX, else the first of g++, c++, clang++ found."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def source_files(source: Path | None = None) -> tuple[Path, list[Path]]:
    """(the file to compile, every file of its folder a build depends on) for `source`: a
    folder of the kernels' source (its cpu.cc), or the file itself; None: the engine's own."""
    source = Path(source or SOURCE_DIR)
    unit = source / "cpu.cc" if source.is_dir() else source
    if not unit.is_file():
        raise FileNotFoundError(f"no kernel source at {unit}")
    files = {p for p in unit.parent.iterdir() if p.is_file() and p.suffix in _SOURCE_SUFFIXES}
    return unit, sorted(files | {unit})


def build(
    source: Path | None = None,
    isa: str | None = None,
    tiles: dict[str, int] | None = None,
    trace: bool | None = None,
) -> Path:
    """The compiled library, building it if this source/JAX/CPU has none yet. `source`: another
    version of the kernels, a folder like cpu/ or the cpu.cc in one (benchmarks compare
    revisions; the engine always uses its own). The library is keyed by every .cc and .h file
    of that folder: a change to any of them builds anew. `isa`: a level of ISA_LEVELS (default
    $COLIBRI_KERNEL_ISA, else "native"). `tiles`: the defines of `tuning()` to build with
    instead of this CPU's (tests build both ways). `trace`: a library that times every call
    shared out among threads (cpu/gang.h's COLIBRI_TRACE_CALLS; `take_traced_calls`), default
    $COLIBRI_KERNEL_TRACE=1; the same results."""
    isa = isa or os.environ.get("COLIBRI_KERNEL_ISA") or "native"
    if isa not in ISA_LEVELS:
        raise ValueError(f"COLIBRI_KERNEL_ISA={isa!r}: not one of {', '.join(ISA_LEVELS)}")
    if trace is None:
        value = os.environ.get("COLIBRI_KERNEL_TRACE", "0")
        if value not in ("0", "1"):
            raise ValueError(f"COLIBRI_KERNEL_TRACE={value!r}: not 0 or 1")
        trace = value == "1"
    traced = ["-DCOLIBRI_TRACE_CALLS=1"] if trace else []
    flags = [*CXX_FLAGS, *ISA_LEVELS[isa][1], *tile_flags(tiles), *traced, *_LIBRARY_FLAGS]
    unit, files = source_files(source)
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++; or set CXX)")
    key = hashlib.sha256()
    for path in files:
        content = path.read_bytes()
        key.update(f"{path.name}\0{len(content)}\0".encode())
        key.update(content)
    for part in (jax.__version__.encode(), cxx.encode(), _cpu_id().encode()):
        key.update(part)
    key.update(" ".join(flags).encode())
    out = cache_dir() / f"cpu-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # One build of a library at a time: processes that start together on a fresh machine (the
    # test workers, an engine, a notebook's kernel) wait for the first one's build and load it,
    # instead of each compiling the same library at once on the same few cores (a notebook's
    # views then waited minutes to redraw). The lock file goes once its holder is done.
    lock_path = out.with_name(out.name + ".lock")
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if out.exists():  # built meanwhile
                return out
            _compile([cxx, *flags, f"-I{jax.ffi.include_dir()}", str(unit)], out)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock_path)
    return out


def _compile(cmd: list[str], out: Path) -> None:
    """Run the compiler `cmd` into a temporary file beside `out`, then rename it to `out`: a
    failed or killed build leaves nothing behind."""
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run([*cmd, "-o", tmp], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join([*cmd, '-o', tmp])} failed:\n{done.stderr[-4000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_loading = threading.Lock()
_loaded: list[ctypes.CDLL | None] = []  # the one outcome of _load, once it has run


def _library() -> ctypes.CDLL | None:
    """The loaded library, its targets registered with XLA for the CPU; None when off or failed.
    Loaded once, whichever thread asks first (the engine's input thread may)."""
    with _loading:
        if not _loaded:
            _loaded.append(_load())
        return _loaded[0]


def _load() -> ctypes.CDLL | None:
    if os.environ.get("COLIBRI_CPU_KERNELS", "1") == "0":
        return None
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
        for target, symbol in _TARGETS.items():
            jax.ffi.register_ffi_target(
                target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu"
            )
        lib.colibri_request_cut.argtypes = [ctypes.c_int32]
        lanes = lib.colibri_int4_lanes
        lanes.restype, lanes.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    except (OSError, RuntimeError, AttributeError) as err:
        log.warning("colibri CPU kernels unavailable, using XLA loops: %s", err)
        return None
    return lib


def available() -> bool:
    """True once the kernels are built, loaded and registered with XLA for the CPU."""
    return _library() is not None


def usable(*arrays: jax.Array) -> bool:
    """Whether the kernels can take these operands: all float32, on CPU, kernels built."""
    f32 = all(a.dtype == jnp.float32 for a in arrays)
    return f32 and jax.default_backend() == "cpu" and available()


def usable_weights(x: jax.Array, *weights: jax.Array) -> bool:
    """Whether `linear` or `moe_experts` can take these: x float32 and the weights all float32,
    all bfloat16 bits (uint16; int16 for bfloat16 products), all FP8 rows (uint8), all int4
    rows (int8), all int4 rows with zero points (uint32) or all int8 rows (int32), on CPU,
    kernels built."""
    one = len({w.dtype for w in weights}) == 1
    return one and formats.held(weights[0].dtype) is not None and usable(x)


def moe_experts(
    gate: jax.Array, up: jax.Array, down: jax.Array, x: jax.Array, ids: jax.Array
) -> jax.Array:
    """y [N, K, D] float32: expert ids[n, k] (slot index; outside [0, S) gives 0) on x[n].
    The weights are float32, bfloat16 bits (uint16), FP8 rows (uint8: each row's
    float8_e4m3fn values, then its float32 block scales; `checkpoint.FP8_ROWS`) or int4 rows
    (int8: each row's four-bit values two a byte, then its float32 group scales;
    `checkpoint.INT4_ROWS`) or int4 rows with zero points (uint32 words: the same values, the
    scales, then the offsets -zero x scale; `checkpoint.INT4Z_ROWS`) or int8 rows (int32
    words: values one a byte, scales, offsets; `checkpoint.INT8_ROWS`); results are bitwise
    those of the same weights widened (and scaled) to float32 beforehand. Bfloat16 bits held
    as int16 (formats.BF16P) are bfloat16 products instead: x and the hidden rows rounded to
    bfloat16 before the products that take them, sums in float32 (cpu/bf16p.h)."""
    _require()
    N, K = ids.shape
    D = x.shape[1]
    call = jax.ffi.ffi_call(
        "colibri_moe_experts" + formats.of(gate.dtype).suffix,
        jax.ShapeDtypeStruct((N, K, D), jnp.float32),
        vmap_method="sequential",
    )
    return call(gate, up, down, x, ids.astype(jnp.int32))


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., I] @ w.T for w [O, I] float32, bfloat16 bits (uint16), FP8 rows (uint8,
    [O, I + 4 I / b]), int4 rows (int8, [O, I / 2 + 4 I / g]), int4 rows with zero points
    (uint32, [O, I / 8 + 2 I / g]) or int8 rows (int32, [O, I / 4 + 2 I / g]): [..., O]
    float32. For bfloat16 bits held as int16 (formats.BF16P), x rounded to bfloat16 times the
    weights, summed in float32 (cpu/bf16p.h)."""
    _require()
    rows = x.reshape(-1, x.shape[-1])
    call = jax.ffi.ffi_call(
        "colibri_linear" + formats.of(w.dtype).suffix,
        jax.ShapeDtypeStruct((rows.shape[0], w.shape[0]), jnp.float32),
        vmap_method="sequential",
    )
    return call(rows, w).reshape(*x.shape[:-1], w.shape[0])


def _heads_call(target: str, x: jax.Array, w: jax.Array, first: int, out: int) -> jax.Array:
    """The per-head products' call of `target` for w's held format: [M, H, out] float32."""
    _require()
    M, H, _ = x.shape
    call = jax.ffi.ffi_call(
        target + formats.of(w.dtype).suffix,
        jax.ShapeDtypeStruct((M, H, out), jnp.float32),
        vmap_method="sequential",
    )
    return call(x, w, first=np.int64(first))


def linear_heads(x: jax.Array, w: jax.Array, first: int = 0) -> jax.Array:
    """Head by head, x [M, H, I] @ w[h, first:].T for w [H, R, ...] rows of I weights in any
    held format but bfloat16 products' (as `linear` takes them): [M, H, R - first] float32,
    each head's bitwise `linear(x[:, h], w[h, first:])` (each row's as it is alone). The rows
    from `first` on are read where they lie (no slice of w is made)."""
    return _heads_call("colibri_linear_heads", x, w, first, w.shape[1] - first)


def linear_heads_t(x: jax.Array, w: jax.Array, first: int = 0, cols: int | None = None):
    """Head by head, x [M, H, I] @ w[h, first:first + I] for w [H, R, ...] rows of `cols`
    weights (default: w's last axis, float32) in any held format but bfloat16 products':
    [M, H, cols] float32, each output one multiply-add chain over i in order from zero (as
    attention sums its values) of the weights as they widen, so each row's bits as it is
    alone. The rows are read where they lie."""
    return _heads_call("colibri_linear_heads_t", x, w, first, w.shape[2] if cols is None else cols)


def attend(
    q: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array, pos: jax.Array, scale: float
) -> jax.Array:
    """Attention of one new token per row, q [B, H, Dh], over positions 0..pos[b] of slot
    slots[b] of the caches k, v [S, Hkv, C, Dh] (the new key already written): [B, H, Dh].
    Rows whose slot is outside [0, S) give zeros. Rows that follow one another in a slot (a
    prefill's tokens: each position one past the row before's) share the keys' and values'
    reads; every row's result is bitwise what it gets alone."""
    _require()
    call = jax.ffi.ffi_call(
        "colibri_attend", jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential"
    )
    i32 = jnp.int32
    return call(q, k, v, slots.astype(i32), pos.astype(i32), scale=np.float32(scale))


def mla_attend(
    q: jax.Array,
    q_rope: jax.Array,
    lat: jax.Array,
    kr: jax.Array,
    slots: jax.Array,
    pos: jax.Array,
    scale: float,
    keep: jax.Array | None = None,
) -> jax.Array:
    """Multi-head latent attention of one new token per row: q [B, H, r] and its roped part
    q_rope [B, H, R] against positions 0..pos[b] of slot slots[b] of the latent cache lat
    [S, C, r] and the roped keys kr [S, C, R] (the new ones written already); the softmax of
    scale (q . lat + q_rope . kr) weighing the latents: [B, H, r]. `keep` [B, L] (bool): the
    positions t < L a row attends to (DSA's selection), every one where None. Rows whose slot
    is outside [0, S) give zeros; every row's result is bitwise what it gets alone."""
    _require()
    call = jax.ffi.ffi_call(
        "colibri_mla_attend", jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential"
    )
    keep = jnp.zeros((q.shape[0], 0), jnp.uint8) if keep is None else keep.astype(jnp.uint8)
    i32 = jnp.int32
    return call(
        q, q_rope, lat, kr, slots.astype(i32), pos.astype(i32), keep, scale=np.float32(scale)
    )


def attend_write(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slots: jax.Array,
    pos: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    scale: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`attend` after writing each row's new key and value, k_new and v_new [B, Hkv, Dh], into
    the caches at (slots[b], pos[b]) (a slot or position outside the cache, negative ones too,
    is not written: the engine's padding rows name slot S, which a scatter with mode="drop"
    leaves alike): (out, k, v). The caches are updated in place where XLA can
    give the call their memory (a decode step's loop, the caches donated); the result is the
    same either way. One call instead of XLA's two cache writes a layer, each with its own
    index and bounds ops."""
    _require()
    call = jax.ffi.ffi_call(
        "colibri_attend_write",
        (
            jax.ShapeDtypeStruct(q.shape, jnp.float32),
            jax.ShapeDtypeStruct(k.shape, jnp.float32),
            jax.ShapeDtypeStruct(v.shape, jnp.float32),
        ),
        vmap_method="sequential",
        input_output_aliases={1: 1, 2: 2},
    )
    i32 = jnp.int32
    return call(q, k, v, slots.astype(i32), pos.astype(i32), k_new, v_new, scale=np.float32(scale))


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm of x [N, D] float32 with weights w [D]: w * (x / sqrt(mean(x^2) + eps)), each
    row's squares summed in the kernels' 8-lane order (within float32 rounding of XLA's)."""
    _require()
    call = jax.ffi.ffi_call(
        "colibri_rms_norm", jax.ShapeDtypeStruct(x.shape, jnp.float32), vmap_method="sequential"
    )
    return call(x, w, eps=np.float32(eps))


def route_softmax(logits: jax.Array, k: int, norm: bool) -> tuple[jax.Array, jax.Array]:
    """A softmax router's choice from logits [N, E] float32: (ids [N, k] int32, weights
    [N, k]), the k largest of softmax(logits) as jax.lax.top_k orders them (the lower expert
    first where two are equal), renormalised to sum to 1 where `norm`. The same choice as
    XLA's softmax and top_k, and weights within float32 rounding of theirs, in one call."""
    _require()
    N = logits.shape[0]
    call = jax.ffi.ffi_call(
        "colibri_route_softmax",
        (jax.ShapeDtypeStruct((N, k), jnp.int32), jax.ShapeDtypeStruct((N, k), jnp.float32)),
        vmap_method="sequential",
    )
    return call(logits, norm=np.int32(norm))


def greedy(logits: jax.Array) -> jax.Array:
    """Each row's greedy token from logits [N, V] float32: int32 [N], the lowest id of the
    largest logit, or of the first NaN where the row has one, as jnp.argmax gives it."""
    _require()
    call = jax.ffi.ffi_call(
        "colibri_greedy",
        jax.ShapeDtypeStruct(logits.shape[:1], jnp.int32),
        vmap_method="sequential",
    )
    return call(logits)


def cut_requested(step: jax.Array) -> jax.Array:
    """Inside a decode burst, before step `step` (int32 [], the loop's counter, so that the
    read is made at every step): whether `request_cut(True)` asks the burst to end there; a
    bool []."""
    _require()
    # No side effect declared: the step operand, new at every step, keeps XLA from hoisting or
    # merging the calls, and a jit with effects would leave JAX's C++ dispatch path (every
    # call of the burst through Python, ~5 ms).
    call = jax.ffi.ffi_call("colibri_cut_requested", jax.ShapeDtypeStruct((), jnp.int32))
    return call(step.astype(jnp.int32)) != 0


def request_cut(on: bool) -> None:
    """Raise (or lower) the flag that ends every cuttable decode burst running in this process
    after its current step. Cheap and thread-safe: the engine's input thread raises it for
    each frame it reads. Does nothing when the kernels are off."""
    lib = _library()
    if lib is not None:
        lib.colibri_request_cut(1 if on else 0)


def fma_peak(lanes: int = 8, seconds: float = 0.3, threads: int | None = None) -> float:
    """GFLOP/s of multiply-adds on vectors of `lanes` floats (8: 256-bit, 16: 512-bit) on
    `threads` threads at once (default: one a core), the ceiling of the tiles' arithmetic;
    0 where the build has no such vectors."""
    return _probe_rate("colibri_fma_peak", [ctypes.c_int32], (lanes,), seconds, threads)


def bf16_dot_peak(seconds: float = 0.3, threads: int | None = None) -> float:
    """GFLOP/s of bfloat16 dot products (AVX-512 BF16's VDPBF16PS, 32 multiply-adds an
    instruction) on `threads` threads at once (default: one a core), the ceiling of bfloat16
    products' tiles (cpu/bf16p.h); 0 where the build has no such instruction."""
    return _probe_rate("colibri_bf16_dot_peak", [], (), seconds, threads)


def _probe_rate(symbol: str, argtypes: list, args: tuple, seconds: float, threads) -> float:
    """The sum over `threads` threads at once (default: one a core) of a ceiling probe's
    GFLOP/s, `symbol`(*args, seconds); 0 when the kernels are off."""
    lib = _library()
    if lib is None:
        return 0.0
    peak = getattr(lib, symbol)
    peak.restype, peak.argtypes = ctypes.c_double, [*argtypes, ctypes.c_double]
    n = threads or os.cpu_count() or 1
    with ThreadPoolExecutor(n) as pool:  # ctypes lets go of the GIL for the call
        return sum(pool.map(lambda _: peak(*args, seconds), range(n)))


def widen_peak(w: np.ndarray, cols: int, seconds: float = 0.2, threads: int | None = None) -> float:
    """GB/s at which the cores (`threads` at once, default one a core) put rows held as
    w.dtype's format (w [R, row elements] of `cols` weights a row; a few hundred KiB, so that
    they stay in L2) through the tiles of one-row calls, each thread meeting the same rows with
    one input over and over for about `seconds` (cpu.cc's colibri_widen_peak): the most the
    widening and multiply-adds allow one-row calls where memory keeps up, the calls' own costs
    aside. 0 when the kernels are off or the rows are not their format's."""
    fmt = formats.of(w.dtype)
    w = np.ascontiguousarray(w)
    args = (w.ctypes.data, w.shape[0], cols, w[0].nbytes)
    argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    return _probe_rate("colibri_widen_peak" + fmt.suffix, argtypes, args, seconds, threads)


def read_sum(a: np.ndarray) -> float:
    """The sum of a contiguous float32 array, read in eight 8-lane sums with nothing else done
    (on the calling thread; ctypes lets go of the GIL): how fast a core reads memory. Its value
    only keeps the reads; its order of sums is not numpy's."""
    lib = _library()
    if lib is None:
        raise RuntimeError("colibri CPU kernels are off or failed to build (see the log)")
    if a.dtype != np.float32 or not a.flags.c_contiguous:
        raise ValueError("read_sum takes a contiguous float32 array")
    read = lib.colibri_read_sum
    read.restype, read.argtypes = ctypes.c_float, [ctypes.c_void_p, ctypes.c_int64]
    return float(read(a.ctypes.data, a.size))


def int4_lanes(values: np.ndarray) -> np.ndarray | None:
    """Int4 values in column order (uint8, two a byte, a multiple of 32 bytes in all) laid out
    lane by lane, each 64 columns as `formats.LANE_COLUMNS` says (cpu/formats.h's int4_lanes,
    on the calling thread; ctypes lets go of the GIL); None where the kernels are off or failed
    to build."""
    lib = _library()
    if lib is None:
        return None
    values = np.ascontiguousarray(values, np.uint8)
    if values.size % 32:
        raise ValueError("int4_lanes takes whole groups of 64 values (32 bytes)")
    out = np.empty_like(values)
    lib.colibri_int4_lanes(values.ctypes.data, out.ctypes.data, values.size // 32)
    return out


# A traced call's fields (cpu/gang.h's CallRecord): nanoseconds of the steady clock at which
# the kernel's run began (before its helpers were scheduled or handed it), the caller began its
# own share (once they were), its first helper began and its last one ended (0: none joined),
# the caller's share ended and the call returned; then the call's work (bytes of weights as
# float32 times their passes; keys and values times the query heads), work items, threads,
# kernel (TRACE_KINDS) and how many of its helpers were handed it as they waited for a call
# (gang.h's `serve`), not scheduled as tasks of XLA's pool.
TRACE_FIELDS = (
    "enter",
    "caller_start",
    "helper_start",
    "helper_end",
    "caller_end",
    "done",
    "work",
    "items",
    "threads",
    "kind",
    "handed",
)
# The kernels a traced call's `kind` names (cpu/gang.h's CallKind).
TRACE_KINDS = {
    1: "routed experts",
    2: "linear",
    3: "per-head products",
    4: "attention",
    5: "latent attention",
}


def take_traced_calls(lib: ctypes.CDLL | None = None, most: int = 1 << 16) -> np.ndarray:
    """The kernel calls timed since the last take (the latest `most` of them), oldest first: an
    int64 record array of TRACE_FIELDS. `lib`: a library loaded from `build(trace=True)`
    (default: the one this process uses, built so where COLIBRI_KERNEL_TRACE=1 when it
    loaded). Take them between calls, not while a call runs."""
    lib = lib or _library()
    if lib is None:
        raise RuntimeError("colibri CPU kernels are off or failed to build (see the log)")
    take = lib.colibri_take_traced_calls
    take.restype, take.argtypes = ctypes.c_int64, [ctypes.c_void_p, ctypes.c_int64]
    out = np.zeros(most, dtype=[(f, np.int64) for f in TRACE_FIELDS])
    n = take(out.ctypes.data, most)
    if n < 0:
        raise RuntimeError("this kernel library does not trace its calls (COLIBRI_KERNEL_TRACE=1)")
    return out[:n]


def _require() -> None:
    if not available():
        raise RuntimeError("colibri CPU kernels are off or failed to build (see the log)")
