"""python experiments/call_trace.py [--shapes qwen3_moe,olmoe] [--ckpt PATH ...] [--rows 1]
    [--tokens 64] [--prompt 128] [--rounds 2] [--out call_trace]

How each kernel call of a decode step shares its work among the cores: when its helper joined
it and how far apart its threads finished. The kernels are built to time every call
(COLIBRI_KERNEL_TRACE=1: cpu/gang.h's CallRecord, kernels.take_traced_calls; the same results).
Each round, on the peers benchmark's f32 checkpoints (or --ckpt): a plain read of 1 GiB on
every core, --tokens greedy steps of --rows conversations in the engine's bursts (as
experiments/step_anatomy.py decodes them), the calls they made, and the read again. Per kind of
call (the routed experts, attention, each linear layer by its weights): calls a step, µs a
call, how long the caller took to schedule its helper (or to hand the call to one that waited
for it) and how late the helper began its share after the call began (µs; calls too small to
share run on the caller alone), how far apart the caller and the helper ended, and the share of
the call both threads were at work. Medians over the round's calls, with their 90th percentiles
where a few calls differ; at up to four rows, the GB/s at which each expert and linear call
streams its weights as held (bfloat16 bits, int4 rows with their scales, ...), against the
faster read. A thread that ends early leaves the other streaming alone, at what one core can
read.

Above those, per round (many short rounds say how a step fares at each speed of the memory,
which moves minute by minute): the step against the memory roofline at the faster read, the
step's µs in the kernels' calls and outside them, and the routed experts' and linear calls' GB/s
against the read; beside the roofline, the most of it the step's arithmetic allows part by part
(the routed experts, the other weights, the keys and values: each the longer of its reads and
its FLOPs) at the cores' multiply-add ceiling and with the weights at the rate the kernels' own
16-input tiles compute from DRAM (measured each round). More than two rounds: the calls of the
slowest and fastest read's rounds.

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

from colibri.bench import accounting, anatomy
from colibri.bench.accounting import distinct_experts, held_step_bytes, part_bound
from colibri.bench.bandwidth import fma_ceiling, probe_array, read_rate, tiles_rate
from colibri.bench.conversations import BURST, STREAM_MS
from colibri.engine.hwinfo import cpu_detail, host
from colibri.report import markdown_table, write_report

HERE = Path(__file__).parent
RESULTS = HERE / "results"


def holds(fmt, row_bytes: int, cols: int) -> bool:
    """Whether a row of `row_bytes` bytes holds `cols` weights in format `fmt` (colibri.formats):
    as the kernels read it (cpu/formats.h's scale_width), scaled rows are the values, then one
    scale (and offset) per block of a multiple of 8 columns that divides them."""
    values = cols * fmt.value_bits // 8
    if not fmt.scaled:
        return row_bytes == values
    per = 4 * (2 if fmt.zero_points else 1)
    extra = row_bytes - values
    if cols % 8 or extra <= 0 or extra % per or cols % (extra // per):
        return False
    return cols // (extra // per) % 8 == 0


def linear_weights(params, rows: int, works) -> dict[int, tuple[str, float]]:
    """{work: (name, bytes)} for every linear call's work in `works` (as the linear kernel
    counts it: O x I float32 bytes, a pass for every four rows): the matrices of the
    checkpoint's dense weights that make it, named by their shape ("linear [64, 96] or [96,
    64]"), and the bytes a call reads of them as held (bfloat16 bits, int4 rows with their
    scales, ...; the first matrix's where several make it)."""
    import jax

    from colibri import formats

    passes = (rows + 3) // 4
    matrices = []  # (O, bytes a row, format)
    for leaf in jax.tree_util.tree_leaves(params):
        if getattr(leaf, "ndim", 0) == 2:
            fmt = formats.held(leaf.dtype) or formats.FLOAT32
            matrices.append((leaf.shape[0], leaf.nbytes // leaf.shape[0], fmt))
    out = {}
    for work in {int(w) for w in works}:
        names, held = [], None
        for o, row_bytes, fmt in matrices:
            cols, rest = divmod(work, 4 * passes * o)
            if rest or not holds(fmt, row_bytes, cols) or f"[{o}, {cols}]" in names:
                continue
            names.append(f"[{o}, {cols}]")
            held = o * row_bytes if held is None else held
        if names:
            out[work] = ("linear " + " or ".join(sorted(names)), float(held))
    return out


def expert_bytes_per_work(model) -> float:
    """Bytes the routed experts' rows take as held (scales and offsets included) for every
    byte of the expert kernel's work at one pass (their values alone: 3 F D weights an expert,
    at the format's bits a value)."""
    from colibri import formats

    gate, up, down = (model.experts[0][k] for k in ("gate", "up", "down"))
    held = sum(a.nbytes / a.shape[0] for a in (gate, up, down))
    bits = formats.of(gate.dtype).value_bits
    return held / (3 * gate.shape[1] * model.cfg.hidden * bits / 8)


def held_bytes(calls: np.ndarray, linear: dict, per_work: float) -> np.ndarray:
    """Bytes of weights each call reads as held, at one pass: a linear call's matrix
    (`linear`, linear_weights'), an expert call's work times `per_work`
    (expert_bytes_per_work); NaN for other calls and unnamed linear ones."""
    from colibri import kernels

    out = np.full(len(calls), np.nan)
    for i, (k, w) in enumerate(zip(calls["kind"], calls["work"], strict=True)):
        kind = kernels.TRACE_KINDS.get(int(k))
        if kind == "linear" and int(w) in linear:
            out[i] = linear[int(w)][1]
        elif kind == "routed experts":
            out[i] = w * per_work
    return out


def parts(
    calls: np.ndarray, linear: dict, per_work: float, steps: int, rows: int, read: float
) -> pd.DataFrame:
    """Per kind of call (TRACE_KINDS; linear calls by their weights, `linear`, else their
    work), the calls a step and, in µs, the median call, the helper's lateness, the threads'
    end gap and the share of the call both threads worked (medians; p90 beside the two gaps),
    and the share of the shared calls handed to a helper waiting for the next call; for the
    weight calls of up to four rows (one pass over the weights), the GB/s their weights stream
    at as held (held_bytes) over all their calls, and that against `read`."""
    from colibri import kernels

    kind = [kernels.TRACE_KINDS.get(int(k), f"kind {k}") for k in calls["kind"]]
    label = [
        (linear[int(w)][0] if int(w) in linear else f"linear ({w / 1e6:.2f} MB)")
        if k == "linear"
        else k
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
            "handed": calls["handed"] > 0,
        }
    )
    df["held"] = held_bytes(calls, linear, per_work)
    df["weights"] = [k in ("routed experts", "linear") and rows <= 4 for k in kind]
    out = []
    for part, g in df.groupby("part", sort=False):
        s = g[g.shared]
        named = g.weights.all() and g.held.notna().all()
        gb_s = g.held.sum() / g.us.sum() / 1e3 if named else np.nan
        out.append(
            {
                "part": part,
                "calls a step": len(g) / steps,
                "µs a call": g.us.median(),
                "µs a step": g.us.sum() / steps,
                "shared": len(s) / len(g),
                "scheduling, µs": s.scheduling.median() if len(s) else np.nan,
                "handed": s.handed.mean() if len(s) else np.nan,
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


def step_summary(
    calls: np.ndarray, linear: dict, per_work: float, tokens: int, rows: int, tok_s: float
) -> dict:
    """A round's step: µs a step, of it µs in the kernels' traced calls (one after another: the
    decode step's ops run in order) and outside them (XLA's ops, the kernels that are not
    shared out, the executor between ops, the host between bursts), and at up to four rows the
    routed experts' and the named linear calls' GB/s (their weights as held, held_bytes, over
    their time)."""
    from colibri import kernels

    step_us = rows / tok_s * 1e6
    in_calls = (calls["done"] - calls["enter"]).sum() / 1e3 / tokens
    kind = np.array([kernels.TRACE_KINDS.get(int(k), "") for k in calls["kind"]])
    held = held_bytes(calls, linear, per_work)

    def gb_s(name: str) -> float:
        pick = (kind == name) & ~np.isnan(held)
        took = (calls["done"][pick] - calls["enter"][pick]).sum()
        return held[pick].sum() / took if rows <= 4 and took else float("nan")

    return {
        "step_us": step_us,
        "in_calls_us": in_calls,
        "outside_us": step_us - in_calls,
        "experts_gb_s": gb_s("routed experts"),
        "linear_gb_s": gb_s("linear"),
    }


def step_parts(model, chosen: list[float], rows: int, prompt: int, tokens: int) -> dict:
    """{part: (bytes, FLOPs)} of a decode step (accounting.step_parts), its weights as the
    model holds them: the routed experts the rows chose (each read once), the rest of the
    weights (attention's projections, routers, lm_head), the keys and values."""
    experts = held_step_bytes({}, model.experts, chosen)
    weights = held_step_bytes(model.params, model.experts, chosen)
    return accounting.step_parts(model.cfg, experts, weights, rows, prompt, tokens)


def measure(ckpt: Path, rows: int, tokens: int, prompt_len: int, rounds: int) -> dict:
    from colibri import kernels
    from colibri.engine.model import load_model

    model = load_model(ckpt, progress=False)
    runner, firsts = anatomy.conversations(model, rows, tokens, prompt_len)

    def decode(routes: list | None = None) -> float:
        return anatomy.decode_bursts(
            runner, firsts, prompt_len, tokens, BURST, routes, stream_ms=STREAM_MS
        )

    routes: list = []
    decode(routes)  # compiles every program the rounds run; the steps' routes (greedy: theirs)
    chosen = distinct_experts(routes, rows)
    step = step_parts(model, chosen, rows, prompt_len, tokens)
    step_bytes = sum(b for b, _ in step.values())
    flops = sum(f for _, f in step.values())
    ceiling = fma_ceiling()
    per_work = expert_bytes_per_work(model)
    probe = probe_array(1.0)
    out = []
    for r in tqdm(range(rounds), desc=ckpt.name, unit="round"):
        before = max(read_rate(probe) for _ in range(3))
        kernels.take_traced_calls()  # (the probes' and anything before: not this round's)
        rate = decode()
        calls = kernels.take_traced_calls()
        after = max(read_rate(probe) for _ in range(3))
        tiles = tiles_rate(probe, model.cfg.hidden)
        linear = linear_weights(model.params, rows, calls["work"])
        table = parts(calls, linear, per_work, tokens, rows, max(before, after))
        out.append(
            {
                "round": r,
                "read_gb_s": [before, after],
                "tok_s": rate,
                "roofline_ratio": rate / rows * step_bytes / 1e9 / max(before, after),
                "tiles_gflop_s": tiles,
                # The weights' parts at the tiles' rate; attention's at the cores' ceiling.
                "tiles_allowed": part_bound(
                    step, max(before, after), accounting.part_rates(tiles, ceiling)
                ),
                "calls": len(calls),
                **step_summary(calls, linear, per_work, tokens, rows, rate),
                "parts": table.reset_index().to_dict(orient="records"),
            }
        )
    # The ceiling probed again after the rounds, the higher kept: a probe that meets the cores
    # busy (XLA's threads after a decode) reads low, never high.
    ceiling = max(ceiling, fma_ceiling())
    for rnd in out:
        rnd["roofline_allowed"] = part_bound(
            step, max(rnd["read_gb_s"]), accounting.part_rates(ceiling, ceiling)
        )
    return {
        "rows": rows,
        "step_bytes": step_bytes,
        "step_flops": flops,
        "step_parts": {name: {"bytes": b, "flops": f} for name, (b, f) in step.items()},
        "fma_gflop_s": ceiling,
        "distinct_experts": float(np.mean(chosen)),
        "rounds": out,
    }


def tiles_range(res: dict) -> tuple[float, float]:
    """The lowest and highest of the rounds' tiles rates (GFLOP/s)."""
    rates = [rnd["tiles_gflop_s"] for rnd in res["rounds"]]
    return min(rates), max(rates)


def summary(res: dict) -> pd.DataFrame:
    """The rounds side by side, slowest read first: the reads, tok/s, the step against the
    memory roofline at the faster read (* where the two reads disagree) and the most of it the
    step's arithmetic allows (at the cores' ceiling; at the tiles' rate that round), where the
    step's time went, and the routed experts' and linear calls' GB/s against the faster read."""
    rows = []
    for rnd in sorted(res["rounds"], key=lambda r: max(r["read_gb_s"])):
        read = max(rnd["read_gb_s"])
        rows.append(
            {
                "round": rnd["round"],
                "reads, GB/s": "{:.1f}, {:.1f}".format(*rnd["read_gb_s"]),
                "tok/s": rnd["tok_s"],
                "/ roofline": f"{rnd['roofline_ratio']:.2f}"
                + ("" if anatomy.steady_reads(rnd) else "*"),
                "allowed": rnd["roofline_allowed"],
                "tiles allow": rnd["tiles_allowed"],
                "µs a step": rnd["step_us"],
                "in calls": rnd["in_calls_us"],
                "outside": rnd["outside_us"],
                "experts / read": rnd["experts_gb_s"] / read,
                "linear / read": rnd["linear_gb_s"] / read,
            }
        )
    return pd.DataFrame(rows).set_index("round")


def detailed(rounds: list[dict]) -> list[dict]:
    """The rounds whose calls the report details, slowest read first: all of up to two; of
    more, those of the slowest and the fastest read among the rounds whose reads agree (all,
    where none do)."""
    read = lambda r: max(r["read_gb_s"])  # noqa: E731
    if len(rounds) <= 2:
        return sorted(rounds, key=read)
    steady = [r for r in rounds if anatomy.steady_reads(r)] or rounds
    ends = {min(steady, key=read)["round"], max(steady, key=read)["round"]}
    return sorted((r for r in rounds if r["round"] in ends), key=read)


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
        lines += [
            "",
            f"## {name}",
            "",
            f"{res['step_bytes'] / 1e6:.1f} MB a step ({res['distinct_experts']:.1f} distinct "
            f"experts a layer), {res['step_flops'] / 1e9:.2f} GFLOP; the cores' multiply-adds "
            f"{res['fma_gflop_s']:.0f} GFLOP/s, their tiles from DRAM "
            + "{:.0f}-{:.0f}".format(*tiles_range(res))
            + " GFLOP/s. The rounds, slowest read first:",
            "",
            markdown_table(summary(res)),
            "",
        ]
        for rnd in detailed(res["rounds"]):
            before, after = rnd["read_gb_s"]
            lines += [
                f"Round {rnd['round']}: reads {before:.1f}, {after:.1f} GB/s; "
                f"{rnd['tok_s']:.1f} tok/s; {rnd['calls']} calls.",
                "",
                markdown_table(pd.DataFrame(rnd["parts"]).set_index("part")),
                "",
            ]
    lines += [
        "/ roofline: the step's bytes (weights as held, the experts the rows chose counted "
        "once, the mean step's keys and values) over the faster read, against the step; "
        "allowed: the most of it a step can reach where each of its parts (the routed "
        "experts, the other weights, the keys and values) takes the longer of reading its "
        "bytes at the faster read and computing its FLOPs at the cores' multiply-add ceiling "
        "(1: the reads bound every part); tiles allow: the same with the weights' FLOPs at "
        "the rate the kernels' own tiles compute 16 inputs over rows of the model's hidden "
        "size streaming from DRAM on every core (the linear kernel over the probe's GiB, "
        "measured after the round's second read); in "
        "calls: µs a step in the calls of the kernels that share their work among threads "
        "(the traced ones, the small calls they run on the caller alone too); outside: the "
        "rest of the step (XLA's ops, the other kernels: norms, the routers' choice, the "
        "greedy choice; the executor between ops, the host between bursts); experts / read and "
        "linear / read: those calls' weights as held over their time (up to four rows), "
        "against the faster read.",
        "",
        "calls a step: over the round's steps; µs a call: the median, from the call's start to "
        "its return; shared: the calls a helper joined (the others, under ~512 KiB of work, run "
        "on the caller alone); scheduling: from the call's start to the caller's own first work "
        "(waking its helper, or handing the call to one waiting for the next call); handed: the "
        "shared calls handed to a helper that waited for them (the others scheduled a task of "
        "XLA's pool); helper late: from the call's start to the helper's first work; "
        "ends apart: between the caller's and the helper's last work (the one that ends first "
        "waits, or leaves); both at work: the share of the call from the helper's start to the "
        "first of the two ends. Medians over the shared calls; p90: their 90th percentile. "
        "GB/s: the expert and linear calls' weights as held over their time, all their calls "
        "together (up to four rows: one pass over the weights); / read: against the faster "
        "read of the round.",
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
