"""python experiments/bench_bf16.py [--shapes qwen3_moe,olmoe] [--level kernel,engine] [--passes N]

What holding a bfloat16 checkpoint's weights as bfloat16 buys (colibri.weights.holds_bf16:
their bit patterns, widened exactly as the CPU kernels load them) against the same weights
widened to float32 at load (COLIBRI_BF16=0), side by side in one process, on the peers
benchmark's shapes (experiments/bench_peers.py) in bfloat16; and what bfloat16 products buy
on top (COLIBRI_BF16=products: inputs rounded to bfloat16, AVX-512 BF16's VDPBF16PS where the
CPU has it), whose results differ from float32's by design.

--level kernel: the expert calls alone, on the routes the peers checkpoints choose at 1 and 16
rows (as experiments/bench_kernel_revs.py replays them): random weights rounded to bfloat16,
held once as their bits and once as the float32s they stand for, both on huge pages as the
engine holds them, and as bits for bfloat16 products; they take turns step by step, --passes
times (default 14) over 24 steps. Outputs must agree bitwise, bfloat16 products' aside.
--level engine: the bfloat16 checkpoint (made here, cached under .cache/bench-peers) loaded
three times: COLIBRI_BF16=0 (routed experts and dense matrices alike), 1 and products; the
engines decode bursts in turn, 1 and then 16 conversations at a time, --passes (default 2) x
24 bursts each; tokens must agree, bfloat16 products' aside (they take their own routes).

Reported: ms a step (kernel) or tok/s (engine) of each, median over passes (bursts), the median
over pairs of bfloat16 / float32 time, and the routed experts' bytes. Writes
experiments/results/bf16.md and .json.

--level peers (needs the `bench` extra's llama-cpp-python, as experiments/bench_peers.py): the
same bfloat16 checkpoint against llama.cpp on its bf16 GGUF export (matrices bit for bit, norms
and routers f32), colibri with float32 and with bfloat16 products, each in a process of its own
as bench_peers runs them, --rounds (default 3) alternating rounds, batch 1, 64 tokens after a
128-token prompt, and 16 conversations decoding together; best of rounds. Writes
experiments/results/bf16_peers.md and .json (--out NAME: NAME.md and .json).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from colibri import kernels
from colibri.bench.conversations import BURST
from colibri.bench.kernel_calls import expert_call
from colibri.bench.levels import BURSTS, engine_level, engine_under, held_rows
from colibri.bench.replay import compare, on_huge_pages, record_routes
from colibri.bench.shapes import CACHE, SHAPES, ensure_inputs, shape_checkpoint
from colibri.bench.sidebyside import side_by_side
from colibri.checkpoint import to_f32
from colibri.config import load_config
from colibri.engine.hwinfo import cpu_detail
from colibri.formats import BF16P, Holding
from colibri.report import markdown_table, write_report

HERE = Path(__file__).parent
RESULTS = HERE / "results"
HELD = ("float32", "bfloat16", "bf16 products")
EXACT = HELD[:2]  # the ways of holding that give float32's results


def bf16_bits(a) -> np.ndarray:
    """a rounded to bfloat16 (to nearest even), as bit patterns."""
    bits = np.asarray(a, np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def kernel_level(ckpt: Path, rows: int, passes: int) -> dict:
    call = expert_call(kernels.build(), "colibri_moe_experts_held")
    hold = {
        "float32": lambda a: on_huge_pages(to_f32(bf16_bits(a), "BF16")),
        "bfloat16": lambda a: on_huge_pages(bf16_bits(a)),
        "bf16 products": lambda a: on_huge_pages(bf16_bits(a).view(BF16P.storage)),
    }
    routes = record_routes(ckpt, rows)
    calls = dict.fromkeys(HELD, call)
    return compare(calls, load_config(ckpt), routes, passes, hold, exact=EXACT)


def bf16_checkpoint(name: str) -> Path:
    return shape_checkpoint(name, "bf16")


def engine(ckpt: Path, held: str):
    """(runner, first tokens of 16 conversations) with the weights held as `held`."""
    holding = Holding(bf16=held != "float32", bf16_products=held == "bf16 products")
    runner, first = engine_under(ckpt, holding)
    model = runner.model
    assert model.store.held == model.params["lm_head"].dtype
    assert (model.store.held.itemsize == 2) == (held != "float32")
    return runner, first


def peers_level(name: str, rounds: int, tokens: int = 64) -> list[dict]:
    """colibri and llama.cpp on the bf16 checkpoint, batch 1, in alternating rounds."""
    from colibri.gguf import export_gguf

    ckpt = bf16_checkpoint(name)
    gguf = CACHE / f"{name}-bf16.gguf"
    if not gguf.exists():
        export_gguf(ckpt, gguf, dtype="bf16")
    paths = {"colibri (bf16 held)": ckpt, "colibri (bf16 products)": ckpt, "llama.cpp bf16": gguf}
    envs = {"colibri (bf16 products)": {"COLIBRI_BF16": "products"}}
    return side_by_side(name, paths, rounds, tokens, envs)


def write_peers(args, rows: list[dict]) -> None:
    cmd = f"python experiments/bench_bf16.py --shapes {args.shapes} --level peers" + (
        f" --out {args.out}" if args.out else ""
    )
    md = [
        "# colibri and llama.cpp on the same bf16 checkpoint",
        "",
        f"Command: `{cmd} --rounds {args.rounds}`  ",
        "Batch-1 greedy decode of 64 tokens after a 128-token prompt, and the same with 16 "
        "conversations decoding together (colibri's 16 slots; llama.cpp's 16 sequences, one "
        "llama_decode a step), each engine in a process "
        "of its own, alternating rounds; best of rounds. colibri holds the bf16 weights as bf16 "
        "and computes in float32, or with COLIBRI_BF16=products rounds the inputs of its bf16 "
        "products to bf16; llama.cpp runs its bf16 GGUF export (norms and routers f32) "
        "with an f32 KV cache and rounds activations to bf16 for its bf16 products. "
        "Greedy tokens are compared with the first colibri row's. Roofline: the bytes of "
        "weights a batch-1 step reads as colibri holds them over the bandwidth probed just "
        "before each colibri round; beside it, the most of it the widening allows (the "
        "experts' rows from L2) and the kernels' streaming allows (every expert's rows "
        "streamed from memory through the expert kernel, with its GB/s), measured in the "
        "same round (colibri.bench.sidebyside).",
        "",
        markdown_table(pd.DataFrame(rows), floatfmt=".2f", index=False),
    ]
    write_report(RESULTS, args.out or "bf16_peers", md, {"command": cmd, "table": rows})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--level", default="kernel,engine")
    ap.add_argument("--passes", type=int, default=0, help="default: 14 (kernel), 2 (engine)")
    ap.add_argument("--rounds", type=int, default=3, help="--level peers")
    ap.add_argument("--out", default="", help="--level peers: results name (default bf16_peers)")
    args = ap.parse_args()
    if not kernels.available():
        sys.exit("colibri CPU kernels unavailable (see the log)")
    levels = args.level.split(",")
    if "peers" in levels:
        rows = [r for name in args.shapes.split(",") for r in peers_level(name, args.rounds)]
        print(pd.DataFrame(rows).to_string(index=False))
        write_peers(args, rows)
        levels.remove("peers")
        if not levels:
            return
    out, raw = [], {}
    for name in args.shapes.split(","):
        cfg = load_config(ensure_inputs(name)["colibri"])
        layer_experts = cfg.moe.num_experts * len(cfg.moe_layer_ids)
        for level in levels:
            passes = args.passes or {"kernel": 14, "engine": 2}[level]
            if level == "engine":
                ckpt = bf16_checkpoint(name)
                engines = {h: engine(ckpt, h) for h in HELD}
                mb = {h: engines[h][0].model.store.expert_bytes / 2**20 for h in HELD}
            else:
                ckpt = ensure_inputs(name)["colibri"]
                eb = 3 * cfg.moe.moe_ff * cfg.hidden
                mb = {h: (4 if h == "float32" else 2) * eb / 2**20 for h in HELD}
            for rows in (1, 16):
                if level == "kernel":
                    got = kernel_level(ckpt, rows, passes)["ms"]
                else:
                    got = engine_level(engines, rows, passes, exact=EXACT)
                raw[f"{name}/{level}/{rows}"] = got
                gib = {h: mb[h] * layer_experts / 1024 for h in HELD}
                out += held_rows(name, level, rows, got, gib, "weights held as")
                print(pd.DataFrame(out[-len(HELD) :]).to_string(index=False), flush=True)
            if level == "engine":
                del engines
    cmd = f"python experiments/bench_bf16.py --shapes {args.shapes} --level {','.join(levels)}" + (
        f" --passes {args.passes}" if args.passes else ""
    )
    md = [
        "# bfloat16 weights held as bfloat16 or widened to float32, side by side",
        "",
        f"Command: `{cmd}`  ",
        "kernel: ms a step of the expert calls (24 greedy steps' routes, every layer), the "
        "versions taking turns step by step; outputs bitwise equal. engine: decode tok/s on the "
        f"bfloat16 checkpoint, bursts of {BURST} steps taking turns, {BURSTS} per pass and row "
        "count; same tokens. bf16 products (COLIBRI_BF16=products) round the inputs of their "
        "products to bfloat16: other outputs, and in the engine other tokens and routes. "
        f"CPU: {cpu_detail()}.",
        "",
        markdown_table(pd.DataFrame(out), floatfmt=".3f", index=False),
    ]
    write_report(RESULTS, "bf16", md, {"table": out, "runs": raw})


if __name__ == "__main__":
    main()
