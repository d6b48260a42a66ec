"""python experiments/bench_kernel_revs.py [--base HEAD~1] [--kernel experts] [--held fp8|int4|...]
    [--prompt 256] [--context 4096] [--dram] [--base-lanes 64] [--isa avx2] [--rounding] [--probe]
    [--out NAME]

A kernel of colibri/kernels/cpu/ in two versions side by side, in one process: the working
tree's and that of --base (any git revision). Both libraries are built as the engine builds
its own and registered with XLA under names of their own; their calls alternate, so that both
meet the same phases of a machine whose speed moves by a quarter within minutes (runs in
separate processes could not tell 5% apart here): step by step, the first to go alternating.
Run it with --base HEAD on a clean tree (the same kernel twice) to see the spread that noise
alone gives. Calls of a few tens of µs (one-row attention) moved by up to 8% between two builds
whose sources differed only in text the kernel does not run (docs/kernels.md, "Attention's keys
in 8 lanes on Zen 4: not kept"): run a small change both ways round, the old version as the
working tree and the new one as --base.

--kernel experts (the routed experts): the routes the checkpoints of
experiments/bench_peers.py (made there, or here if missing) choose when --rows conversations
decode at once (as there: one prompt, the last 8 tokens changed in each conversation; 24
greedy steps), replayed on random weights of the same shapes held on huge pages as the
engine holds them (colibri/hugepages.py), every layer of every step per pass; with --held bf16,
as bfloat16 bits (bf16p: for bfloat16 products); with --held fp8 (int4, awq4, int8),
quantized and held as those rows, as experiments/bench_quantized.py holds them
(--base must have that kernel; --base-lanes N: int4 rows that --base holds in column order,
where it held them lane by lane only in blocks of a multiple of N columns); with --prompt N,
the calls of one N-token prefill instead (its routes, one step a pass). --kernel linear: the
same shapes' attention projections (qkv and o of every layer) and lm_head on --rows rows, 24
steps per pass, on huge pages as the engine holds its dense weights (with --held, every
matrix held so); with --dram, a copy of them a step, 1 GB of copies in all, so that they
stream from DRAM (a step's 50-75 MB stay in a last-level cache of 300 MiB, which overstates
what a change does where they do not).
--kernel attend: decode attention of every layer for --rows conversations, 24 steps after a
prompt of --context tokens (128), the keys and values read from DRAM as in the engine.
--kernel mla: the same for multi-head latent attention (colibri_mla_attend) over the latent
and roped-key caches (run it on --shapes mla). The two versions' outputs must agree bitwise
(the kernels' results never depend on how work is shared out); with --rounding, where a
change reorders sums on purpose, to float32 rounding (rtol 1e-4). --isa avx2: both versions
built without AVX-512 (kernels.ISA_LEVELS), as for a CPU that has only AVX2. With --probe,
a plain read of 1 GiB on every core before each pass, and the ratios also over the passes
after the slower and the faster half of those reads (a change that matters only where the
memory is fast shows there). Reported: ms a step for each version (median of passes), GB/s
of the weights (keys and values, latents) read (for the experts: the distinct ones) and
GFLOP/s, and the median over passes of new / base time.
Writes experiments/results/kernel_revs.md and kernel_revs.json (experts; with --prompt,
kernel_revs_prompt.md and .json), or kernel_revs_linear.md / kernel_revs_attend.md /
kernel_revs_mla.md and .json; with --out NAME, NAME.md and NAME.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd

from colibri import formats, kernels
from colibri.bench.bandwidth import PassProbe
from colibri.bench.conversations import prompt_ids
from colibri.bench.formats import FORMATS
from colibri.bench.kernel_calls import expert_call, linear_call, registered
from colibri.bench.replay import (
    STEPS,
    alternate,
    compare,
    compare_linear,
    dense_on_huge_pages,
    linear_params,
    on_huge_pages,
    record_routes,
    same_bits,
    weights,
)
from colibri.bench.shapes import SHAPES, ensure_inputs
from colibri.config import load_config
from colibri.formats import BF16P, lane_major
from colibri.report import markdown_table

HERE = Path(__file__).parent
RESULTS = HERE / "results"


def git(*args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=HERE.parent, check=True, capture_output=True).stdout


def source_at(rev: str, into: Path) -> Path:
    """The kernels' source as it is at git revision `rev`, written under `into`: the folder
    colibri/kernels/cpu/ where `rev` has it (kernels.build compiles its cpu.cc), else the one
    file colibri/kernels/cpu.cc of the revisions before it."""
    folder = "colibri/kernels/cpu/"
    paths = git("ls-tree", "-r", "--name-only", rev, "--", folder).decode().splitlines()
    if not paths:
        out = into / "cpu.cc"
        out.write_bytes(git("show", f"{rev}:colibri/kernels/cpu.cc"))
        return out
    out = into / "cpu"
    for path in paths:
        file = out / path.removeprefix(folder)
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_bytes(git("show", f"{rev}:{path}"))
    return out


def attend_call(lib_path: Path, name: str):
    """The library's decode attention, registered with XLA as `name`: f(q, k, v, slots, pos)
    (not jitted: called inside a jitted step)."""
    registered(lib_path, "ColibriAttend", name)

    def call(q, k, v, slots, pos, scale):
        out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
        return jax.ffi.ffi_call(name, out, vmap_method="sequential")(
            q, k, v, slots, pos, scale=np.float32(scale)
        )

    return call


def mla_call(lib_path: Path, name: str):
    """The library's MLA decode attention, registered with XLA as `name`: f(q, qr, lat, kr,
    slots, pos, scale) (not jitted), every position kept."""
    registered(lib_path, "ColibriMlaAttend", name)

    def call(q, qr, lat, kr, slots, pos, scale):
        out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
        keep = jnp.zeros((q.shape[0], 0), jnp.uint8)
        return jax.ffi.ffi_call(name, out, vmap_method="sequential")(
            q, qr, lat, kr, slots, pos, keep, scale=np.float32(scale)
        )

    return call


def record_prompt_routes(ckpt: Path, tokens: int) -> np.ndarray:
    """[1, layers, tokens, top_k]: the routes of one prefill of `tokens` (at most one prefill
    chunk) as one step: what the expert calls of a prompt meet."""
    from colibri.engine.model import load_model
    from colibri.engine.runner import PREFILL_CHUNK, Runner

    if not 0 < tokens <= PREFILL_CHUNK:
        raise SystemExit(f"--prompt takes 1 to {PREFILL_CHUNK} tokens (one prefill chunk)")
    model = load_model(ckpt, progress=False)
    runner = Runner(model, slots=1, capacity=tokens + 8)
    _, routes = runner.prefill(0, prompt_ids(model.cfg.vocab_size, tokens))
    return np.asarray(routes)[None]


def check_outputs(outputs: dict, rounding: bool) -> None:
    """The versions' outputs bitwise equal (to float32 rounding where `rounding`)."""
    if not rounding:
        return same_bits(outputs)
    ref = np.asarray(next(iter(outputs.values())))
    for v, y in outputs.items():
        np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-7, err_msg=v)


def time_layers(
    calls: dict,
    layer,
    q,
    sets: list,
    rows: int,
    passes: int,
    prompt_len: int,
    rounding: bool,
    before_pass=None,
) -> dict:
    """ms a step of every version: layer(f, out, cache, pos) for each layer's cache of a set
    in turn (out: q, then the layer before's result), at positions prompt_len + i for step
    i < STEPS, the versions alternating, every call the next set (neither version reads what
    the other has just read); their outputs checked first (check_outputs). `before_pass`: as
    replay.alternate's."""

    def program(f):
        def run(q, caches, pos):
            out = q
            for cache in caches:
                out = layer(f, out, cache, pos)
            return out

        return jax.jit(run)

    steps = {v: program(f) for v, f in calls.items()}
    at = [jnp.full((rows,), prompt_len + i, jnp.int32) for i in range(STEPS)]
    check_outputs({v: run(q, sets[0], at[-1]) for v, run in steps.items()}, rounding)
    turn = itertools.count()
    return alternate(
        steps,
        lambda run, i: run(q, sets[next(turn) % len(sets)], at[i]),
        STEPS,
        passes,
        before_pass,
    )


def cache_sets(make, layers: int, set_bytes: int) -> list:
    """Sets of every layer's cache (make() each), together 256 MB and three sets at least: as
    in the engine (whose expert weights stream through the L3 between layers), the caches come
    from DRAM, for one row as for 16."""
    return [[make() for _ in range(layers)] for _ in range(max(3, -(-256_000_000 // set_bytes)))]


def compare_mla(
    calls: dict, cfg, rows: int, passes: int, prompt_len=128, rounding=False, before_pass=None
) -> dict:
    """compare_attend for MLA: every layer's latents [rows, C, r] and roped keys [rows, C, R],
    H query heads a row."""
    H, L, m = cfg.num_heads, cfg.num_layers, cfg.mla
    r, R = m.kv_lora_rank, m.qk_rope_head_dim
    cap = prompt_len + STEPS + 8
    rng = np.random.default_rng(0)
    sets = cache_sets(
        lambda: (weights(rng, rows, cap, r), weights(rng, rows, cap, R)),
        L,
        L * rows * cap * (r + R) * 4,
    )
    q = jnp.asarray(rng.standard_normal((rows, H, r), np.float32))
    qr = jnp.asarray(rng.standard_normal((rows, H, R), np.float32))
    slots = jnp.arange(rows, dtype=jnp.int32)

    def layer(f, out, cache, pos):
        return f(out, qr, *cache, slots, pos, cfg.attn_scale)

    ms = time_layers(calls, layer, q, sets, rows, passes, prompt_len, rounding, before_pass)
    positions = prompt_len + (STEPS + 1) / 2  # mean latents a row reads
    gb = L * rows * positions * (r + R) * 4 / 1e9
    gflop = L * rows * H * positions * (2 * r + R) * 2 / 1e9
    return {"ms": ms, "gb_per_step": gb, "gflop_per_step": gflop}


def compare_attend(
    calls: dict, cfg, rows: int, passes: int, prompt_len=128, rounding=False, before_pass=None
) -> dict:
    """Decode attention of every layer for `rows` conversations at positions prompt_len + i for
    step i < STEPS, alternating, each layer's keys and values a cache of its own, read from
    DRAM (cache_sets)."""
    H, Hkv, Dh, L = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    cap = prompt_len + STEPS + 8
    rng = np.random.default_rng(0)
    sets = cache_sets(
        lambda: (weights(rng, rows, Hkv, cap, Dh), weights(rng, rows, Hkv, cap, Dh)),
        L,
        L * 2 * rows * Hkv * cap * Dh * 4,
    )
    q = jnp.asarray(rng.standard_normal((rows, H, Dh), np.float32))
    slots = jnp.arange(rows, dtype=jnp.int32)

    def layer(f, out, cache, pos):
        return f(out, *cache, slots, pos, cfg.attn_scale)

    ms = time_layers(calls, layer, q, sets, rows, passes, prompt_len, rounding, before_pass)
    positions = prompt_len + (STEPS + 1) / 2  # mean keys a row reads
    gb = L * rows * Hkv * positions * Dh * 2 * 4 / 1e9
    gflop = L * rows * H * positions * Dh * 4 / 1e9
    return {"ms": ms, "gb_per_step": gb, "gflop_per_step": gflop}


# Per --held format: bytes of a weight's value, float32s a block keeps (scale, offset).
VALUE_BYTES = {
    "bf16": (2, 0),
    "bf16p": (2, 0),
    "fp8": (1, 1),
    "int4": (0.5, 1),
    "int4g32": (0.5, 1),
    "awq4": (0.5, 2),
    "int8": (1, 2),
}


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """Each weight's bfloat16 bits (the float32's top half), as the engine holds bf16 weights."""
    return (np.asarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def held_rows(fmt: str):
    """Float32 stacks of matrices [S, R, C] as --held `fmt` holds them: bfloat16 bits (bf16p:
    as int16, for bfloat16 products) or quantized rows (FP8, int4, int4 with zero points, int8:
    colibri.bench.formats)."""
    f = FORMATS.get(fmt)
    if fmt == "bf16p":
        return lambda a: bf16_bits(a).view(BF16P.storage)
    return bf16_bits if f is None else lambda a: f["pair"](a)[0]


def in_column_order(held: np.ndarray, cols: int, block: int) -> np.ndarray:
    """Int4 rows [..., bytes] whose values are held lane by lane with their values put back in
    column order (two a byte, the first in the low nibble; formats.in_column_order); the
    scales as they are."""
    out = np.array(held)
    v = out.view(np.uint8)[..., : cols // 2]
    nibbles = np.stack([v & 15, v >> 4], axis=-1).reshape(*v.shape[:-1], cols)
    q = formats.in_column_order(nibbles, cols, cols // block)
    v[...] = q[..., 0::2] | (q[..., 1::2] << 4)
    return out


def quantized_holds(calls: dict, fmt: str, base_lanes: int | None = None) -> tuple[dict, float]:
    """For `compare`: every version holds each random matrix as held_rows does, on huge pages
    (base_lanes: the first version, --base, holds int4 values lane by lane only in blocks of a
    multiple of that many columns, 0 in none: a revision from before they were, reading the
    others in column order); and the bytes a weight takes so (its value's, and its share of
    the block's scale and offset)."""
    f = FORMATS.get(fmt)
    held = held_rows(fmt)
    rows: dict[tuple, tuple] = {}

    def holding(lanes: int | None):
        def hold(a):
            if (id(a), lanes) not in rows:
                h = held(a)
                if lanes is not None:  # (int4 rows only: they have blocks)
                    cols, block = a.shape[-1], f["blocks"][0]
                    if lane_major(cols, cols // block) and (not lanes or block % lanes):
                        h = in_column_order(np.asarray(h), cols, block)
                rows[id(a), lanes] = (a, on_huge_pages(h))
            return rows[id(a), lanes][1]

        return hold

    holds = dict.fromkeys(calls, holding(None))
    if base_lanes is not None:
        holds[next(iter(calls))] = holding(base_lanes)
    value, floats = VALUE_BYTES[fmt]
    return holds, value + (4 * floats / f["blocks"][0] if f else 0)


def linear_holds(calls: dict, fmt: str) -> dict:
    """For `compare_linear`: every version holds each random matrix as held_rows does (float32:
    as it is), all of them on huge pages as the engine holds its dense weights."""
    held = held_rows(fmt)

    def hold(mats):  # held_rows takes stacks [S, R, C]: each matrix as a stack of one
        return dense_on_huge_pages(
            mats if fmt == "float32" else [held(np.asarray(a)[None])[0] for a in mats]
        )

    return dict.fromkeys(calls, hold)


def by_read_halves(model: str, rows: int, reads: np.ndarray, ratios: np.ndarray) -> list[dict]:
    """The passes split at the median of the reads before them: for each half, its reads'
    range and the median of its passes' new / base times."""
    order = np.argsort(reads, kind="stable")
    out = []
    for half, idx in (("slower", order[: len(order) // 2]), ("faster", order[len(order) // 2 :])):
        if len(idx):
            out.append(
                {
                    "model": model,
                    "rows": rows,
                    "reads": half,
                    "GB/s": f"{reads[idx].min():.1f}-{reads[idx].max():.1f}",
                    "passes": len(idx),
                    "time / base (median of passes)": float(np.median(ratios[idx])),
                }
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD~1", help="git revision to compare with")
    ap.add_argument("--kernel", choices=("experts", "linear", "attend", "mla"), default="experts")
    ap.add_argument("--passes", type=int, default=10)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument(
        "--held",
        choices=("float32", *VALUE_BYTES),
        default="float32",
        help="experts and linear: the weights as float32, as bfloat16 bits, or quantized as "
        "FP8, int4 (in groups of 128, or of 32: int4g32), AWQ's int4 or int8 rows "
        "(bench_quantized.py)",
    )
    ap.add_argument(
        "--prompt",
        type=int,
        default=0,
        help="experts: the calls of a prefill of this many tokens (one step a pass) instead of "
        "--rows conversations decoding",
    )
    ap.add_argument(
        "--context",
        type=int,
        default=128,
        help="attend: the positions each conversation holds before the steps",
    )
    ap.add_argument(
        "--dram",
        action="store_true",
        help="linear: enough copies of a step's matrices (1 GB of float32 in all), a copy a "
        "step, that they stream from DRAM, not from a last-level cache that holds one step's",
    )
    ap.add_argument(
        "--base-lanes",
        type=int,
        default=None,
        help="--kernel experts, int4 rows: --base holds int4 values lane by lane only in "
        "blocks of a multiple of this many columns (64: revisions before blocks of 32 were; "
        "0: before any were), the others in column order (the same weights, each version "
        "reading its own layout)",
    )
    ap.add_argument(
        "--isa",
        choices=tuple(kernels.ISA_LEVELS),
        help="both versions built for this level of kernels.ISA_LEVELS (avx2: without AVX-512 "
        "on a CPU that has it) instead of for everything the CPU has",
    )
    ap.add_argument(
        "--rounding",
        action="store_true",
        help="the versions' outputs may differ by float32 rounding (a change that reorders sums "
        "on purpose): checked to rtol 1e-4 instead of bitwise (attend and mla)",
    )
    ap.add_argument(
        "--probe",
        action="store_true",
        help="a plain read of 1 GiB on every core before each pass (bandwidth.PassProbe): the "
        "ratios also over the passes after the slower and the faster half of the reads",
    )
    ap.add_argument(
        "--out",
        help="results name (default kernel_revs[_linear|_attend][_prompt]): a run kept beside "
        "the others",
    )
    args = ap.parse_args()
    if args.prompt and args.kernel != "experts":
        ap.error("--prompt is for --kernel experts")
    attention = args.kernel in ("attend", "mla")
    if attention and args.held != "float32":
        ap.error("--held is for --kernel experts and linear")
    if args.context != 128 and not attention:
        ap.error("--context is for --kernel attend and mla")
    if args.base_lanes is not None and (
        args.kernel != "experts" or args.held not in ("int4", "int4g32", "awq4")
    ):
        ap.error("--base-lanes is for --kernel experts over int4 rows")
    if args.rounding and not attention:
        ap.error("--rounding is for --kernel attend and mla")
    if args.dram and args.kernel != "linear":
        ap.error("--dram is for --kernel linear")
    if not kernels.available():
        sys.exit("colibri CPU kernels unavailable (see the log)")
    with tempfile.TemporaryDirectory() as tmp:
        base_lib = kernels.build(source_at(args.base, Path(tmp)), isa=args.isa)
    make = {"experts": expert_call, "linear": linear_call, "attend": attend_call, "mla": mla_call}
    make = make[args.kernel]
    calls = {
        args.base: make(base_lib, f"colibri_{args.kernel}_base"),
        "working tree": make(kernels.build(isa=args.isa), f"colibri_{args.kernel}_new"),
    }
    rows_out, raw = [], {}
    # Attention's bound is arithmetic (MLA: 16 FLOP a byte of latents at 32 heads): the cores'
    # multiply-add ceiling, probed before the runs (512-bit vectors where the build has them).
    # (256-bit vectors for an AVX2 build.)
    wide = 0.0 if args.isa == "avx2" else kernels.fma_peak(16)
    ceiling = (wide or kernels.fma_peak(8)) if attention else 0.0
    probe = PassProbe() if args.probe else None
    halves = []  # --probe: per model and rows, the ratios after the slower and faster reads
    for name in args.shapes.split(","):
        ckpt = ensure_inputs(name)["colibri"]
        cfg = load_config(ckpt)
        sizes = [args.prompt] if args.prompt else [int(r) for r in args.rows.split(",")]
        for rows in sizes:
            if probe:
                probe.rates.clear()
            if args.kernel == "experts":
                routes = (record_prompt_routes if args.prompt else record_routes)(ckpt, rows)
                holds = (
                    quantized_holds(calls, args.held, args.base_lanes)
                    if args.held != "float32"
                    else ()
                )
                res = compare(calls, cfg, routes, args.passes, *holds, before_pass=probe)
            elif args.kernel == "linear":
                copies = -(-1_000_000_000 // (linear_params(cfg) * 4)) if args.dram else 1
                holds = linear_holds(calls, args.held)
                res = compare_linear(
                    calls, cfg, rows, args.passes, holds, copies, before_pass=probe
                )
            else:
                compare_kernel = compare_attend if args.kernel == "attend" else compare_mla
                res = compare_kernel(
                    calls, cfg, rows, args.passes, args.context, args.rounding, probe
                )
            raw[f"{name}/{rows}"] = res
            base, new = (np.asarray(res["ms"][v]) for v in calls)
            if probe:
                res["read_gb_s"] = list(probe.rates)
                halves += by_read_halves(name, rows, np.asarray(probe.rates), new / base)
            for v, t in zip(calls, (base, new), strict=True):
                med = float(np.median(t))
                rows_out.append(
                    {
                        "model": name,
                        "rows": rows,
                        "kernel": v,
                        "ms a step (median)": med,
                        "best": float(t.min()),
                        "GB/s": res["gb_per_step"] / med * 1e3,
                        "GFLOP/s": res["gflop_per_step"] / med * 1e3,
                        "time / base (median of passes)": float(np.median(t / base)),
                    }
                )
                if ceiling:
                    rows_out[-1]["of the FMA ceiling"] = rows_out[-1]["GFLOP/s"] / ceiling
            print(pd.DataFrame(rows_out[-2:]).to_string(index=False), flush=True)
    table = pd.DataFrame(rows_out)
    cmd = (
        f"python experiments/bench_kernel_revs.py --base {args.base} --kernel {args.kernel} "
        f"--passes {args.passes} "
        + (f"--prompt {args.prompt}" if args.prompt else f"--rows {args.rows}")
        + (f" --held {args.held}" if args.held != "float32" else "")
        + (f" --shapes {args.shapes}" if args.shapes != ",".join(SHAPES) else "")
        + (f" --context {args.context}" if args.context != 128 else "")
        + (" --dram" if args.dram else "")
        + (f" --base-lanes {args.base_lanes}" if args.base_lanes is not None else "")
        + (f" --isa {args.isa}" if args.isa else "")
        + (" --rounding" if args.rounding else "")
        + (" --probe" if args.probe else "")
        + (f" --out {args.out}" if args.out else "")
    )
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=HERE.parent, capture_output=True, text=True
    ).stdout.strip()
    what = {
        "experts": f"Expert calls of a {args.prompt}-token prefill (rows: its tokens)"
        if args.prompt
        else f"Expert calls of {STEPS} greedy steps",
        "linear": f"Linear calls (qkv, o, lm_head) of {STEPS} steps"
        + (" (a copy of the matrices a step, 1 GB of copies: from DRAM)" if args.dram else ""),
        "attend": f"Decode attention of every layer, {STEPS} steps after a {args.context}-token "
        "prompt,",
        "mla": f"MLA decode attention of every layer, {STEPS} steps after a {args.context}-token "
        "prompt,",
    }[args.kernel]
    md = [
        f"# The {args.kernel} kernel of two revisions, side by side",
        "",
        f"Command: `{cmd}` (working tree at {head}, base `{args.base}`)  ",
        f"{what} per pass, the versions alternating over {args.passes} passes; outputs "
        + ("equal to float32 rounding." if args.rounding else "bitwise equal."),
        *(
            [f"The cores' multiply-add ceiling, probed before the runs: {ceiling:.0f} GFLOP/s."]
            if ceiling
            else []
        ),
        "",
        markdown_table(table, index=False, floatfmt=".3f"),
        "",
    ]
    if halves:
        md += [
            "Passes by the plain read of 1 GiB on every core just before them (the slower and "
            "the faster half of each row's passes):",
            "",
            markdown_table(pd.DataFrame(halves), index=False, floatfmt=".3f"),
            "",
        ]
    stem = "kernel_revs" if args.kernel == "experts" else f"kernel_revs_{args.kernel}"
    stem += "_prompt" if args.prompt else ""
    stem = args.out or stem
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.md").write_text("\n".join(md))
    (RESULTS / f"{stem}.json").write_text(json.dumps({"command": cmd, "runs": raw}, indent=1))
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"wrote {RESULTS / stem}.md")


if __name__ == "__main__":
    main()
