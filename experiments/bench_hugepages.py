"""python experiments/bench_hugepages.py [--shapes qwen3_moe,olmoe]
    [--level kernel,linear,engine,load] [--out NAME]

The weights on 4 KiB pages against the same on 2 MiB pages (colibri/hugepages.py), side by
side in one process, on the peers checkpoints (experiments/bench_peers.py, made there or here
if missing). A machine whose speed moves by a quarter within minutes cannot tell a few percent
apart in separate runs; side by side it can.

--level kernel: the expert calls alone, on the routes the checkpoints choose at 1 and 16 rows
(as experiments/bench_kernel_revs.py replays them), on one set of random weights held twice:
once as XLA allocates it, once on huge pages; the two take turns step by step, --passes times
over 24 steps. Outputs must agree bitwise.
--level linear: the dense weights' linear calls alone (the attention projections of every
layer and lm_head, as bench_kernel_revs.py --kernel linear), at 1 and 16 rows, on random
weights held as XLA allocates them and on huge pages (as the engine holds its dense weights),
the two taking turns step by step.
--level engine: whole decode bursts; the checkpoint is loaded twice, once with
COLIBRI_HUGE_PAGES=0 (neither experts nor dense weights on huge pages), and the two engines
take turns burst by burst, 1 and then 16 conversations at a time as bench_peers decodes them;
tokens must agree.
--level load: load_model in fresh processes (as a user starts the engine), the two kinds of
page in turn, --passes pairs (default 4), until every expert is in place.

Reported: ms a step (or tok/s, or load s) of each, median over passes (or bursts), and the
median over pairs of huge / small time. Writes experiments/results/hugepages.md and .json
(--out NAME: NAME.md and .json).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from colibri import hugepages, kernels
from colibri.bench.conversations import BURST
from colibri.bench.kernel_calls import expert_call, linear_call
from colibri.bench.levels import BURSTS, engine_level, engine_under
from colibri.bench.replay import (
    compare,
    compare_linear,
    dense_on_huge_pages,
    on_huge_pages,
    record_routes,
)
from colibri.bench.shapes import SHAPES, ensure_inputs
from colibri.config import load_config
from colibri.formats import HOLD_ALL
from colibri.report import markdown_table, write_report

HERE = Path(__file__).parent
RESULTS = HERE / "results"
PAGES = ("4 KiB", "2 MiB")


def kernel_level(ckpt: Path, rows: int, passes: int) -> dict[str, list[float]]:
    """ms a step of the expert calls per pass, for each kind of page."""
    call = expert_call(kernels.build(), "colibri_moe_experts_pages")
    routes = record_routes(ckpt, rows)
    calls = dict.fromkeys(PAGES, call)
    return compare(calls, load_config(ckpt), routes, passes, hold={PAGES[1]: on_huge_pages})["ms"]


def linear_level(ckpt: Path, rows: int, passes: int) -> dict[str, list[float]]:
    """ms a step of the linear calls per pass, for each kind of page."""
    call = linear_call(kernels.build(), "colibri_linear_pages")
    calls = dict.fromkeys(PAGES, call)
    hold = {PAGES[0]: lambda mats: mats, PAGES[1]: dense_on_huge_pages}
    return compare_linear(calls, load_config(ckpt), rows, passes, hold)["ms"]


def engine(ckpt: Path, huge: bool):
    """(runner, first tokens of 16 conversations): one prompt, the last 8 tokens changed;
    loaded with COLIBRI_HUGE_PAGES as `huge` says (hugepages.enabled() reads it as it goes)."""
    before = os.environ.get("COLIBRI_HUGE_PAGES")
    os.environ["COLIBRI_HUGE_PAGES"] = "1" if huge else "0"
    try:
        return engine_under(ckpt, HOLD_ALL)
    finally:
        if before is None:
            del os.environ["COLIBRI_HUGE_PAGES"]
        else:
            os.environ["COLIBRI_HUGE_PAGES"] = before


LOAD = """
import sys, time, jax
from colibri.engine.model import load_model
t = time.perf_counter()
model = load_model(sys.argv[1], progress=False)
jax.block_until_ready(model.store.resident)
print(time.perf_counter() - t)
"""


def load_level(ckpt: Path, passes: int) -> dict[str, list[float]]:
    """Seconds to load the checkpoint in a fresh process, for each kind of page, in turn."""
    secs = {k: [] for k in PAGES}
    for i in range(passes):
        for k in PAGES if i % 2 == 0 else PAGES[::-1]:
            env = {**os.environ, "COLIBRI_HUGE_PAGES": "1" if k == PAGES[1] else "0"}
            done = subprocess.run(
                [sys.executable, "-c", LOAD, str(ckpt)],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            )
            secs[k].append(float(done.stdout.split()[-1]))
    return secs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--level", default="kernel,engine,load")
    ap.add_argument(
        "--passes", type=int, default=0, help="default: 14 (kernel, linear), 2 (engine), 4 (load)"
    )
    ap.add_argument("--out", default="hugepages", help="results name: a run kept beside")
    args = ap.parse_args()
    if not hugepages.enabled():
        sys.exit("no huge pages here (Linux only; COLIBRI_HUGE_PAGES=0 turns them off)")
    out, raw = [], {}
    for name in args.shapes.split(","):
        ckpt = ensure_inputs(name)["colibri"]
        for level in args.level.split(","):
            passes = args.passes or {"kernel": 14, "linear": 14, "engine": 2, "load": 4}[level]
            engines = {k: engine(ckpt, k == PAGES[1]) for k in PAGES} if level == "engine" else {}
            for rows in (1, 16) if level != "load" else (0,):
                if level == "kernel":
                    got = kernel_level(ckpt, rows, passes)
                elif level == "linear":
                    got = linear_level(ckpt, rows, passes)
                elif level == "engine":
                    got = engine_level(engines, rows, passes)
                else:
                    got = load_level(ckpt, passes)
                raw[f"{name}/{level}/{rows}"] = got
                small = np.asarray(got[PAGES[0]])
                for k in PAGES:
                    t = np.asarray(got[k])
                    med = float(np.median(t))
                    out.append(
                        {
                            "model": name,
                            "level": level,
                            "rows": rows or "",
                            "pages": k,
                            "ms a step (median)": med if level in ("kernel", "linear") else np.nan,
                            "tok/s (median burst)": rows * BURST / med
                            if level == "engine"
                            else np.nan,
                            "load s (median)": med if level == "load" else np.nan,
                            "time / 4 KiB (median of pairs)": float(np.median(t / small)),
                        }
                    )
                print(pd.DataFrame(out[-2:]).to_string(index=False), flush=True)
            del engines
    cmd = (
        f"python experiments/bench_hugepages.py --shapes {args.shapes} --level {args.level}"
        + (f" --passes {args.passes}" if args.passes else "")
        + (f" --out {args.out}" if args.out != "hugepages" else "")
    )
    md = [
        "# Weights on 4 KiB and 2 MiB pages, side by side",
        "",
        f"Command: `{cmd}`  ",
        "kernel: ms a step of the expert calls (24 greedy steps' routes, every layer), 14 passes "
        "taking turns step by step; outputs bitwise equal. linear: ms a step of the linear "
        "calls of the attention projections and lm_head, as kernel. engine: decode tok/s, "
        f"bursts of {BURST} steps taking turns, 2 x {BURSTS} per row count; same tokens. load: "
        "seconds to load the checkpoint in a fresh process, 4 pairs in turn.",
        "",
        markdown_table(pd.DataFrame(out), floatfmt=".3f", index=False),
    ]
    write_report(RESULTS, args.out, md, {"table": out, "runs": raw})


if __name__ == "__main__":
    main()
