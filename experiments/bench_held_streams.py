"""python experiments/bench_held_streams.py [--shapes olmoe] [--formats float32,int8,int4]
    [--alternations 40]

How fast colibri's expert kernel streams the routed experts' rows from memory at one row, in
each held format, against a plain read of memory in the same minutes: what bounds a batch-1
step's expert calls, the memory or the arithmetic on the rows. This machine's memory moves by
2x between minutes, so a rate measured a minute before another says little about their ratio;
here the cases alternate --alternations times in one process, and the ratios are summarised
separately for the slow and the fast reads.

Cases, each the best of two, in every alternation: a plain read of 1 GiB (huge pages) on every
core (`kernels.read_sum`, the read the peers benchmarks' roofline probes); for each format, one
token routed to every expert of every layer of the peers shape's checkpoint held so (hundreds
of MB: far beyond the caches) through the expert kernel (`workers.every_expert_call`); and the
linear kernel on one row over the 1 GiB as float32 rows. Reported per case, over the
alternations whose read was under --slow GB/s and over --fast: the range of its GB/s and the
median (quartiles) of its rate over the read of the same alternation.
Writes experiments/results/held_streams.md and .json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import pandas as pd
from tqdm import tqdm

from colibri import kernels
from colibri.bench.bandwidth import call_rate, probe_array, read_rate
from colibri.bench.formats import FORMATS
from colibri.bench.shapes import SHAPES, ensure_inputs, shape_checkpoint
from colibri.bench.workers import every_expert_call
from colibri.engine.hwinfo import cpu_detail
from colibri.report import markdown_table, write_report

RESULTS = Path(__file__).parent / "results"


def every_expert(ckpt: Path):
    """`workers.every_expert_call` on a checkpoint as colibri holds it by default."""
    from colibri.engine.model import load_model

    return every_expert_call(load_model(ckpt, progress=False))


def checkpoint(name: str, fmt: str) -> Path:
    if fmt == "float32":
        return ensure_inputs(name, SHAPES[name], with_llama=False)["colibri"]
    return shape_checkpoint(name, fmt, **FORMATS[fmt]["synth"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="olmoe")
    ap.add_argument("--formats", default="float32,int8,int4")
    ap.add_argument("--alternations", type=int, default=40)
    ap.add_argument("--slow", type=float, default=35.0, help="reads under this GB/s are slow")
    ap.add_argument("--fast", type=float, default=40.0, help="reads from this GB/s are fast")
    args = ap.parse_args()
    if not kernels.available():
        raise SystemExit("bench_held_streams needs colibri's CPU kernels")
    probe = probe_array(1.0)
    w = jnp.asarray(probe.reshape(-1, 4096))  # the same memory, as float32 rows
    v = jnp.ones((1, 4096), jnp.float32)
    linear = jax.jit(kernels.linear)
    linear(v, w).block_until_ready()
    cases = {"linear kernel, float32 rows": (lambda: linear(v, w).block_until_ready(), w.nbytes)}
    for name in args.shapes.split(","):
        for fmt in args.formats.split(","):
            cases[f"{name} experts, {fmt}"] = every_expert(checkpoint(name, fmt))
    samples = []
    for _ in tqdm(range(args.alternations), desc="alternations", unit="alt"):
        read = max(read_rate(probe) for _ in range(2))
        samples.append({"read": read} | {k: call_rate(*c, tries=2) for k, c in cases.items()})
    df = pd.DataFrame(samples)
    rows = []
    for case in cases:
        for label, part in (
            (f"under {args.slow:g}", df[df["read"] < args.slow]),
            (f"{args.fast:g} and over", df[df["read"] >= args.fast]),
        ):
            if part.empty:
                continue
            ratio = part[case] / part["read"]
            rows.append(
                {
                    "case": case,
                    "read GB/s": f"{label} ({part['read'].min():.1f}-{part['read'].max():.1f})",
                    "alternations": len(part),
                    "GB/s": f"{part[case].min():.1f}-{part[case].max():.1f}",
                    "/ read, median (quartiles)": f"{ratio.median():.2f} "
                    f"({ratio.quantile(0.25):.2f}-{ratio.quantile(0.75):.2f})",
                }
            )
    table = pd.DataFrame(rows)
    print(table.to_string(index=False))
    cmd = (
        f"python experiments/bench_held_streams.py --shapes {args.shapes} "
        f"--formats {args.formats} --alternations {args.alternations}"
    )
    md = [
        "# Held rows streamed by the expert kernel at one row, against a plain read",
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {cpu_detail()}  ",
        "Every alternation: a plain read of 1 GiB on every core (best of two), then one token "
        "routed to every expert of every layer through the expert kernel for each format "
        "(rows as colibri holds them, from memory), and the linear kernel on one row over the "
        "1 GiB (best of two each); each rate against that alternation's read.",
        "",
        markdown_table(table, index=False),
    ]
    write_report(RESULTS, "held_streams", md, {"command": cmd, "samples": samples, "table": rows})


if __name__ == "__main__":
    main()
