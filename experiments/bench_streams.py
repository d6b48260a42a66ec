"""python experiments/bench_streams.py [--mib 400] [--repeats 5] [--rows 512,768,4096] [--out NAME]

How fast weights stream through a matrix-vector product depending on which rows are read side
by side: the fact behind the row order of colibri's CPU kernels (colibri/kernels/cpu/tiles.h). A
small C++ program (bench_streams.cc, built here with the same flags as the kernels) computes
y = W x over --mib MiB of float32 weights on every core, in work items of 64 rows, visiting the
rows of an item one at a time, 4 or 8 neighbours side by side, 4 (8) side by side a quarter
(an eighth) of the item apart, or 4 (8) stored interleaved (8 or 16 floats of each row in turn,
one sequential stream); a plain read of the same bytes is the reference; and the read and the
quarter-apart rows again over items four times as long (the kernels' items where a call passes
over its weights once: gang.h's kLongItems), there also fetched 1 KiB ahead, and a row less
than a quarter apart (an odd number of rows, as simd.h's stream_gap takes them; the rows left
over one at a time), unfetched and with each stream fetched 1 KiB and 4 KiB ahead (tiles.h's
COLIBRI_ONE_INPUT_FETCH). GB/s: the best of --repeats, layouts interleaved; / read: the median
over the repeats of each layout's rate against the plain read of items as long in the same
repeat, as the machine's bandwidth moves from one to the next. Rows of 512 and 768 floats are
the expert rows of the peers shapes.
Writes experiments/results/streams.md and streams.json (--out: NAME.md and NAME.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

import pandas as pd

from colibri import kernels
from colibri.engine.hwinfo import cpu_detail
from colibri.report import markdown_table

HERE = Path(__file__).parent
RESULTS = HERE / "results"
CHUNK_ROWS = 64


def build(out_dir: Path) -> Path:
    cxx = kernels.compiler()
    if cxx is None:
        raise SystemExit("bench_streams needs a C++ compiler (g++, c++ or clang++; or set CXX)")
    exe = out_dir / "bench_streams"
    flags = [*kernels.CXX_FLAGS, "-pthread"]
    subprocess.run([cxx, *flags, str(HERE / "bench_streams.cc"), "-o", str(exe)], check=True)
    return exe


def run(exe: Path, row_floats: int, mib: int, repeats: int) -> list[dict]:
    args = [str(exe), str(row_floats), str(CHUNK_ROWS), str(mib), str(repeats)]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    rows = []
    for line in out.splitlines():
        name, side, gap, item, gb_s, ratio = line.split("\t")
        rows.append(
            {
                "row KiB": row_floats * 4 / 1024,
                "layout": name,
                "streams per thread": max(int(side), 1),  # interleaved rows: one stream
                "gap KiB": int(gap) * row_floats * 4 / 1024 if int(side) > 0 else 0.0,
                "item KiB": int(item) * row_floats * 4 / 1024,
                "GB/s": float(gb_s),
                "/ read (median)": float(ratio),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", default="512,768,4096", help="floats per weight row")
    ap.add_argument("--out", default="streams", help="results name: a run kept beside the others")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp))
        rows = [r for n in args.rows.split(",") for r in run(exe, int(n), args.mib, args.repeats)]
    df = pd.DataFrame(rows)
    ref = df[df["layout"] == "4 adjacent rows"].set_index("row KiB")["GB/s"]
    df["x vs 4 adjacent"] = df["GB/s"] / df["row KiB"].map(ref)
    table = markdown_table(df, index=False)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    text = (
        "# Weight streaming by row layout\n\n"
        f"`python experiments/bench_streams.py --mib {args.mib} --repeats {args.repeats} "
        f"--rows {args.rows}"
        + (f" --out {args.out}" if args.out != "streams" else "")
        + f"`; {cpu_detail()}, {os.cpu_count()} threads, "
        f"items of {CHUNK_ROWS} rows.\n\n"
        f"{table}\n"
    )
    (RESULTS / f"{args.out}.md").write_text(text)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {RESULTS / args.out}.md")


if __name__ == "__main__":
    main()
