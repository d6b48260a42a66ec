"""python experiments/bench_helpers.py [--shapes qwen3_moe,olmoe] [--rows 1,4,16] [--bursts 24]
    [--prompt 512] [--prefills 6] [--out NAME]

The kernels' calls sharing their work with helper threads of their own (awake for a moment
after each call: colibri/kernels/cpu/gang.h, Crew) against XLA's intra-op pool alone (threads
asleep between calls, woken by each call: `kernels.own_helpers(False)`), side by side in one
process on one engine, on the peers checkpoints (experiments/bench_peers.py, made there or here
if missing). A machine whose speed moves by a quarter within minutes cannot tell a few percent
apart in separate runs; in turns it can.

Decode: 16 conversations in the cache (one prompt of 128 tokens, the last 8 changed in each),
--rows of them decoding bursts of greedy steps as the engine takes them, the two ways taking
turns burst by burst at the same positions (which goes first flips every burst; the tokens
must agree), --bursts pairs per row count. Prefill: a --prompt-token prompt into a slot of its
own, the two ways in turn, --prefills pairs. Before each timed burst or prefill the process
rests 10 ms, so that the helpers of the way before have gone to sleep.

Reported: the median tok/s of each way and the median over pairs of own / pool time. Writes
experiments/results/helpers.md and .json (--out NAME: NAME.md and .json).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from colibri import kernels
from colibri.bench.conversations import BURST, other_conversations, prompt_ids
from colibri.bench.shapes import SHAPES, ensure_inputs
from colibri.engine.model import load_model
from colibri.engine.runner import Row, Runner
from colibri.report import markdown_table, write_report

HERE = Path(__file__).parent
RESULTS = HERE / "results"
PROMPT = 128
WAYS = {"own helpers": True, "pool only": False}


def timed(way: str, run) -> tuple[float, object]:
    """Seconds `run()` takes with the kernels' helpers as `way` says, after a rest."""
    kernels.own_helpers(WAYS[way])
    time.sleep(0.01)
    t = time.perf_counter()
    out = run()
    return time.perf_counter() - t, out


def decode(runner: Runner, first: list[int], rows: int, bursts: int) -> dict[str, list[float]]:
    secs = {w: [] for w in WAYS}
    for i in range(bursts + 1):  # the first compiles and warms up
        at = PROMPT + i * BURST
        at_rows = [Row(s, first[s], at) for s in range(rows)]

        def burst(at_rows=at_rows):
            return runner.decode_async(at_rows, steps=BURST).tokens().tolist()

        toks = {}
        for w in list(WAYS) if i % 2 == 0 else list(WAYS)[::-1]:
            dt, toks[w] = timed(w, burst)
            if i:
                secs[w].append(dt)
        assert toks["own helpers"] == toks["pool only"], "the two ways decoded different tokens"
        first = toks["own helpers"][-1] + first[rows:]
    return secs


def prefill(runner: Runner, tokens: list[int], passes: int) -> dict[str, list[float]]:
    secs = {w: [] for w in WAYS}
    slot = runner.slots - 1
    for i in range(passes + 1):
        for w in list(WAYS) if i % 2 == 0 else list(WAYS)[::-1]:
            dt, _ = timed(w, lambda: runner.prefill(slot, tokens))
            if i:
                secs[w].append(dt)
    return secs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--bursts", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--prefills", type=int, default=6)
    ap.add_argument("--out", default="helpers")
    args = ap.parse_args()
    if not kernels.available():
        sys.exit("colibri CPU kernels unavailable (see the log)")
    rows_list = [int(r) for r in args.rows.split(",")]
    table, raw = [], {}
    for name in args.shapes.split(","):
        model = load_model(ensure_inputs(name)["colibri"], progress=False)
        capacity = max(PROMPT + (args.bursts + 1) * BURST, args.prompt) + 8
        runner = Runner(model, slots=17, capacity=capacity)
        prompt = prompt_ids(model.cfg.vocab_size, PROMPT)
        logits, _ = runner.prefill(0, prompt)
        first = [int(np.argmax(logits)), *other_conversations(runner, prompt, 16)]
        runs = {f"{r} rows": (decode(runner, first, r, args.bursts), r * BURST) for r in rows_list}
        long = prompt_ids(model.cfg.vocab_size, args.prompt)
        runs["prefill"] = (prefill(runner, long, args.prefills), args.prompt)
        for what, (secs, tokens) in runs.items():
            raw[f"{name}/{what}"] = secs
            own, pool = (np.asarray(secs[w]) for w in WAYS)
            table.append(
                {
                    "model": name,
                    "measure": what,
                    "own helpers tok/s (median)": tokens / float(np.median(own)),
                    "pool only tok/s (median)": tokens / float(np.median(pool)),
                    "own / pool time (median of pairs)": float(np.median(own / pool)),
                }
            )
            print(pd.DataFrame(table[-1:]).to_string(index=False), flush=True)
        kernels.own_helpers(True)
        del runner, model
    cmd = (
        f"python experiments/bench_helpers.py --shapes {args.shapes} --rows {args.rows} "
        f"--bursts {args.bursts} --prompt {args.prompt} --prefills {args.prefills}"
        + (f" --out {args.out}" if args.out != "helpers" else "")
    )
    md = [
        "# The kernels' own helpers against XLA's pool alone, in turns",
        "",
        f"Command: `{cmd}`  ",
        f"Decode: bursts of {BURST} greedy steps of the rows at once, the two ways in turn at "
        f"the same positions ({args.bursts} pairs a row count; same tokens); prefill: "
        f"{args.prompt} tokens into a slot, {args.prefills} pairs.",
        "",
        markdown_table(pd.DataFrame(table), floatfmt=".3f", index=False),
    ]
    write_report(RESULTS, args.out, md, {"table": table, "runs": raw})


if __name__ == "__main__":
    main()
