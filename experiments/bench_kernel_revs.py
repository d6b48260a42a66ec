"""python experiments/bench_kernel_revs.py [--base HEAD~1] [--kernel experts] [--held fp8|int4|...]
    [--prompt 256]

A kernel of colibri/kernels/cpu.cc in two versions side by side, in one process: the working
tree's and that of --base (any git revision). Both libraries are built as the engine builds
its own and registered with XLA under names of their own; their calls alternate, so that both
meet the same phases of a machine whose speed moves by a quarter within minutes (runs in
separate processes could not tell 5% apart here): step by step, the first to go alternating.
Run it with --base HEAD on a clean tree (the same kernel twice) to see the spread that noise
alone gives.

--kernel experts (the routed experts): the routes the checkpoints of
experiments/bench_peers.py (made there, or here if missing) choose when --rows conversations
decode at once (as there: one prompt, the last 8 tokens changed in each conversation; 24
greedy steps), replayed on random weights of the same shapes held on huge pages as the
engine holds them (colibri/hugepages.py), every layer of every step per pass; with --held bf16,
as bfloat16 bits; with --held fp8 (int4, awq4, int8), quantized and held as those rows, as
experiments/bench_quantized.py holds them
(--base must have that kernel); with --prompt N, the calls of one N-token prefill instead (its
routes, one step a pass). --kernel linear:
the same shapes' attention projections (qkv and o of every layer) and lm_head on --rows rows,
24 steps per pass. --kernel attend: decode attention of every layer for --rows conversations,
24 steps after a 128-token prompt, the keys and values read from DRAM as in the engine. The two
versions' outputs must agree bitwise (the kernels' results never depend on how work is shared
out). Reported: ms a step for each version (median of passes), GB/s of the weights (keys and
values) read (for the experts: the distinct ones) and GFLOP/s, and the median over passes of
new / base time.
Writes experiments/results/kernel_revs.md and kernel_revs.json (experts; with --prompt,
kernel_revs_prompt.md and .json), or kernel_revs_linear.md / kernel_revs_attend.md and .json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd

from colibri import hugepages, kernels
from colibri.report import markdown_table

HERE = Path(__file__).parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
from bench_peers import SHAPES, ensure_inputs, other_conversations, prompt_ids  # noqa: E402

STEPS = 24


def record_routes(ckpt: Path, rows: int, prompt_len: int = 128) -> np.ndarray:
    """[steps, layers, rows, top_k] slot ids the routers chose, greedy from the prompt."""
    from colibri.engine.model import load_model
    from colibri.engine.runner import Row, Runner

    model = load_model(ckpt, progress=False)
    runner = Runner(model, slots=rows, capacity=prompt_len + STEPS + 8)
    prompt = prompt_ids(model.cfg.vocab_size, prompt_len)
    logits, _ = runner.prefill(0, prompt)
    toks = [int(np.argmax(logits)), *other_conversations(runner, prompt, rows)]
    routes, done = [], 0
    while done < STEPS:
        at = [Row(s, toks[s], prompt_len + done) for s in range(rows)]
        fwd = runner.decode_async(at, steps=STEPS - done)
        greedy = fwd.tokens()
        routes += list(fwd.result()[1])
        toks, done = greedy[-1].tolist(), done + fwd.ran()
    return np.asarray(routes)[:, :, :rows]


def source_at(rev: str, into: Path) -> Path:
    """cpu.cc as it is at git revision `rev`."""
    text = subprocess.run(
        ["git", "show", f"{rev}:colibri/kernels/cpu.cc"],
        cwd=HERE.parent,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    out = into / "cpu.cc"
    out.write_text(text)
    return out


def registered(lib_path: Path, symbol: str, name: str) -> None:
    """Register the library's handler `symbol` with XLA as target `name`."""
    lib = ctypes.cdll.LoadLibrary(str(lib_path))
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")


def expert_call(lib_path: Path, name: str):
    """The library's expert kernel, registered with XLA as `name`: f(gate, up, down, x, ids);
    over bfloat16 bits (uint16 weights) its bfloat16 variant, `name`_bf16, over FP8 rows
    (uint8) its fp8 one, `name`_fp8, over int4 rows (int8) `name`_int4, over int4 rows with
    zero points (uint32) `name`_int4z and over int8 rows (int32) `name`_int8, where it has
    them."""
    registered(lib_path, "ColibriMoeExperts", name)
    lib = ctypes.cdll.LoadLibrary(str(lib_path))
    variants = {jnp.dtype(jnp.float32): name}
    kinds = (
        (jnp.uint16, "Bf16", "bf16"),
        (jnp.uint8, "Fp8", "fp8"),
        (jnp.int8, "Int4", "int4"),
        (jnp.uint32, "Int4z", "int4z"),
        (jnp.int32, "Int8", "int8"),
    )
    for dtype, symbol, suffix in kinds:
        if hasattr(lib, f"ColibriMoeExperts{symbol}"):
            registered(lib_path, f"ColibriMoeExperts{symbol}", f"{name}_{suffix}")
            variants[jnp.dtype(dtype)] = f"{name}_{suffix}"

    def call(gate, up, down, x, ids):
        shape = (*ids.shape, x.shape[1])
        out = jax.ShapeDtypeStruct(shape, jnp.float32)
        target = variants[jnp.dtype(gate.dtype)]
        return jax.ffi.ffi_call(target, out, vmap_method="sequential")(gate, up, down, x, ids)

    return jax.jit(call)


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


def linear_call(lib_path: Path, name: str):
    """The library's linear kernel, registered with XLA as `name`: f(x, w) = x @ w.T (not
    jitted: called inside a jitted step)."""
    registered(lib_path, "ColibriLinear", name)

    def call(x, w):
        out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
        return jax.ffi.ffi_call(name, out, vmap_method="sequential")(x, w)

    return call


def alternate(calls: dict, step, steps: int, passes: int) -> dict[str, list[float]]:
    """ms a step of step(f, i) for i < steps, per pass. The versions take turns step by step
    (which goes first flips every step), so each pair of steps meets the same phase of the
    machine."""
    ms = {v: [] for v in calls}
    order = list(calls)
    for _ in range(passes):
        spent = dict.fromkeys(calls, 0.0)
        for i in range(steps):
            for v in order if i % 2 == 0 else order[::-1]:
                t = time.perf_counter()
                step(calls[v], i).block_until_ready()
                spent[v] += time.perf_counter() - t
        for v in calls:
            ms[v].append(spent[v] / steps * 1e3)
    return ms


def same_bits(outputs: dict) -> None:
    ref = next(iter(outputs.values()))
    for v, y in outputs.items():
        assert np.array_equal(np.asarray(y), np.asarray(ref)), f"{v}: outputs differ bitwise"


def weights(rng, *shape) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02)


def on_huge_pages(a: jax.Array) -> jax.Array:
    """A copy of `a` on 2 MiB pages (colibri.hugepages), as the engine holds routed experts."""
    h = hugepages.empty(a.shape, a.dtype)
    h[:] = np.asarray(a)
    out = jax.device_put(h)
    assert out.unsafe_buffer_pointer() == h.ctypes.data, "JAX copied the array"
    return out


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


def compare(
    calls: dict,
    cfg,
    routes: np.ndarray,
    passes: int,
    hold: dict | None = None,
    weight_bytes: float = 4.0,
) -> dict:
    """Time every version on the routes, alternating; ms a step per pass for each version.
    `hold`: for some versions, where their copy of the weights is put (others: where XLA
    allocates them); by default every version's on huge pages, as in the engine.
    `weight_bytes`: bytes a weight takes as held, for the GB a step reads."""
    m = cfg.moe
    S, D, F, L = m.num_experts, cfg.hidden, m.moe_ff, routes.shape[1]
    rng = np.random.default_rng(0)
    layers = [
        (weights(rng, S, F, D), weights(rng, S, F, D), weights(rng, S, D, F)) for _ in range(L)
    ]
    x = jnp.asarray(rng.standard_normal((routes.shape[2], D), np.float32))
    ids = [[jnp.asarray(r, jnp.int32) for r in step] for step in routes]
    if hold is None:
        hold = dict.fromkeys(calls, on_huge_pages) if hugepages.enabled() else {}
    held = {
        v: [tuple(map(hold[v], layer)) for layer in layers] if v in hold else layers for v in calls
    }
    same_bits({v: f(*held[v][0], x, ids[0][0]) for v, f in calls.items()})

    def step(v, i):
        for layer, e in zip(held[v], ids[i], strict=True):
            y = calls[v](*layer, x, e)
        return y

    ms = alternate({v: v for v in calls}, step, len(ids), passes)
    distinct = np.mean([[len(np.unique(r)) for r in step] for step in routes], axis=0)
    gb = float(distinct.sum()) * 3 * D * F * weight_bytes / 1e9
    gflop = routes.shape[2] * m.top_k * L * 3 * D * F * 2 / 1e9
    return {"ms": ms, "gb_per_step": gb, "gflop_per_step": gflop, "distinct": distinct.tolist()}


def compare_linear(calls: dict, cfg, rows: int, passes: int) -> dict:
    """The projections of every layer (qkv, o) and lm_head on `rows` rows, alternating."""
    D, q = cfg.hidden, cfg.num_heads * cfg.head_dim
    kv = 2 * cfg.num_kv_heads * cfg.head_dim
    rng = np.random.default_rng(0)
    layers = [(weights(rng, q + kv, D), weights(rng, D, q)) for _ in range(cfg.num_layers)]
    head = weights(rng, cfg.vocab_size, D)
    x = jnp.asarray(rng.standard_normal((rows, D), np.float32))
    xq = jnp.asarray(rng.standard_normal((rows, q), np.float32))

    def program(f):  # one jitted step a version, as the engine's forward holds its calls
        def run(x, xq, layers, head):
            return [f(x, qkv) for qkv, _ in layers] + [f(xq, o) for _, o in layers] + [f(x, head)]

        return jax.jit(run)

    steps = {v: program(f) for v, f in calls.items()}
    same_bits({v: run(x, xq, layers, head)[-1] for v, run in steps.items()})
    ms = alternate(steps, lambda run, i: run(x, xq, layers, head)[-1], STEPS, passes)
    params = cfg.num_layers * (q + kv + q) * D + cfg.vocab_size * D
    return {"ms": ms, "gb_per_step": params * 4 / 1e9, "gflop_per_step": rows * params * 2 / 1e9}


def compare_attend(calls: dict, cfg, rows: int, passes: int, prompt_len: int = 128) -> dict:
    """Decode attention of every layer for `rows` conversations at positions prompt_len + i for
    step i < STEPS, alternating. Each layer has a cache of its own, and steps take turns among
    three sets of caches: as in the engine (whose expert weights stream through the L3 between
    layers), keys and values come from DRAM."""
    H, Hkv, Dh, L = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    cap = prompt_len + STEPS + 8
    rng = np.random.default_rng(0)
    sets = [
        [(weights(rng, rows, Hkv, cap, Dh), weights(rng, rows, Hkv, cap, Dh)) for _ in range(L)]
        for _ in range(3)
    ]
    q = jnp.asarray(rng.standard_normal((rows, H, Dh), np.float32))
    slots = jnp.arange(rows, dtype=jnp.int32)

    def program(f):
        def run(q, caches, pos):
            out = q
            for k, v in caches:
                out = f(out, k, v, slots, pos, cfg.attn_scale)
            return out

        return jax.jit(run)

    steps = {v: program(f) for v, f in calls.items()}
    at = [jnp.full((rows,), prompt_len + i, jnp.int32) for i in range(STEPS)]
    same_bits({v: run(q, sets[0], at[-1]) for v, run in steps.items()})
    ms = alternate(steps, lambda run, i: run(q, sets[i % 3], at[i]), STEPS, passes)
    positions = prompt_len + (STEPS + 1) / 2  # mean keys a row reads
    gb = L * rows * Hkv * positions * Dh * 2 * 4 / 1e9
    gflop = L * rows * H * positions * Dh * 4 / 1e9
    return {"ms": ms, "gb_per_step": gb, "gflop_per_step": gflop}


# Per --held format: bytes of a weight's value, float32s a block keeps (scale, offset).
VALUE_BYTES = {"bf16": (2, 0), "fp8": (1, 1), "int4": (0.5, 1), "awq4": (0.5, 2), "int8": (1, 2)}


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """Each weight's bfloat16 bits (the float32's top half), as the engine holds bf16 weights."""
    return (np.asarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def quantized_holds(calls: dict, fmt: str) -> tuple[dict, float]:
    """For `compare`: every version holds each random matrix as the same bfloat16 bits or
    quantized rows (FP8, int4, int4 with zero points, int8: bench_quantized's), on huge pages;
    and the bytes a weight takes so (its value's, and its share of the block's scale and
    offset)."""
    from bench_quantized import FORMATS  # bench_quantized imports this module

    f = FORMATS.get(fmt)
    held = bf16_bits if f is None else lambda a: f["pair"](a)[0]
    rows: dict[int, tuple] = {}

    def hold(a):
        if id(a) not in rows:
            rows[id(a)] = (a, on_huge_pages(held(a)))
        return rows[id(a)][1]

    value, floats = VALUE_BYTES[fmt]
    return dict.fromkeys(calls, hold), value + (4 * floats / f["blocks"][0] if f else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD~1", help="git revision to compare with")
    ap.add_argument("--kernel", choices=("experts", "linear", "attend"), default="experts")
    ap.add_argument("--passes", type=int, default=10)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument(
        "--held",
        choices=("float32", *VALUE_BYTES),
        default="float32",
        help="experts: the weights as float32, as bfloat16 bits, or quantized as FP8, int4, "
        "AWQ's int4 or int8 rows (bench_quantized.py)",
    )
    ap.add_argument(
        "--prompt",
        type=int,
        default=0,
        help="experts: the calls of a prefill of this many tokens (one step a pass) instead of "
        "--rows conversations decoding",
    )
    args = ap.parse_args()
    if args.prompt and args.kernel != "experts":
        ap.error("--prompt is for --kernel experts")
    if not kernels.available():
        sys.exit("colibri CPU kernels unavailable (see the log)")
    from colibri.config import load_config

    with tempfile.TemporaryDirectory() as tmp:
        base_lib = kernels.build(source_at(args.base, Path(tmp)))
    make = {"experts": expert_call, "linear": linear_call, "attend": attend_call}[args.kernel]
    calls = {
        args.base: make(base_lib, f"colibri_{args.kernel}_base"),
        "working tree": make(kernels.build(), f"colibri_{args.kernel}_new"),
    }
    rows_out, raw = [], {}
    for name in args.shapes.split(","):
        ckpt = ensure_inputs(name, SHAPES[name], with_llama=False)["colibri"]
        cfg = load_config(ckpt)
        sizes = [args.prompt] if args.prompt else [int(r) for r in args.rows.split(",")]
        for rows in sizes:
            if args.kernel == "experts":
                routes = (record_prompt_routes if args.prompt else record_routes)(ckpt, rows)
                if args.held != "float32":
                    holds = quantized_holds(calls, args.held)
                    res = compare(calls, cfg, routes, args.passes, *holds)
                else:
                    res = compare(calls, cfg, routes, args.passes)
            elif args.kernel == "linear":
                res = compare_linear(calls, cfg, rows, args.passes)
            else:
                res = compare_attend(calls, cfg, rows, args.passes)
            raw[f"{name}/{rows}"] = res
            base, new = (np.asarray(res["ms"][v]) for v in calls)
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
            print(pd.DataFrame(rows_out[-2:]).to_string(index=False), flush=True)
    table = pd.DataFrame(rows_out)
    cmd = (
        f"python experiments/bench_kernel_revs.py --base {args.base} --kernel {args.kernel} "
        f"--passes {args.passes} "
        + (f"--prompt {args.prompt}" if args.prompt else f"--rows {args.rows}")
        + (f" --held {args.held}" if args.held != "float32" else "")
    )
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=HERE.parent, capture_output=True, text=True
    ).stdout.strip()
    what = {
        "experts": f"Expert calls of a {args.prompt}-token prefill (rows: its tokens)"
        if args.prompt
        else f"Expert calls of {STEPS} greedy steps",
        "linear": f"Linear calls (qkv, o, lm_head) of {STEPS} steps",
        "attend": f"Decode attention of every layer, {STEPS} steps after a 128-token prompt,",
    }[args.kernel]
    md = [
        f"# The {args.kernel} kernel of two revisions, side by side",
        "",
        f"Command: `{cmd}` (working tree at {head}, base `{args.base}`)  ",
        f"{what} per pass, the versions alternating over {args.passes} passes; outputs "
        "bitwise equal.",
        "",
        markdown_table(table, index=False, floatfmt=".3f"),
        "",
    ]
    stem = "kernel_revs" if args.kernel == "experts" else f"kernel_revs_{args.kernel}"
    stem += "_prompt" if args.prompt else ""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.md").write_text("\n".join(md))
    (RESULTS / f"{stem}.json").write_text(json.dumps({"command": cmd, "runs": raw}, indent=1))
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"wrote {RESULTS / stem}.md")


if __name__ == "__main__":
    main()
