"""python experiments/bench_quantized.py [--format fp8|int4|int4g32|awq4|int8]
                                     [--shapes qwen3_moe,olmoe]
                                     [--level kernel,engine] [--passes N] [--rounds N]

What holding a quantized checkpoint's routed experts in their quantized form buys against the
same experts dequantized to float32 at load, side by side in one process, on the peers
benchmark's shapes (experiments/bench_peers.py):
- --format fp8: block-quantized FP8 (DeepSeek-V3's layout, blocks of 128 x 128), held as FP8
  rows (colibri.weights.expert_dtype: each row's float8_e4m3fn values and its float32 block
  scales), against COLIBRI_FP8=0;
- --format int4: pack-quantized int4 (compressed-tensors' W4A16, a bfloat16 scale per 128
  columns), held as int4 rows (each row's four-bit values two a byte and its float32 group
  scales), against COLIBRI_INT4=0;
- --format int4g32: the same in groups of 32 columns (Kimi K2's int4 experts);
- --format awq4: AutoAWQ's int4 with zero points (a float16 scale and a zero point per 128
  columns), held as int4 rows with zero points (values eight a word, then the group scales
  and offsets), against COLIBRI_INT4=0;
- --format int8: pack-quantized int8 (compressed-tensors' W8A16, a bfloat16 scale per 128
  columns), held as int8 rows (values four a word, then the group scales and offsets),
  against COLIBRI_INT8=0.
The CPU kernel widens and scales the quantized rows exactly as it loads them.

--level kernel: the expert calls alone, on the routes the peers checkpoints choose at 1 and 16
rows (as experiments/bench_kernel_revs.py replays them): random weights quantized, held once in
the quantized form and once as the float32s they dequantize to, both on huge pages as the
engine holds them; the two take turns step by step, --passes times (default 14) over 24 steps.
Outputs must agree bitwise.
--level engine: the quantized checkpoint (made here, cached under .cache/bench-peers) loaded
twice, once dequantized at load; the two engines decode bursts in turn, 1 and then 16
conversations at a time, --passes (default 2) x 24 bursts each; tokens must agree.

Reported: ms a step (kernel) or tok/s (engine) of each, median over passes (bursts), the median
over pairs of quantized / float32 time, and the routed experts' bytes as held. Writes
experiments/results/fp8.md (int4.md, awq4.md, int8.md) and .json (--out NAME: NAME.md and .json).

--level peers (--format int8 or int4; needs the `bench` extra's llama-cpp-python, as
experiments/bench_peers.py): colibri on the int8 (int4) checkpoint against llama.cpp on its own
format of as many bits, q8_0 (q4_0: blocks of 32 with a float16 scale; norms and routers stay
f32), of the float32 checkpoint the peers benchmark runs: two quantizations of one model, so
their greedy tokens need not agree. Each in a process of its own, --rounds (default 3)
alternating rounds, batch 1, 64 tokens after a 128-token prompt, and 16 conversations decoding
together; best of rounds (colibri.bench.sidebyside, as experiments/bench_bf16.py's peers
level), and colibri's rate
against the roofline of the bytes it holds, each round against a bandwidth probe run just
before it, beside the most of that roofline the widening of its rows allows (the chosen
experts' bytes at the rate the cores put them through the kernels' one-row tiles from L2,
measured in the same round, the rest at the probe's rate) and the most the
kernels allow while they stream (the chosen experts' bytes at the rate the expert kernel
streams every expert's rows from memory on both cores, the rest at the probe's rate). Writes
experiments/results/int8_peers.md (int4_peers.md) and .json (--out NAME: NAME.md and .json;
NAME_peers where other levels run too).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from colibri import kernels
from colibri.bench.conversations import BURST
from colibri.bench.formats import FORMATS
from colibri.bench.kernel_calls import expert_call
from colibri.bench.levels import BURSTS, engine_level, engine_under, held_rows
from colibri.bench.replay import compare, on_huge_pages, record_routes
from colibri.bench.shapes import CACHE, SHAPES, ensure_inputs, shape_checkpoint
from colibri.bench.sidebyside import side_by_side
from colibri.config import load_config
from colibri.engine.hwinfo import cpu_detail
from colibri.formats import HOLD_ALL, Holding
from colibri.report import markdown_table, write_report
from colibri.weights import expert_shapes

HERE = Path(__file__).parent
RESULTS = HERE / "results"


def kernel_level(ckpt: Path, fmt: str, rows: int, passes: int) -> dict:
    call = expert_call(kernels.build(), "colibri_moe_experts_held")
    pairs: dict[int, tuple] = {}
    quantize = FORMATS[fmt]["pair"]

    def pair(a):  # both versions hold the same quantization of each random matrix
        key = id(a)
        if key not in pairs:
            pairs[key] = (a, quantize(a))
        return pairs[key][1]

    hold = {
        "float32": lambda a: on_huge_pages(pair(a)[1]),
        fmt: lambda a: on_huge_pages(pair(a)[0]),
    }
    routes = record_routes(ckpt, rows)
    return compare(dict.fromkeys(hold, call), load_config(ckpt), routes, passes, hold)


def engine(ckpt: Path, fmt: str, holding: Holding):
    """(runner, first tokens of 16 conversations) with the matrices held as `holding` allows
    (the format's `off` dequantizes at load)."""
    f = FORMATS[fmt]
    runner, first = engine_under(ckpt, holding)
    assert (runner.model.store.held == f["held"]) == (holding != f["off"])
    return runner, first


def peers_level(name: str, fmt: str, rounds: int) -> list[dict]:
    """colibri on the `fmt` checkpoint and llama.cpp on its own format of as many bits (made
    from the float32 checkpoint), batch 1, in alternating rounds."""
    from colibri.gguf import export_gguf

    f, kind = FORMATS[fmt], FORMATS[fmt]["llama"]
    ckpt = shape_checkpoint(name, fmt, **f["synth"])
    gguf = CACHE / f"{name}-{kind}.gguf"  # as bench_peers names its exports
    if not gguf.exists():
        export_gguf(ensure_inputs(name)["colibri"], gguf, kind)
    return side_by_side(name, {f"colibri ({fmt} held)": ckpt, f"llama.cpp {kind}": gguf}, rounds)


def write_peers(args, rows: list[dict]) -> None:
    fmt, kind = args.format, FORMATS[args.format]["llama"]
    cmd = (
        f"python experiments/bench_quantized.py --format {fmt} --shapes {args.shapes} "
        f"--level peers --rounds {args.rounds}" + (f" --out {args.out}" if args.out else "")
    )
    md = [
        f"# colibri on the {fmt} checkpoint and llama.cpp on {kind} of the same model",
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {cpu_detail()}  ",
        f"{FORMATS[fmt]['note']} colibri holds the routed experts and the attention as {fmt} "
        "rows (embeddings, routers and lm_head stay bfloat16) and computes in float32; "
        f"llama.cpp runs the float32 checkpoint's {kind} GGUF export (norms and routers f32) "
        "with an f32 KV cache. Batch-1 greedy decode of 64 tokens after a 128-token prompt "
        "(and 16 conversations decoding together: colibri's 16 slots, llama.cpp's 16 "
        "sequences, one llama_decode a step), "
        "each engine in a process of its own, alternating rounds; best of rounds. Two "
        "quantizations of one model: their greedy tokens need not agree. Roofline: the bytes "
        "of weights a batch-1 step reads as colibri holds them (MB a step: the dense arrays, "
        "one embedding row, the chosen experts' rows with their scales) over the bandwidth "
        "probed in a process of its own just before each colibri round; colibri's rate "
        "against it, round by round. The most the widening allows: the roofline's time over "
        "the chosen experts' bytes at the rate at which the cores put their rows through the "
        "kernels' one-row tiles with them in L2 (each core on its own, the calls' own costs "
        "aside), plus the rest of the step's bytes at the probe's rate (measured in each "
        "colibri round; at most 1): the share of the roofline a step could reach were the "
        "experts' streaming hidden entirely behind that arithmetic. The most the kernels' "
        "streaming allows: the roofline's time over the chosen experts' bytes at the rate the "
        "expert kernel streams every expert's rows from memory on both cores at one row "
        "(measured in the same colibri run) plus the rest of the step's bytes at the probe's "
        "rate.",
        "",
        markdown_table(pd.DataFrame(rows), floatfmt=".2f", index=False),
    ]
    write_report(RESULTS, peers_name(args), md, {"command": cmd, "table": rows})


def peers_name(args) -> str:
    """The peers level's results name: --out, NAME_peers where other levels run too."""
    if not args.out:
        return f"{args.format}_peers"
    return args.out if args.level == "peers" else f"{args.out}_peers"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", choices=tuple(FORMATS), default="fp8")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--level", default="kernel,engine")
    ap.add_argument("--passes", type=int, default=0, help="default: 14 (kernel), 2 (engine)")
    ap.add_argument("--rounds", type=int, default=3, help="--level peers")
    ap.add_argument(
        "--out",
        default="",
        help="results name (default FORMAT_peers for --level peers, FORMAT for the others); "
        "with peers and another level, NAME_peers and NAME",
    )
    args = ap.parse_args()
    if not kernels.available():
        sys.exit("colibri CPU kernels unavailable (see the log)")
    levels, fmt = args.level.split(","), args.format
    f = FORMATS[fmt]
    if "peers" in levels:
        if "llama" not in f:
            sys.exit(f"--level peers: no llama.cpp format beside {fmt} (int8: q8_0, int4: q4_0)")
        rows = [r for name in args.shapes.split(",") for r in peers_level(name, fmt, args.rounds)]
        print(pd.DataFrame(rows).to_string(index=False))
        write_peers(args, rows)
        levels.remove("peers")
        if not levels:
            return
    out, raw = [], {}
    for name in args.shapes.split(","):
        cfg = load_config(ensure_inputs(name)["colibri"])
        layer_experts = cfg.moe.num_experts * len(cfg.moe_layer_ids)
        shapes = expert_shapes(cfg, f["held"], f["blocks"]).values()
        quantized = sum(r * c for r, c in shapes) * np.dtype(f["held"]).itemsize
        held_bytes = {
            "float32": 4 * sum(r * c for r, c in expert_shapes(cfg, np.float32).values()),
            fmt: quantized,
            **dict.fromkeys(f.get("modes", {}), quantized),
        }
        for level in levels:
            passes = args.passes or {"kernel": 14, "engine": 2}[level]
            if level == "engine":
                ckpt = shape_checkpoint(name, fmt, **f["synth"])
                switches = {"float32": f["off"], fmt: HOLD_ALL, **f.get("modes", {})}
                engines = {h: engine(ckpt, fmt, v) for h, v in switches.items()}
                assert engines[fmt][0].model.store.expert_bytes == held_bytes[fmt]
            else:
                ckpt = ensure_inputs(name)["colibri"]
            for rows in (1, 16):
                if level == "kernel":
                    got = kernel_level(ckpt, fmt, rows, passes)["ms"]
                else:
                    got = engine_level(engines, rows, passes)
                raw[f"{name}/{level}/{rows}"] = got
                gib = {h: held_bytes[h] * layer_experts / 2**30 for h in got}
                out += held_rows(name, level, rows, got, gib, "experts held as")
                print(pd.DataFrame(out[-len(got) :]).to_string(index=False), flush=True)
            if level == "engine":
                del engines
    cmd = (
        f"python experiments/bench_quantized.py --format {fmt} --shapes {args.shapes} "
        f"--level {','.join(levels)}"
        + (f" --passes {args.passes}" if args.passes else "")
        + (f" --out {args.out}" if args.out else "")
    )
    md = [
        f"# {f['title']}, side by side",
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {cpu_detail()}  ",
        f"{f['note']} kernel: ms a step of the expert calls (24 greedy steps' "
        "routes, every layer), the versions taking turns step by step; outputs bitwise equal. "
        f"engine: decode tok/s on the {fmt} checkpoint, bursts of {BURST} steps taking turns, "
        f"{BURSTS} per pass and row count; same tokens.",
        "",
        markdown_table(pd.DataFrame(out), floatfmt=".3f", index=False),
    ]
    write_report(RESULTS, args.out or fmt, md, {"command": cmd, "table": out, "runs": raw})


if __name__ == "__main__":
    main()
