"""python experiments/bench_held_streams.py [--shapes olmoe] [--formats float32,int8,int4]
    [--rows 1] [--alternations 40] [--out held_streams]

How fast colibri's expert kernel streams the routed experts' rows from memory, in each held
format and at each number of rows an expert, against a plain read of memory in the same
minutes: what bounds a step's expert calls, the memory or the arithmetic on the rows. This
machine's memory moves by 2x between minutes, so a rate measured a minute before another says
little about their ratio; here the cases alternate --alternations times in one process, and
the ratios are summarised separately for the slow and the fast reads.

Cases, each the best of two, in every alternation: a plain read of 1 GiB (huge pages) on every
core (`kernels.read_sum`, the read the peers benchmarks' roofline probes); for each format and
each of --rows, that many tokens routed to every expert of every layer of the peers shape's
checkpoint held so (hundreds of MB: far beyond the caches) through the expert kernel
(`workers.every_expert_call`); and the linear kernel on one row over the 1 GiB as float32 rows.
Reported per case, over the alternations whose read was under --slow GB/s and over --fast: the
range of its GB/s and the median (quartiles) of its rate over the bound of the same
alternation: the read, or where the call's multiply-adds at the probed peak of the widest
vectors (`kernels.fma_peak`, before the alternations) take longer, that time. Beside each
expert case, the GFLOP/s of the same call on weights in the caches (`from_cache`): where the
two agree, the call computes as fast from memory as without it, and its arithmetic, not the
stream, bounds it.
Writes experiments/results/<out>.md and .json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import pandas as pd
from tqdm import tqdm

from colibri import kernels
from colibri.bench.bandwidth import call_rate, fma_ceiling, probe_array, read_rate
from colibri.bench.shapes import held_checkpoint
from colibri.bench.workers import every_expert_call
from colibri.engine.hwinfo import cpu_detail
from colibri.report import markdown_table, write_report

RESULTS = Path(__file__).parent / "results"


def every_expert(ckpt: Path, rows: list[int]):
    """`workers.every_expert_call` at each of `rows` on a checkpoint as colibri holds it by
    default (loaded once), with the FLOPs of each call and the GFLOP/s of the same kernel on
    weights in the caches (`from_cache`)."""
    from colibri.engine.model import load_model

    model = load_model(ckpt, progress=False)
    experts, ff = model.experts[0]["gate"].shape[:2]  # (held: the last axis may be packed)
    weights = len(model.experts) * experts * 3 * ff * model.cfg.hidden
    return {r: (*every_expert_call(model, r), 2 * r * weights, from_cache(model, r)) for r in rows}


def from_cache(model, rows: int, experts: int = 4, calls: int = 100) -> float:
    """GFLOP/s of the expert kernel over the first `experts` experts of the first layer (a
    few MiB: in L3 after the first call), every one of `rows` rows routed to each, `calls`
    calls in one program, each input the last output nudged so that every call runs: the
    kernel's arithmetic with the memory out of the way. The best of ten."""
    layer = model.experts[0]
    g, u, d = (layer[k][:experts] for k in ("gate", "up", "down"))
    ids = jnp.broadcast_to(jnp.arange(experts, dtype=jnp.int32), (rows, experts))

    def step(_, x):
        return x + 1e-30 * kernels.moe_experts(g, u, d, x, ids)[:, 0, :]

    run = jax.jit(lambda x: jax.lax.fori_loop(0, calls, step, x))
    x = jnp.cos(jnp.arange(rows * model.cfg.hidden, dtype=jnp.float32)).reshape(rows, -1)
    run(x).block_until_ready()
    flops = calls * 2 * rows * experts * 3 * g.shape[1] * model.cfg.hidden
    return call_rate(lambda: run(x).block_until_ready(), flops, tries=10)  # of FLOPs: GFLOP/s


def bound_name(reads: pd.Series, computing: float) -> str:
    """What bounds a case over these alternations: the read, the multiply-adds, or each in some."""
    if reads.max() <= computing:
        return "read"
    return f"computing ({computing:.1f} GB/s)" if reads.min() >= computing else "both"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="olmoe")
    ap.add_argument("--formats", default="float32,int8,int4")
    ap.add_argument("--rows", default="1", help="rows an expert, e.g. 1,8,16")
    ap.add_argument("--alternations", type=int, default=40)
    ap.add_argument("--slow", type=float, default=35.0, help="reads under this GB/s are slow")
    ap.add_argument("--fast", type=float, default=40.0, help="reads from this GB/s are fast")
    ap.add_argument("--out", default="held_streams")
    args = ap.parse_args()
    if not kernels.available():
        raise SystemExit("bench_held_streams needs colibri's CPU kernels")
    peak = fma_ceiling(repeats=2)
    probe = probe_array(1.0)
    w = jnp.asarray(probe.reshape(-1, 4096))  # the same memory, as float32 rows
    v = jnp.ones((1, 4096), jnp.float32)
    linear = jax.jit(kernels.linear)
    linear(v, w).block_until_ready()
    cases = {
        "linear kernel, float32 rows": (lambda: linear(v, w).block_until_ready(), w.nbytes, 0, 0)
    }
    for name in args.shapes.split(","):
        for fmt in args.formats.split(","):
            rows = [int(r) for r in args.rows.split(",")]
            at_rows = every_expert(held_checkpoint(name, fmt), rows)
            for r, case in at_rows.items():
                cases[f"{name} experts, {fmt}" + (f", {r} rows" if r > 1 else "")] = case
    samples = []
    for _ in tqdm(range(args.alternations), desc="alternations", unit="alt"):
        read = max(read_rate(probe) for _ in range(2))
        rates = {k: call_rate(call, n, tries=2) for k, (call, n, *_) in cases.items()}
        samples.append({"read": read} | rates)
    df = pd.DataFrame(samples)
    rows = []
    for case, (_, nbytes, flops, cached) in cases.items():
        # The bound's GB/s: the read, or the bytes over the time the multiply-adds take at peak.
        computing = nbytes / (flops / peak) if flops else float("inf")
        for label, part in (
            (f"under {args.slow:g}", df[df["read"] < args.slow]),
            (
                f"{args.slow:g}-{args.fast:g}",
                df[(df["read"] >= args.slow) & (df["read"] < args.fast)],
            ),
            (f"{args.fast:g} and over", df[df["read"] >= args.fast]),
        ):
            if part.empty:
                continue
            ratio = part[case] / part["read"].clip(upper=computing)
            rows.append(
                {
                    "case": case,
                    "read GB/s": f"{label} ({part['read'].min():.1f}-{part['read'].max():.1f})",
                    "alternations": len(part),
                    "GB/s": f"{part[case].min():.1f}-{part[case].max():.1f}",
                    "GFLOP/s": f"{part[case].max() * flops / nbytes:.0f}" if flops else "",
                    "GFLOP/s from cache": f"{cached:.0f}" if cached else "",
                    "bound": bound_name(part["read"], computing),
                    "/ bound, median (quartiles)": f"{ratio.median():.2f} "
                    f"({ratio.quantile(0.25):.2f}-{ratio.quantile(0.75):.2f})",
                }
            )
    table = pd.DataFrame(rows)
    print(table.to_string(index=False))
    cmd = (
        f"python experiments/bench_held_streams.py --shapes {args.shapes} "
        f"--formats {args.formats} --rows {args.rows} --alternations {args.alternations}"
        + (f" --out {args.out}" if args.out != "held_streams" else "")
    )
    md = [
        "# Held rows streamed by the expert kernel, against a plain read",
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {cpu_detail()}; multiply-add ceiling {peak:.0f} GFLOP/s, all cores together  ",
        "Every alternation: a plain read of 1 GiB on every core (best of two), then, for each "
        "format and number of rows, that many tokens routed to every expert of every layer "
        "through the expert kernel (rows as colibri holds them, from memory), and the linear "
        "kernel on one row over the 1 GiB (best of two each). Each rate against the bound of "
        "its alternation: the read, or where the call's multiply-adds at the peak take longer "
        "(bound: computing), the bytes over that time. GFLOP/s: at the best rate; from cache: the "
        "same kernel and rows over four experts of one layer, called 100 times in one program "
        "(weights in L3), best of ten, before the alternations.",
        "",
        markdown_table(table, index=False),
    ]
    write_report(
        RESULTS,
        args.out,
        md,
        {"command": cmd, "peak_gflops": peak, "samples": samples, "table": rows},
    )


if __name__ == "__main__":
    main()
