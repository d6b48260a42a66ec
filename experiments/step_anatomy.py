"""python experiments/step_anatomy.py [--shapes qwen3_moe,olmoe] [--ckpt PATH ...] [--rows 1]
    [--tokens 64] [--prompt 128] [--rounds 3] [--out step_anatomy]

Where a decode step's time goes, against the memory roofline measured on either side of it.
Each round, on the peers benchmark's f32 checkpoints (or --ckpt): a plain read of 1 GiB on
every core (bandwidth.read_rate), --tokens greedy steps of --rows conversations (the peers
benchmark's: one prompt, the others sharing all but its last 8 tokens) in the engine's bursts,
the same steps again under jax.profiler, and the read again. The profile, read back against the
compiled program (colibri.bench.anatomy), splits a step into colibri's kernel calls (by
kernel and weights: µs, calls, GB/s of weights while they run), XLA's own ops, the time no op
runs inside a burst, and the time between bursts. The roofline: the bytes a step reads as the
engine holds them (weights, the experts the rows chose counted once, and the mean step's keys
and values) over the faster of the two reads; each kernel call's GFLOP/s beside it, for
several rows, where the tiles' arithmetic rather than the memory may bound a call. The
profiler costs time of its own: the table's rates are the unprofiled run's, the anatomy the
profiled one's (its step time says by how much they differ). The checkpoint is held as the
switches say (formats.Holding.from_env: COLIBRI_BF16=products, bf16 products, whose calls are
bounded by the bfloat16 dot products' ceiling rather than the FMA's).

Writes experiments/results/step_anatomy.md and .json (--out NAME: NAME.md, NAME.json).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm import tqdm

from colibri.bench import anatomy
from colibri.bench.accounting import attention_flops, distinct_experts, held_step_bytes, kv_bytes
from colibri.bench.bandwidth import fma_ceiling, probe_array, read_rate
from colibri.bench.conversations import BURST, STREAM_MS
from colibri.engine.hwinfo import cpu_detail, host
from colibri.formats import Holding
from colibri.report import markdown_table, write_report

HERE = Path(__file__).parent
RESULTS = HERE / "results"
MODULE = "jit__decode_burst"
DUMP_FLAG = "--xla_dump_to="
XLA_OPS_KEPT = 20  # XLA's costliest ops a round keeps, by µs a step
OURS = "COLIBRI_ANATOMY_DUMP"  # set in the re-executed process: the dump folder it made


def with_program_dump() -> Path:
    """The folder XLA dumps the decode program's compiled text into (a new one, removed at the
    end): this process re-executed with XLA_FLAGS asking for it, as JAX reads them at start."""
    ours = os.environ.get(OURS)
    if ours:
        return Path(ours)
    flags = os.environ.get("XLA_FLAGS", "")
    if DUMP_FLAG in flags:
        raise SystemExit(f"XLA_FLAGS already has {DUMP_FLAG}: step_anatomy.py dumps on its own")
    dump = tempfile.mkdtemp(prefix="colibri-anatomy-")
    os.environ[OURS] = dump
    os.environ["XLA_FLAGS"] = (
        f"{flags} {DUMP_FLAG}{dump} --xla_dump_hlo_as_text "
        "--xla_dump_hlo_module_re=.*decode_burst.*"
    ).strip()
    os.execv(sys.executable, [sys.executable, *sys.argv])


def program_calls(dump: Path, earlier: set[Path]) -> dict[str, anatomy.Kernel]:
    """The kernel calls of the decode programs compiled since `earlier` was listed (one a KV
    length the bursts met): the same op names must mean the same calls in each, as the profile
    names ops only."""
    texts = sorted(set(dump.glob(f"*{MODULE}*after_optimizations.txt")) - earlier)
    if not texts:
        raise SystemExit(f"XLA dumped no {MODULE} program into {dump}")
    calls = [anatomy.kernel_calls(p.read_text()) for p in texts]
    for other in calls[1:]:
        if {k: v.label for k, v in other.items()} != {k: v.label for k, v in calls[0].items()}:
            raise SystemExit(
                "the decode programs' kernel calls differ in name: cannot tell ops apart"
            )
    return calls[0]


def measure(ckpt: Path, rows: int, tokens: int, prompt_len: int, rounds: int, dump: Path) -> dict:
    from colibri.engine.model import load_model

    earlier = set(dump.glob("*"))
    holding = Holding.from_env(os.environ)
    model = load_model(ckpt, progress=False, holding=holding)
    cfg = model.cfg
    runner, firsts = anatomy.conversations(model, rows, tokens, prompt_len)
    routes = []  # the measured bursts' own steps (greedy decoding is deterministic)
    anatomy.decode_bursts(runner, firsts, prompt_len, tokens, BURST, routes, stream_ms=STREAM_MS)
    chosen = distinct_experts(routes, rows)
    weights = held_step_bytes(model.params, model.experts, chosen)
    step_bytes = weights + kv_bytes(cfg, rows, prompt_len, tokens)

    def decode() -> float:
        return anatomy.decode_bursts(runner, firsts, prompt_len, tokens, BURST, stream_ms=STREAM_MS)

    decode()
    calls = program_calls(dump, earlier)
    probe = probe_array(1.0)
    out = []
    for r in tqdm(range(rounds), desc=ckpt.name, unit="round"):
        before = max(read_rate(probe) for _ in range(3))
        rate = decode()
        trace = Path(tempfile.mkdtemp(prefix="colibri-trace-"))
        try:
            events = anatomy.profile(decode, trace)
        finally:
            shutil.rmtree(trace, ignore_errors=True)
        after = max(read_rate(probe) for _ in range(3))
        a = anatomy.anatomy(events, calls, MODULE)
        out.append(
            {
                "round": r,
                "read_gb_s": [before, after],
                "tok_s": rate,
                "roofline_ratio": rate / rows * step_bytes / 1e9 / max(before, after),
                "profiled_step_us": a.step_us,
                "steps": a.steps,
                "parts": {k: vars(p) for k, p in a.parts.items()},
                "between_ops_us": a.between_ops_us,
                "between_bursts_us": a.between_bursts_us,
                "overlap_us": a.overlap_us,
                "xla_ops": dict(list(a.xla_ops.items())[:XLA_OPS_KEPT]),
            }
        )
    return {
        "rows": rows,
        "fma_gflop_s": fma_ceiling(),
        "bf16_dot_gflop_s": bf16_dot_ceiling() if holding.bf16_products else 0.0,
        "holding": holding.to_env(),
        "step_bytes": step_bytes,
        "weight_bytes": weights,
        "attention_flops": attention_flops(cfg, rows, prompt_len, tokens),
        "rounds": out,
        "top_k": cfg.moe.top_k,
        "distinct_experts": float(np.mean(chosen)),
    }


def bf16_dot_ceiling() -> float:
    """GFLOP/s of bfloat16 dot products on all cores (0 without AVX-512 BF16)."""
    from colibri import kernels

    return kernels.bf16_dot_peak()


def ceiling(res: dict, label: str) -> float:
    """The multiply-add ceiling of a part: the bfloat16 dot products' for bf16 products'
    calls where the build has them, else the FMA's."""
    dot = res.get("bf16_dot_gflop_s", 0.0)
    return dot if dot and "(bf16p rows)" in label else res.get("fma_gflop_s", 0.0)


def table(res: dict, rnd: dict) -> list[dict]:
    """One round's anatomy: a row a part, most time first, then the step. A weight call's
    bound: the longer of reading its weights at the round's faster read and computing its
    multiply-adds at the cores' ceiling."""
    step = rnd["profiled_step_us"]
    probe = max(rnd["read_gb_s"])
    rows = []
    for label, p in sorted(rnd["parts"].items(), key=lambda kv: -kv[1]["us"]):
        per_call = p["us"] / p["calls"] if p["calls"] else 0.0
        moved, flops = p["weight_bytes"], p.get("flops")
        if moved is not None and label.startswith("routed experts"):
            moved *= res.get("distinct_experts", res["top_k"])  # the rows' chosen experts
        gb_s = moved / per_call / 1e3 if moved and per_call else None
        bound, fma = None, ceiling(res, label)
        if moved and flops and per_call and fma:
            bound = max(moved / probe / 1e3, flops / fma / 1e3) / per_call
        rows.append(
            {
                "part": label,
                "µs a step": p["us"],
                "share": p["us"] / step,
                "calls a step": p["calls"],
                "µs a call": per_call,
                "GB/s of weights": gb_s,
                "/ read": gb_s / probe if gb_s else None,
                "GFLOP/s": flops / per_call / 1e3 if flops and per_call else None,
                "/ bound": bound,
            }
        )
    for label, key in (
        ("no op running (in a burst)", "between_ops_us"),
        ("between bursts", "between_bursts_us"),
    ):
        rows.append({"part": label, "µs a step": rnd[key], "share": rnd[key] / step})
    rows.append({"part": "step (profiled)", "µs a step": step, "share": 1.0})
    return rows


def weight_calls_bound(rows: list[dict]) -> tuple[float, float]:
    """Of a round's weight calls: their share of the step, and the time their bounds allow
    over the time they took."""
    calls = [r for r in rows if r.get("/ bound")]
    us = sum(r["µs a step"] for r in calls)
    if not us:
        return 0.0, float("nan")
    return us / rows[-1]["µs a step"], sum(r["µs a step"] * r["/ bound"] for r in calls) / us


def attention_bound_us(res: dict) -> float:
    """µs of a step's attention multiply-adds at the cores' ceiling (0 where a run has no
    such figures)."""
    if not res.get("attention_flops") or not res.get("fma_gflop_s"):
        return 0.0
    return res["attention_flops"] / res["fma_gflop_s"] / 1e3


def attainable_step(res: dict, rnd: dict, rows: list[dict]) -> float:
    """µs a step with every weight call at its bound and attention at its own (the longer of
    reading the step's cache at the round's faster read and its multiply-adds at the cores'
    ceiling: MLA's outlast its reads); every other part (XLA's ops, norms, the router's choice,
    the gaps) as it ran. The memory roofline over it: the most of that roofline the step can
    reach on this machine, where a call's multiply-adds outlast its reads."""
    probe = max(rnd["read_gb_s"])
    kv_us = max((res["step_bytes"] - res["weight_bytes"]) / probe / 1e3, attention_bound_us(res))
    us = 0.0
    for r in rows:
        if r["part"] == "step (profiled)":
            continue
        if r.get("/ bound"):
            us += r["µs a step"] * r["/ bound"]
        elif r["part"] == "attention":
            us += kv_us
        else:
            us += r["µs a step"]
    return us


def switches() -> str:
    """The holding switches this run was given that differ from the defaults, as a command's
    prefix ("COLIBRI_BF16=products ")."""
    given = Holding.from_env(os.environ).to_env()
    usual = Holding().to_env()
    return "".join(f"{k}={v} " for k, v in given.items() if v != usual[k])


def write(results: dict, args, out: str) -> None:
    hw = host()
    lines = [
        f"# Where a {'batch-1' if args.rows == 1 else f'{args.rows}-row'} decode step's time goes",
        "",
        f"Command: `{switches()}python experiments/step_anatomy.py {' '.join(sys.argv[1:])}`  ",
        f"Machine: {hw.cores} cores, {cpu_detail()}, {hw.ram_total_gb:.0f} GB RAM  ",
        f"Greedy decode of {args.tokens} tokens of {args.rows} conversation(s) after a "
        f"{args.prompt}-token prompt, in bursts of up to {BURST} steps (no longer than the last "
        f"one's steps say fit in {STREAM_MS} ms, as the engine's STREAM_MS). Each round: a "
        "plain read of 1 GiB on every core, the steps, the same steps under jax.profiler, the "
        "read again. Roofline: bytes a step (weights as held, the experts the rows chose counted "
        "once, the mean step's keys and values) over the faster read.",
        "",
    ]
    for name, res in results.items():
        rounds = res["rounds"]
        lines.append(f"## {name}")
        lines.append("")
        lines.append(
            f"{res['step_bytes'] / 1e6:.1f} MB a step ({res['distinct_experts']:.1f} distinct "
            f"experts a layer). Rounds (read before, after; tok/s of all rows; "
            "/ roofline; profiled step): "
            + "; ".join(
                f"{r['read_gb_s'][0]:.1f}, {r['read_gb_s'][1]:.1f} GB/s; {r['tok_s']:.1f}; "
                f"{r['roofline_ratio']:.2f}{'' if anatomy.steady_reads(r) else '*'}; "
                f"{r['profiled_step_us'] / 1e3:.2f} ms"
                for r in rounds
            )
            + (
                " (*: the reads disagree, the machine's bandwidth moved during the round)"
                if not all(anatomy.steady_reads(r) for r in rounds)
                else ""
            )
            + "."
        )
        lines.append("")
        steady = [r for r in rounds if anatomy.steady_reads(r)] or rounds
        best = max(steady, key=lambda r: max(r["read_gb_s"]))
        lines.append(
            f"The round with the fastest read of those whose two reads agree within "
            f"{1 - anatomy.AGREE:.0%} (round {best['round']}, {max(best['read_gb_s']):.1f} GB/s"
            f"{'' if anatomy.steady_reads(best) else '; none agree'}), profiled:"
        )
        lines.append("")
        rows = table(res, best)
        lines.append(markdown_table(pd.DataFrame(rows), index=False))
        lines.append("")
        share, bound = weight_calls_bound(rows)
        if share:
            lines.append(
                f"The weight calls take {share:.0%} of the step and run at {bound:.2f} of "
                f"their bound (the longer of reading the weights at "
                f"{max(best['read_gb_s']):.1f} GB/s and computing at "
                f"{res['fma_gflop_s']:.0f} GFLOP/s"
                + (
                    f", bf16 products at {res['bf16_dot_gflop_s']:.0f}"
                    if res.get("bf16_dot_gflop_s")
                    else ""
                )
                + ", call by call)."
            )
            lines.append("")
            probe = max(best["read_gb_s"])
            roof = res["step_bytes"] / probe / 1e3
            res["attainable_step_us"] = att = attainable_step(res, best, rows)
            lines.append(
                f"With every weight call at its bound, attention at its own and the rest as it "
                f"ran, a step takes {att / 1e3:.2f} ms: {roof / att:.2f} of the memory "
                f"roofline ({roof / 1e3:.2f} ms) at best, where the unprofiled steps reached "
                f"{best['roofline_ratio']:.2f}."
            )
            lines.append("")
            cache = res["step_bytes"] - res["weight_bytes"]
            reading, computing = cache / probe / 1e3, attention_bound_us(res)
            attention = sum(r["µs a step"] for r in rows if r["part"] == "attention")
            if attention and computing:
                lines.append(
                    f"Attention's bound, the longer of reading the step's cache "
                    f"({cache / 1e6:.1f} MB) at {probe:.1f} GB/s ({reading / 1e3:.2f} ms) and "
                    f"its {res['attention_flops'] / 1e9:.2f} GFLOP at the cores' ceiling "
                    f"({computing / 1e3:.2f} ms): {max(reading, computing) / attention:.2f} of "
                    f"the {attention / 1e3:.2f} ms it took."
                )
                lines.append("")
        costly = list(best["xla_ops"].items())[:5]
        lines.append(
            "XLA's costliest ops, µs a step: "
            + ", ".join(f"{op} {us:.1f}" for op, us in costly)
            + "."
        )
        lines.append("")
    lines.append(
        "µs a step: the sum of the part's op durations; GB/s of weights: the bytes of weights a "
        "call reads (routed experts: the rows of the distinct experts the rows chose, the mean "
        "over the steps) over its mean duration; GFLOP/s: the call's multiply-adds (of "
        "the rows the program holds, a bucket: padding rows counted; routed experts: every "
        "row's every chosen expert) over its mean duration; / bound: the longer of reading "
        "the call's weights at the faster read and computing its multiply-adds at the cores' "
        "ceiling (kernels.fma_peak; bf16 products' calls: kernels.bf16_dot_peak; measured "
        "with each checkpoint), over its mean duration; "
        "/ read: against the faster read of the round. No op running: a burst's span less the "
        "time some op ran; between bursts: from one burst's last op to the next one's first "
        "(the host reading tokens, dispatching the next burst), the mean of those gaps once a "
        "burst, over the steps."
    )
    print("\n".join(lines))
    write_report(RESULTS, out, lines, results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    anatomy.decode_arguments(ap, rounds=3, out="step_anatomy")
    args = ap.parse_args()
    dump = with_program_dump()
    try:
        ckpts = anatomy.checkpoints(args)
        results = {}
        for name, ckpt in ckpts.items():
            results[name] = measure(ckpt, args.rows, args.tokens, args.prompt, args.rounds, dump)
        write(results, args, args.out)
    finally:
        shutil.rmtree(dump, ignore_errors=True)


if __name__ == "__main__":
    main()
