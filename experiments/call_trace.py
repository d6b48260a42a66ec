"""python experiments/call_trace.py [--shapes qwen3_moe,olmoe] [--ckpt PATH ...] [--rows 1]
    [--tokens 64] [--prompt 128] [--rounds 2] [--out call_trace]

How each kernel call of a decode step shares its work among the cores: when its helper joined
it and how far apart its threads finished. The kernels are built to time every call
(COLIBRI_KERNEL_TRACE=1: cpu/gang.h's CallRecord, kernels.take_traced_calls; the same results).
Each round, on the peers benchmark's f32 checkpoints (or --ckpt): a plain read of 1 GiB on
every core, --tokens greedy steps of --rows conversations in the engine's bursts (as
experiments/step_anatomy.py decodes them), the calls they made, and the read again. Per kind of
call (the routed experts, attention, each linear layer by its weights): calls a step, µs a
call, how long the caller took to schedule its helper and how late the helper began its share
after the call began (µs; calls too small to share run on the caller alone), how far apart the
caller and the helper ended, and the share of the call both threads were at work. Medians over
the round's calls, with their 90th percentiles where a few calls differ; at up to four rows,
the GB/s at which each weight call streams its weights (as float32), against the faster read. A
thread that ends early leaves the other streaming alone, at what one core can read.

Writes experiments/results/call_trace.md and .json (--out NAME: NAME.md, NAME.json).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm import tqdm

from colibri.bench import anatomy
from colibri.bench.bandwidth import probe_array, read_rate
from colibri.bench.conversations import BURST, STREAM_MS
from colibri.engine.hwinfo import cpu_detail, host
from colibri.report import markdown_table, write_report

HERE = Path(__file__).parent
RESULTS = HERE / "results"


def linear_names(params, rows: int) -> dict[int, str]:
    """{work: "linear [O, I]"} for every matrix of the checkpoint's dense weights, as the linear
    kernel counts a call's work (O x I float32 bytes, a pass for every four rows); matrices of
    the same work named together ("linear [64, 96] or [96, 64]")."""
    import jax

    passes = (rows + 3) // 4
    shapes: dict[int, list[str]] = {}
    for leaf in jax.tree_util.tree_leaves(params):
        if getattr(leaf, "ndim", 0) == 2:
            o, i = leaf.shape
            named = shapes.setdefault(o * i * 4 * passes, [])
            if f"[{o}, {i}]" not in named:
                named.append(f"[{o}, {i}]")
    return {work: "linear " + " or ".join(sorted(n)) for work, n in shapes.items()}


def parts(
    calls: np.ndarray, names: dict[int, str], steps: int, rows: int, read: float
) -> pd.DataFrame:
    """Per kind of call (TRACE_KINDS; linear calls by their weights, `names`, else their work),
    the calls a step and, in µs, the median call, the helper's lateness, the threads' end gap
    and the share of the call both threads worked (medians; p90 beside the two gaps); for the
    weight calls of up to four rows (one pass over the weights), the GB/s their weights as
    float32 stream at over all their calls, and that against `read`."""
    from colibri import kernels

    kind = [kernels.TRACE_KINDS.get(int(k), f"kind {k}") for k in calls["kind"]]
    label = [
        (names.get(int(w), f"linear ({w / 1e6:.2f} MB)") if k == "linear" else k)
        for k, w in zip(kind, calls["work"], strict=True)
    ]
    us = lambda a: a / 1e3  # noqa: E731 (ns to µs)
    shared = calls["helper_start"] > 0
    late = np.where(shared, us(calls["helper_start"] - calls["enter"]), np.nan)
    scheduling = us(calls["caller_start"] - calls["enter"])
    gap = np.where(shared, us(np.abs(calls["caller_end"] - calls["helper_end"])), np.nan)
    total = us(calls["done"] - calls["enter"])
    both = np.minimum(calls["caller_end"], calls["helper_end"]) - calls["helper_start"]
    both_share = np.where(shared, us(both) / np.maximum(total, 1e-9), np.nan)
    df = pd.DataFrame(
        {
            "part": label,
            "us": total,
            "shared": shared,
            "scheduling": scheduling,
            "late": late,
            "gap": gap,
            "both": both_share,
        }
    )
    df["work"] = calls["work"]
    weights = {"routed experts", "linear", "per-head products"}
    df["weights"] = [k in weights and rows <= 4 for k in kind]
    out = []
    for part, g in df.groupby("part", sort=False):
        s = g[g.shared]
        gb_s = g.work.sum() / g.us.sum() / 1e3 if g.weights.all() else np.nan
        out.append(
            {
                "part": part,
                "calls a step": len(g) / steps,
                "µs a call": g.us.median(),
                "µs a step": g.us.sum() / steps,
                "shared": len(s) / len(g),
                "scheduling, µs": s.scheduling.median() if len(s) else np.nan,
                "helper late, µs": s.late.median() if len(s) else np.nan,
                "late p90": s.late.quantile(0.9) if len(s) else np.nan,
                "ends apart, µs": s.gap.median() if len(s) else np.nan,
                "apart p90": s.gap.quantile(0.9) if len(s) else np.nan,
                "both at work": s.both.median() if len(s) else np.nan,
                "GB/s": gb_s,
                "/ read": gb_s / read,
            }
        )
    return pd.DataFrame(out).sort_values("µs a step", ascending=False).set_index("part")


def measure(ckpt: Path, rows: int, tokens: int, prompt_len: int, rounds: int) -> dict:
    from colibri import kernels
    from colibri.engine.model import load_model

    model = load_model(ckpt, progress=False)
    runner, firsts = anatomy.conversations(model, rows, tokens, prompt_len)

    def decode() -> float:
        return anatomy.decode_bursts(runner, firsts, prompt_len, tokens, BURST, stream_ms=STREAM_MS)

    decode()  # compiles every program the rounds run
    names = linear_names(model.params, rows)
    probe = probe_array(1.0)
    out = []
    for r in tqdm(range(rounds), desc=ckpt.name, unit="round"):
        before = max(read_rate(probe) for _ in range(3))
        kernels.take_traced_calls()  # (the probes' and anything before: not this round's)
        rate = decode()
        calls = kernels.take_traced_calls()
        after = max(read_rate(probe) for _ in range(3))
        table = parts(calls, names, tokens, rows, max(before, after))
        out.append(
            {
                "round": r,
                "read_gb_s": [before, after],
                "tok_s": rate,
                "calls": len(calls),
                "parts": table.reset_index().to_dict(orient="records"),
            }
        )
    return {"rows": rows, "rounds": out}


def write(results: dict, args, stem: str) -> None:
    hw = host()
    lines = [
        "# How a decode step's kernel calls share their work among the cores",
        "",
        f"Command: `python experiments/call_trace.py {' '.join(args.argv)}`  ",
        f"Machine: {hw.cores} cores, {cpu_detail()}, {hw.ram_total_gb:.0f} GB RAM  ",
        f"Greedy decode of {args.tokens} tokens of {args.rows} conversation(s) after a "
        f"{args.prompt}-token prompt, in the engine's bursts, every kernel call timed (a build "
        "with COLIBRI_KERNEL_TRACE=1). Each round: a plain read of 1 GiB on every core, the "
        "steps, the read again.",
    ]
    for name, res in results.items():
        lines += ["", f"## {name}", ""]
        for rnd in res["rounds"]:
            before, after = rnd["read_gb_s"]
            lines += [
                f"Round {rnd['round']}: reads {before:.1f}, {after:.1f} GB/s; "
                f"{rnd['tok_s']:.1f} tok/s; {rnd['calls']} calls.",
                "",
                markdown_table(pd.DataFrame(rnd["parts"]).set_index("part")),
                "",
            ]
    lines += [
        "calls a step: over the round's steps; µs a call: the median, from the call's start to "
        "its return; shared: the calls a helper joined (the others, under ~512 KiB of work, run "
        "on the caller alone); scheduling: from the call's start to the caller's own first work "
        "(waking its helper); helper late: from the call's start to the helper's first work; "
        "ends apart: between the caller's and the helper's last work (the one that ends first "
        "waits, or leaves); both at work: the share of the call from the helper's start to the "
        "first of the two ends. Medians over the shared calls; p90: their 90th percentile. "
        "GB/s: the weight calls' weights as float32 over their time, all their calls together "
        "(up to four rows: one pass over the weights); / read: against the faster read of the "
        "round."
    ]
    write_report(RESULTS, stem, lines, results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    anatomy.decode_arguments(ap, rounds=2, out="call_trace")
    args = ap.parse_args()
    args.argv = sys.argv[1:]
    # Before the kernels load (on first use): the library that times its calls.
    os.environ["COLIBRI_KERNEL_TRACE"] = "1"
    ckpts = anatomy.checkpoints(args)
    results = {
        n: measure(c, args.rows, args.tokens, args.prompt, args.rounds) for n, c in ckpts.items()
    }
    write(results, args, args.out)


if __name__ == "__main__":
    main()
