"""python experiments/bench_overlap.py [--inputs 16] [--rows 768] [--mib 256] [--repeats 5]
    [--isa native|avx2] [--held f32|int8|int4] [--out NAME]

Whether a core hides streaming weights from DRAM behind the arithmetic on them, measured with
colibri's own matrix-vector tiles (colibri/kernels/cpu/, compiled into a small driver,
bench_overlap.cc, with the kernels' flags). This bounds decode with many rows: a row of
weights met by 16 inputs costs 8 FLOP a byte, so a core computing it from DRAM needs both its
streaming and its arithmetic at once. Cases, each thread pinned to a core, each core over
--mib MiB of weights of its own (huge pages) in items of 64 rows of --rows floats:

- one core multiply-adds: twelve independent chains of 8 lanes, nothing loaded (the arithmetic
  ceiling; where the build has 512-bit vectors and they are faster, kernels.fma_peak's on them);
- with --held int8 or int4 on builds with AVX-512 VBMI, one core widens: the operations the
  one-input tiles spend on each weight (making it from its bits, multiplying it in: the row
  pairs', or the 8-lane tiles' where the build keeps held rows out of the pairs, as on Zen 4),
  in registers with nothing loaded: the most one input over such rows can stream a core;
- one core streams: one input, the weights in L2 (what the tiles do at one row when memory
  keeps up), then from DRAM;
- one core computes: --inputs inputs, the weights in L2 (arithmetic only), then from DRAM;
- two cores read: eight sums over their weights, nothing else (the bandwidth the roofline of
  the peers benchmarks probes);
- two cores stream; one computes while the other streams (the expert calls' pairing of
  experts many rows chose with experts few chose, cpu/experts.h's ExpertCall); two cores compute.

Per case and core: GB/s of weights and GFLOP/s, best of --repeats (cases interleaved). The
summary compares one core's DRAM case with its two parts: the time streaming and computing would
take one after the other (no overlap) and the longer of the two (full overlap).
The inputs go through the tiles the linear kernel uses: on AVX-512 builds the paired tiles of
cpu/pairs.h (two inputs a 512-bit vector, inputs packed once) from 5 inputs on, tiles.h's
otherwise. --isa avx2 builds the driver without AVX-512 (kernels.ISA_LEVELS) on a CPU that has
it: tiles.h's tiles only, with 16 vector registers and VEX encodings instead of 32 and EVEX.
--held int8 (int4) holds the rows as the kernels hold those formats, a scale per 128 columns,
widened as they are loaded, in items of ~256 KiB as the expert kernel shares its calls out: one
input then says how close one-row calls over such rows can come to the bandwidth (held rows'
batch-1 roofline, experiments/bench_quantized.py --level peers).
Writes experiments/results/overlap.md and overlap.json (--isa avx2: overlap_avx2.md and .json;
--held int8: overlap_int8.md and .json; --out NAME: NAME.md and NAME.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

import jax
import pandas as pd

from colibri import kernels
from colibri.engine.hwinfo import cpu_detail
from colibri.report import markdown_table

HERE = Path(__file__).parent
RESULTS = HERE / "results"
SECONDS = 1.0  # per case and repeat


def build(out_dir: Path, isa: str = "native") -> Path:
    cxx = kernels.compiler()
    if cxx is None:
        raise SystemExit("bench_overlap needs a C++ compiler (g++, c++ or clang++; or set CXX)")
    exe = out_dir / "bench_overlap"
    cmd = [
        cxx,
        *kernels.CXX_FLAGS,
        *kernels.ISA_LEVELS[isa][1],
        *kernels.tile_flags(),  # the tiles the library takes on this CPU
        "-pthread",
        f'-DCPU_CC="{kernels.SOURCE}"',
        f"-I{jax.ffi.include_dir()}",
        str(HERE / "bench_overlap.cc"),
        "-o",
        str(exe),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    return exe


def measure(
    exe: Path, row_floats: int, inputs: int, mib: int, repeats: int, held: str = "f32"
) -> pd.DataFrame:
    args = [str(exe), str(row_floats), str(inputs), str(mib), str(SECONDS), str(repeats), held]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    rows = []
    for line in out.splitlines():
        case, core, n, where, gb_s, gflop_s = line.split("\t")
        rows.append(
            {
                "case": case,
                "core": int(core),
                "inputs": int(n),
                "weights from": where,
                "GB/s": float(gb_s),
                "GFLOP/s": float(gflop_s),
            }
        )
    return pd.DataFrame(rows)


def overlap(df: pd.DataFrame, inputs: int, wide: float = 0.0) -> dict:
    """One core's DRAM computing against its parts: seconds per GB of weights streaming alone
    (one input), computing alone (weights in L2) and both as measured. `wide`: one core's
    multiply-adds on 512-bit vectors (kernels.fma_peak), the ceiling where it is the higher
    (the driver's chains are 8 lanes)."""

    def one(case: str, where: str) -> pd.Series:
        return df[(df["case"] == case) & (df["weights from"] == where)].iloc[0]

    ceiling = max(one("one core multiply-adds", "registers")["GFLOP/s"], wide)
    stream = 1 / one("one core streams", "DRAM")["GB/s"]
    compute = 1 / one("one core computes", "L2")["GB/s"]
    both = 1 / one("one core computes", "DRAM")["GB/s"]
    serial, hidden = stream + compute, max(stream, compute)
    return {
        "inputs": inputs,
        "multiply-add ceiling GFLOP/s": ceiling,
        "tiles in L2 / ceiling": one("one core computes", "L2")["GFLOP/s"] / ceiling,
        "s/GB streaming": stream,
        "s/GB computing": compute,
        "s/GB both (measured)": both,
        "s/GB one after the other": serial,
        "s/GB fully overlapped": hidden,
        "overlap achieved": (serial - both) / (serial - hidden),
    }


def one_input(df: pd.DataFrame) -> dict:
    """One input: how close the tiles come to the bandwidth two cores read at."""

    def gb_s(case: str, where: str) -> float:
        return float(df[(df["case"] == case) & (df["weights from"] == where)]["GB/s"].sum())

    read = gb_s("two cores read", "DRAM")
    l2 = gb_s("one core streams", "L2")
    two = gb_s("two cores stream", "DRAM")
    out = {
        "one input, one core, L2 GB/s": l2,
        "one input, one core, DRAM GB/s": gb_s("one core streams", "DRAM"),
        "one input, two cores GB/s": two,
        "two cores read GB/s": read,
        "two cores / read": two / read,
        "two cores from L2 / read": 2 * l2 / read,
    }
    widen = gb_s("one core widens", "registers")
    if widen:  # held rows on builds with the row pairs' byte permutes
        out |= {
            "widening alone, one core GB/s": widen,
            "one core from L2 / widening alone": l2 / widen,
            "widening alone, two cores / read": 2 * widen / read,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", type=int, default=16, help="inputs of the computing cases")
    ap.add_argument("--rows", type=int, default=768, help="floats a weight row")
    ap.add_argument("--mib", type=int, default=256, help="MiB of weights a core")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--isa", choices=list(kernels.ISA_LEVELS), default="native")
    ap.add_argument("--held", choices=("f32", "int8", "int4"), default="f32")
    ap.add_argument("--out", help="results name (default overlap[_ISA][_HELD]): a run kept beside")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp), args.isa)
        df = measure(exe, args.rows, args.inputs, args.mib, args.repeats, args.held)
    wide = kernels.fma_peak(16, threads=1) if args.isa == "native" else 0.0
    summary = overlap(df, args.inputs, wide)
    one = one_input(df)
    rows = "float32 rows" if args.held == "f32" else f"{args.held} rows"
    one_line = (
        f"One input over {rows}: a core {one['one input, one core, L2 GB/s']:.1f} GB/s from "
        f"L2, {one['one input, one core, DRAM GB/s']:.1f} from DRAM; two cores "
        f"{one['one input, two cores GB/s']:.1f} together, {one['two cores / read']:.0%} of the "
        f"{one['two cores read GB/s']:.1f} GB/s they read with nothing else to do (at their "
        f"rate from L2, with streaming fully hidden: {one['two cores from L2 / read']:.0%})"
    )
    if "widening alone, one core GB/s" in one:
        one_line += (
            f"; the operations that make and multiply in the weights, alone in registers "
            f"(`one core widens`), allow a core {one['widening alone, one core GB/s']:.1f} GB/s, "
            f"of which the tiles from L2 reach {one['one core from L2 / widening alone']:.0%}, "
            f"and two cores {one['widening alone, two cores / read']:.0%} of the read"
        )
    both = df[df["case"].map(df.groupby("case")["core"].nunique()) > 1]  # two cores at once
    totals = both.groupby("case", sort=False)["GB/s"].sum().rename("GB/s, both cores")
    table = markdown_table(df, index=False)
    totals_table = markdown_table(totals.reset_index(), index=False)
    print(table)
    print(totals_table)
    print(one_line)
    print(
        f"one core, {args.inputs} inputs from DRAM: {summary['overlap achieved']:.0%} of the "
        "possible overlap of streaming and arithmetic; the tiles from L2 at "
        f"{summary['tiles in L2 / ceiling']:.0%} of the multiply-add ceiling"
    )
    RESULTS.mkdir(exist_ok=True)
    text = (
        "# Streaming weights and computing on them at once\n\n"
        f"`python experiments/bench_overlap.py --inputs {args.inputs} --rows {args.rows} "
        f"--mib {args.mib} --repeats {args.repeats}"
        + (f" --isa {args.isa}" if args.isa != "native" else "")
        + (f" --held {args.held}" if args.held != "f32" else "")
        + (f" --out {args.out}" if args.out else "")
        + f"`; {os.cpu_count()} cores of {cpu_detail()}, best of "
        f"{args.repeats} runs of {SECONDS:g} s per case.\n\n"
        f"{table}\n\n"
        f"{totals_table}\n\n"
        f"One core with {args.inputs} inputs from DRAM: {summary['s/GB both (measured)']:.3f} s "
        f"a GB of weights, against {summary['s/GB one after the other']:.3f} streaming then "
        f"computing and {summary['s/GB fully overlapped']:.3f} fully overlapped: "
        f"{summary['overlap achieved']:.0%} of the possible overlap. The tiles with their "
        f"weights in L2 run at {summary['tiles in L2 / ceiling']:.0%} of the core's "
        f"multiply-add ceiling ({summary['multiply-add ceiling GFLOP/s']:.1f} GFLOP/s).\n\n"
        f"{one_line}.\n"
    )
    name = args.out or "_".join(
        ["overlap"]
        + ([args.isa] if args.isa != "native" else [])
        + ([args.held] if args.held != "f32" else [])
    )
    (RESULTS / f"{name}.md").write_text(text)
    (RESULTS / f"{name}.json").write_text(
        json.dumps(
            {"cases": df.to_dict(orient="records"), "overlap": summary, "one input": one},
            indent=1,
        )
    )
    print(f"wrote {RESULTS / name}.md")


if __name__ == "__main__":
    main()
