"""python experiments/bench_fp8.py [--shapes qwen3_moe,olmoe] [--level kernel,engine] [--passes N]

What holding a block-quantized FP8 checkpoint's routed experts as FP8 rows buys
(colibri.weights.expert_dtype: each row's float8_e4m3fn values and its float32 block scales,
widened and scaled exactly as the CPU kernel loads them) against the same experts dequantized
to float32 at load (COLIBRI_FP8=0), side by side in one process, on the peers benchmark's
shapes (experiments/bench_peers.py) quantized in blocks of 128 x 128 as DeepSeek-V3 ships.

--level kernel: the expert calls alone, on the routes the peers checkpoints choose at 1 and 16
rows (as experiments/bench_kernel_revs.py replays them): random weights block-quantized, held
once as FP8 rows and once as the float32s they dequantize to, both on huge pages as the engine
holds them; the two take turns step by step, --passes times (default 14) over 24 steps.
Outputs must agree bitwise.
--level engine: the FP8 checkpoint (made here, cached under .cache/bench-peers) loaded twice,
once with COLIBRI_FP8=0; the two engines decode bursts in turn, 1 and then 16 conversations
at a time, --passes (default 2) x 24 bursts each; tokens must agree.

Reported: ms a step (kernel) or tok/s (engine) of each, median over passes (bursts), the median
over pairs of FP8 / float32 time, and the routed experts' bytes as held. Writes
experiments/results/fp8.md and .json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

HERE = Path(__file__).parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
from bench_bf16 import engine_under, held_rows, shape_checkpoint  # noqa: E402
from bench_hugepages import BURST, BURSTS, engine_level  # noqa: E402
from bench_kernel_revs import compare, expert_call, on_huge_pages, record_routes  # noqa: E402
from bench_peers import SHAPES, ensure_inputs  # noqa: E402

from colibri import kernels  # noqa: E402
from colibri.checkpoint import FP8_ROWS, Fp8Scales, quantize_fp8  # noqa: E402
from colibri.config import load_config  # noqa: E402
from colibri.report import markdown_table, write_report  # noqa: E402
from colibri.weights import expert_shapes  # noqa: E402

HELD = ("float32", "fp8")
BLOCK = 128


def fp8_pair(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Experts [S, R, C] block-quantized one by one: (FP8 rows, the float32 they stand for)."""
    rows, wide = [], []
    for w in np.asarray(a, np.float32):
        bits, scale_inv = quantize_fp8(w, (BLOCK, BLOCK))
        scales = Fp8Scales(scale_inv, 0, BLOCK, BLOCK, w.shape[1])
        rows.append(scales.pack(bits.reshape(-1)).reshape(w.shape[0], -1))
        wide.append(scales.dequantize(bits))
    return np.stack(rows), np.stack(wide)


def kernel_level(ckpt: Path, rows: int, passes: int) -> dict:
    call = expert_call(kernels.build(), "colibri_moe_experts_held")
    pairs: dict[int, tuple] = {}

    def pair(a):  # both versions hold the same quantization of each random matrix
        key = id(a)
        if key not in pairs:
            pairs[key] = (a, fp8_pair(a))
        return pairs[key][1]

    hold = {
        "float32": lambda a: on_huge_pages(pair(a)[1]),
        "fp8": lambda a: on_huge_pages(pair(a)[0]),
    }
    routes = record_routes(ckpt, rows)
    return compare(dict.fromkeys(HELD, call), load_config(ckpt), routes, passes, hold)


def engine(ckpt: Path, held: str):
    """(runner, first tokens of 16 conversations) with the routed experts held as `held`."""
    runner, first = engine_under(ckpt, {"COLIBRI_FP8": "0" if held == "float32" else "1"})
    assert (runner.model.store.held == FP8_ROWS) == (held == "fp8")
    return runner, first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--level", default="kernel,engine")
    ap.add_argument("--passes", type=int, default=0, help="default: 14 (kernel), 2 (engine)")
    args = ap.parse_args()
    if not kernels.available():
        sys.exit("colibri CPU kernels unavailable (see the log)")
    levels = args.level.split(",")
    out, raw = [], {}
    for name in args.shapes.split(","):
        cfg = load_config(ensure_inputs(name, SHAPES[name], with_llama=False)["colibri"])
        layer_experts = cfg.moe.num_experts * len(cfg.moe_layer_ids)
        held_bytes = {
            "float32": 4 * sum(r * c for r, c in expert_shapes(cfg, np.float32).values()),
            "fp8": sum(r * c for r, c in expert_shapes(cfg, FP8_ROWS, BLOCK).values()),
        }
        for level in levels:
            passes = args.passes or {"kernel": 14, "engine": 2}[level]
            if level == "engine":
                ckpt = shape_checkpoint(name, "fp8", fp8_block=BLOCK)
                engines = {h: engine(ckpt, h) for h in HELD}
                assert engines["fp8"][0].model.store.expert_bytes == held_bytes["fp8"]
            else:
                ckpt = ensure_inputs(name, SHAPES[name], with_llama=False)["colibri"]
            for rows in (1, 16):
                if level == "kernel":
                    got = kernel_level(ckpt, rows, passes)["ms"]
                else:
                    got = engine_level(engines, rows, passes)
                raw[f"{name}/{level}/{rows}"] = got
                gib = {h: held_bytes[h] * layer_experts / 2**30 for h in HELD}
                out += held_rows(name, level, rows, got, gib, "experts held as")
                print(pd.DataFrame(out[-2:]).to_string(index=False), flush=True)
            if level == "engine":
                del engines
    cmd = f"python experiments/bench_fp8.py --shapes {args.shapes} --level {','.join(levels)}" + (
        f" --passes {args.passes}" if args.passes else ""
    )
    md = [
        "# FP8 experts held as FP8 rows or dequantized to float32, side by side",
        "",
        f"Command: `{cmd}`  ",
        f"Blocks of {BLOCK} x {BLOCK}. kernel: ms a step of the expert calls (24 greedy steps' "
        "routes, every layer), the versions taking turns step by step; outputs bitwise equal. "
        f"engine: decode tok/s on the FP8 checkpoint, bursts of {BURST} steps taking turns, "
        f"{BURSTS} per pass and row count; same tokens.",
        "",
        markdown_table(pd.DataFrame(out), floatfmt=".3f", index=False),
    ]
    write_report(RESULTS, "fp8", md, {"table": out, "runs": raw})


if __name__ == "__main__":
    main()
