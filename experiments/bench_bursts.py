"""python experiments/bench_bursts.py [--shapes qwen3_moe,olmoe] [--dtypes f32,int8]
[--bursts 6,24,48] [--rows 1,16] [--rounds 6] [--tokens 192]

Decode bursts of different lengths side by side in one process. Each checkpoint is loaded
once and its greedy conversations (one, or 16 sharing a prompt but its last 8 tokens) are
decoded as the engine decodes greedy requests (cuttable bursts, the next dispatched when one
lands: anatomy.decode_bursts), in bursts of each length in turn: stretches of steps (the
lengths' least common multiple) decoded in each length over the same positions, one after
another, --rounds times over the tokens. Every length must give the same
tokens and routes. Between two bursts the host lands one and dispatches the next, and
a burst that streamed the weights leaves every cache cold for that dispatch: a cost a burst,
which longer bursts share among more steps. A machine whose memory changes speed minute by
minute cannot tell a few percent apart in separate runs; taking turns it can.

Reported: tok/s of each length (median over stretches) and the median over stretches of its
tok/s over that of the first length. Writes experiments/results/bursts.md and .json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm import tqdm

from colibri.bench import anatomy
from colibri.bench.conversations import BURST, other_conversations, prompt_ids
from colibri.bench.shapes import SHAPES, held_checkpoint
from colibri.engine.hwinfo import cpu_detail, host
from colibri.report import markdown_table, write_report

HERE = Path(__file__).parent
RESULTS = HERE / "results"
PROMPT = 128


def side_by_side(ckpt: Path, rows: list[int], bursts: list[int], rounds: int, tokens: int):
    """{rows: {burst: [tok/s a stretch]}} of one checkpoint: the decode cut into stretches of
    the lengths' least common multiple of steps, each decoded in bursts of every length in
    turn over the same positions (the same tokens: the same keys and values written), the
    order alternating."""
    from colibri.engine.model import load_model
    from colibri.engine.runner import Runner

    model = load_model(ckpt, progress=False)
    runner = Runner(model, slots=16, capacity=PROMPT + tokens + 8)
    prompt = prompt_ids(model.cfg.vocab_size, PROMPT)
    logits, _ = runner.prefill(0, prompt)
    firsts = [int(np.argmax(logits)), *other_conversations(runner, prompt, max(rows))]
    chunk = int(np.lcm.reduce(bursts))
    out = {}
    for n in rows:
        routes, greedy = {}, {}
        for b in bursts:  # compiles each length's program, and every length must agree
            routes[b], greedy[b] = [], []
            anatomy.decode_bursts(runner, firsts[:n], PROMPT, tokens, b, routes[b], greedy[b])
            same = zip(routes[b], routes[bursts[0]], strict=True)
            if greedy[b] != greedy[bursts[0]] or not all(np.array_equal(*r) for r in same):
                raise SystemExit(f"bursts of {b} steps decode differently from {bursts[0]}")
        fed = [firsts[:n], *greedy[bursts[0]]]  # the tokens fed at each step
        rates = {b: [] for b in bursts}
        for r in tqdm(range(rounds), desc=f"{ckpt.name}, {n} row(s)", leave=False):
            for at in range(0, tokens - chunk + 1, chunk):
                for b in bursts if (r + at // chunk) % 2 == 0 else bursts[::-1]:
                    rate = anatomy.decode_bursts(runner, fed[at], PROMPT + at, chunk, b)
                    rates[b].append(rate)
        out[n] = rates
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--dtypes", default="f32,int8")
    ap.add_argument("--bursts", default=f"6,24,{BURST}")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=192)
    args = ap.parse_args()
    bursts = sorted({int(b) for b in args.bursts.split(",")})
    rows = [int(n) for n in args.rows.split(",")]
    table, raw = [], {}
    for name in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            ckpt = held_checkpoint(name, dtype)
            got = side_by_side(ckpt, rows, bursts, args.rounds, args.tokens)
            for n, rates in got.items():
                raw[f"{name}/{dtype}/{n}"] = rates
                base = np.asarray(rates[bursts[0]])
                for b in bursts:
                    tok_s = np.asarray(rates[b])
                    table.append(
                        {
                            "model": name,
                            "weights": dtype,
                            "rows": n,
                            "burst": b,
                            "tok/s (median)": float(np.median(tok_s)),
                            f"/ {bursts[0]} steps (median of stretches)": float(
                                np.median(tok_s / base)
                            ),
                        }
                    )
                print(pd.DataFrame(table[-len(bursts) :]).to_string(index=False), flush=True)
    cmd = (
        f"python experiments/bench_bursts.py --shapes {args.shapes} --dtypes {args.dtypes} "
        f"--bursts {args.bursts} --rows {args.rows} --rounds {args.rounds} --tokens {args.tokens}"
    )
    md = [
        "# Decode bursts of different lengths, side by side",
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {host().cores} cores, {cpu_detail()}, {host().ram_total_gb:.0f} GB RAM  ",
        f"Greedy decode of {args.tokens} tokens after a {PROMPT}-token prompt, in cuttable "
        f"bursts; stretches of {int(np.lcm.reduce(bursts))} steps decoded in bursts of each "
        f"length in turn over the same positions, {args.rounds} rounds; every length gives "
        f"the same tokens and routes. The engine's default: `BURST={BURST}`.",
        "",
        markdown_table(pd.DataFrame(table), floatfmt=".3f", index=False),
    ]
    write_report(RESULTS, "bursts", md, {"table": table, "runs": raw})


if __name__ == "__main__":
    main()
