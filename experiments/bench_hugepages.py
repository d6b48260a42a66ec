"""python experiments/bench_hugepages.py [--shapes qwen3_moe,olmoe] [--passes 2]

Decode with the weights and KV cache on 4 KiB pages against the same on 2 MiB pages
(colibri/hugepages.py), in one process: each peers checkpoint (experiments/bench_peers.py,
made there or here if missing) is loaded twice, once with COLIBRI_HUGE_PAGES=0, and the two
engines take turns burst by burst (which goes first flips every burst), 1 and then 16
conversations at a time, as bench_peers decodes them. A machine whose speed moves by a
quarter within minutes cannot tell a few percent apart in separate runs; side by side it can.
Reported: tok/s of each (median burst) and the median over pairs of bursts of huge / small
time. Both must produce the same tokens. Writes experiments/results/hugepages.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

HERE = Path(__file__).parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
from bench_peers import BURST, SHAPES, ensure_inputs, other_conversations, prompt_ids  # noqa: E402

from colibri.engine.model import load_model  # noqa: E402
from colibri.engine.runner import Row, Runner  # noqa: E402
from colibri.report import markdown_table  # noqa: E402

PROMPT = 128
BURSTS = 24  # per pass and rows


def engine(ckpt: Path, huge: bool):
    """(runner, first tokens of 16 conversations): one prompt, the last 8 tokens changed."""
    os.environ["COLIBRI_HUGE_PAGES"] = "1" if huge else "0"
    try:
        model = load_model(ckpt, progress=False)
        runner = Runner(model, slots=16, capacity=PROMPT + 2 * BURSTS * BURST + 8)
    finally:
        os.environ.pop("COLIBRI_HUGE_PAGES")
    prompt = prompt_ids(model.cfg.vocab_size, PROMPT)
    logits, _ = runner.prefill(0, prompt)
    return runner, [int(np.argmax(logits)), *other_conversations(runner, prompt, 16)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--passes", type=int, default=2)
    args = ap.parse_args()
    out, raw = [], {}
    for name in args.shapes.split(","):
        ckpt = ensure_inputs(name, SHAPES[name], with_llama=False)["colibri"]
        engines = {"4 KiB": engine(ckpt, False), "2 MiB": engine(ckpt, True)}
        for rows in (1, 16):
            secs = {k: [] for k in engines}
            tokens = {k: [] for k in engines}
            for p in range(args.passes + 1):  # the first pass compiles and warms up
                for i in range(BURSTS):
                    at = PROMPT + (p % 2) * BURSTS * BURST + i * BURST
                    for k in list(engines) if i % 2 == 0 else list(engines)[::-1]:
                        runner, first = engines[k]
                        t = time.perf_counter()
                        fwd = runner.decode_async(
                            [Row(s, first[s], at) for s in range(rows)], steps=BURST
                        )
                        toks = fwd.tokens()
                        if p:
                            secs[k].append(time.perf_counter() - t)
                            tokens[k].append(toks.tolist())
            if tokens["4 KiB"] != tokens["2 MiB"]:
                sys.exit(f"{name}, {rows} rows: the two engines' tokens differ")
            small, huge = (np.asarray(secs[k]) for k in engines)
            raw[f"{name}/{rows}"] = {k: v for k, v in secs.items()}
            for k, s in zip(engines, (small, huge), strict=True):
                out.append(
                    {
                        "model": name,
                        "rows": rows,
                        "pages": k,
                        "tok/s (median burst)": rows * BURST / float(np.median(s)),
                        "time / 4 KiB (median of pairs)": float(np.median(s / small)),
                    }
                )
            print(pd.DataFrame(out[-2:]).to_string(index=False), flush=True)
    cmd = f"python experiments/bench_hugepages.py --shapes {args.shapes} --passes {args.passes}"
    md = [
        "# Weights on 4 KiB and 2 MiB pages, side by side",
        "",
        f"Command: `{cmd}`  ",
        f"{args.passes} x {BURSTS} bursts of {BURST} greedy steps for each engine and row count, "
        "the two engines in turn; same tokens from both.",
        "",
        markdown_table(pd.DataFrame(out), floatfmt=".3f", index=False),
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hugepages.md").write_text("\n".join(md) + "\n")
    (RESULTS / "hugepages.json").write_text(json.dumps({"table": out, "seconds": raw}, indent=1))
    print(f"wrote {RESULTS / 'hugepages.md'}")


if __name__ == "__main__":
    main()
