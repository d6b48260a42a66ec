"""python experiments/bench_peers.py [--rounds 2] [--tokens 64] [--prompt 128] [--shapes A,B]

colibri beside what its users would pick instead, on the same synthetic f32 checkpoints, in one
run: colibri (resident experts), transformers `generate` (greedy), and llama.cpp through
llama-cpp-python (`pip install -e '.[bench]'`, skipped when absent) on the checkpoint converted
to GGUF as f32 and q8_0. Each configuration runs in its own worker process (so peak RSS is its
own) and the configurations alternate over --rounds rounds, best round kept, so that load from
other processes falls on each of them alike. `make bench` runs this with the defaults.

Measured per configuration: load seconds; prefill tok/s and TTFT for a --prompt-token prompt;
greedy decode tok/s at batch 1 over --tokens tokens; for colibri and llama.cpp also the aggregate
tok/s of 4 and 16 conversations decoding at once (colibri: 16 KV slots; llama.cpp: a sequence
each, a token of every one in each llama_decode, as llama-server's parallel slots decode); peak
RSS. colibri decodes as its engine decodes
greedy requests on these models: bursts of BURST steps a forward, cuttable (a step here takes
longer than BURST_MS / BURST); its rate with one step a forward is reported beside. colibri
measures 1, 4 and 16 rows in PASSES passes a round; the ratios to batch 1 are given both as
best rate over best rate and as the median of the ratios within a pass (every pass of every
round: rates a few seconds apart, in the same phase of the machine). Every configuration's
greedy tokens are compared with colibri's (f32 peers should agree; q8_0 need not).

The roofline (memory only): bytes of weights one decode step touches (attention, router, the
experts chosen, lm_head; f32) divided by the memory bandwidth measured in the same run (the
best of a plain read and numpy reductions on every core, an OpenBLAS and an XLA matrix-vector
product and colibri's own linear kernel on one row, over 1 GiB on huge pages): once against the
best probe of the run (before and after the rounds), and once paired, each round's colibri rate
against a probe run in its own process just before it (the median of the rounds' ratios; the
machine's bandwidth moves by a quarter within minutes), beside the most of that round's
roofline the kernels' own streaming allows (the chosen experts' bytes at the rate colibri's
expert kernel streams every expert's rows from memory on both cores at one row, measured in
the same colibri run: workers.expert_stream_rate). At 4 and 16 rows the experts touched
are the distinct experts colibri's routers chose, counted per layer, and the table of several
conversations counts their keys and values too (a 16-row step's rows attend over 16 contexts:
7-22% of its bytes here), with the GB/s each batch size moves; each round's 16-row rate is
also held against the probe run just before that round, beside the most of that roofline the
step's parts allow (the routed experts, the other weights, the keys and values, each the longer
of its reads at the probe's rate and its FLOPs, the weights' at the rate that probe's 16-row
kernel computed on rows of the model's hidden size: accounting.part_bound). A step of 16 rows
is as much arithmetic as memory traffic (8 FLOP a byte of the experts many rows chose), so that
table also gives the tok/s its FLOPs allow at the rate of colibri's linear kernel on 16 rows
streaming the probe's 1 GiB (both cores); what 16 slots at 6x batch 1 would have to move and
compute; and what 16 rows at 85% of their memory roofline would compute, against the
multiply-add ceiling and that kernel's rate.
llama.cpp runs with an f32 KV cache, as colibri keeps. --shapes takes any of
colibri.bench.shapes.ALL_SHAPES: `wide` has the rows of Qwen3-30B-A3B (hidden 2048, moe_ff 768)
in 4 layers of 32 experts, where the default shapes' rows are 512 and 768 columns.
Writes experiments/results/peers.md and peers.json (--out NAME: NAME.md and NAME.json).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from colibri.bench.accounting import (
    f32_step_parts,
    kv_bytes,
    part_bound,
    part_rates,
    step_bytes,
    step_flops,
    streaming_bound,
)
from colibri.bench.bandwidth import memory_bandwidth
from colibri.bench.conversations import conversation_prompts, prompt_ids
from colibri.bench.shapes import ALL_SHAPES, CACHE, SHAPES, ensure_inputs
from colibri.bench.sidebyside import agreement
from colibri.bench.workers import run_probe, run_worker
from colibri.config import load_config
from colibri.engine.hwinfo import cpu_detail, host
from colibri.report import markdown_table

PEERS = ["colibri", "transformers", "llama.cpp f32", "llama.cpp q8_0"]
RESULTS = Path(__file__).parent / "results"


def best_of(runs: list[dict]) -> dict:
    """Best round per measure: highest rates, lowest times, the largest RSS."""
    out = dict(runs[0])
    for r in runs[1:]:
        for k, v in r.items():
            if not isinstance(v, float):
                continue
            if "tok_s" in k:
                out[k] = max(out[k], v)
            elif k.endswith("_s"):
                out[k] = min(out[k], v)
            elif k == "peak_rss_mb":
                out[k] = max(out[k], v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument(
        "--shapes",
        default=",".join(SHAPES),
        help="of colibri.bench.shapes.ALL_SHAPES (wide: the rows of Qwen3-30B-A3B)",
    )
    ap.add_argument(
        "--out", default="peers", help="results name: experiments/results/NAME.md and .json"
    )
    args = ap.parse_args()
    try:
        import llama_cpp  # noqa: F401

        with_llama = True
    except ImportError:
        with_llama = False
        print("llama-cpp-python is not installed (pip install -e '.[bench]'): llama.cpp skipped")
    peers = [p for p in PEERS if with_llama or not p.startswith("llama")]
    CACHE.mkdir(parents=True, exist_ok=True)
    names = args.shapes.split(",")
    inputs = {name: ensure_inputs(name, with_llama) for name in names}
    bw = memory_bandwidth()
    print(f"memory bandwidth: {bw['gb_s']:.1f} GB/s", flush=True)
    runs: dict[tuple[str, str], list[dict]] = {}
    for rnd in range(args.rounds):
        for name in names:
            prompt = prompt_ids(ALL_SHAPES[name].vocab, args.prompt)
            conversations = conversation_prompts(prompt, 16, ALL_SHAPES[name].vocab)
            order = peers[rnd % len(peers) :] + peers[: rnd % len(peers)]  # rotate the order
            print(f"round {rnd + 1}/{args.rounds}, {name}", flush=True)
            for peer in order:
                if peer == "colibri":  # the roofline of this very round (paired below)
                    hidden = (ALL_SHAPES[name].hidden,)  # and the 16-row tiles' rate on its rows
                    runs.setdefault((name, "probe"), []).append(run_probe(hidden))
                res = run_worker(
                    peer, inputs[name][peer], prompt, args.tokens, conversations=conversations
                )
                runs.setdefault((name, peer), []).append(res)
    bw = {"before": bw, "after": memory_bandwidth()}
    gb_s = max(bw["before"]["gb_s"], bw["after"]["gb_s"])
    gflop_s = max(bw["before"]["kernel_16_gflop_s"], bw["after"]["kernel_16_gflop_s"])
    # The ceiling of the widest vectors the build has (the paired tiles' 512-bit ones on AVX-512).
    peak = max(
        b.get(k, 0) for b in bw.values() for k in ("fma_peak_gflop_s", "fma_peak_512_gflop_s")
    )

    rows, summary = [], {}
    for name in names:
        cfg = load_config(inputs[name]["colibri"])
        col = best_of(runs[(name, "colibri")])
        k = cfg.moe.top_k
        bytes1 = step_bytes(cfg, [k] * cfg.num_layers, 1)
        roof1 = gb_s * 1e9 / bytes1
        summary[name] = {"roofline_tok_s_1": roof1, "peers": {}}
        for peer in peers:
            r = best_of(runs[(name, peer)])
            summary[name]["peers"][peer] = r
            rows.append(
                {
                    "model": name,
                    "engine": peer,
                    "decode tok/s (batch 1)": r["decode_tok_s_1"],
                    "colibri / this": col["decode_tok_s_1"] / r["decode_tok_s_1"],
                    "prefill tok/s": r["prefill_tok_s"],
                    "TTFT s": r["ttft_s"],
                    "load s": r["load_s"],
                    "peak RSS MB": r["peak_rss_mb"],
                    "same greedy tokens": f"{agreement(col['tokens'], r['tokens'])}"
                    f"/{len(col['tokens'])}",
                }
            )
        rows.append(
            {
                "model": name,
                "engine": "roofline (f32 weights / best bandwidth probe of the run)",
                "decode tok/s (batch 1)": roof1,
                "colibri / this": col["decode_tok_s_1"] / roof1,
            }
        )
        # Each round's colibri rate against the roofline of the probe run just before it.
        probes = [p["gb_s"] for p in runs[(name, "probe")]]
        ratios = [
            c["decode_tok_s_1"] / (g * 1e9 / bytes1)
            for g, c in zip(probes, runs[(name, "colibri")], strict=True)
        ]
        # The most of each round's roofline the kernels' own streaming allows: the chosen
        # experts' bytes at the rate the expert kernel streams every expert's rows from memory
        # on both cores (measured in that colibri run), the rest at the probe's rate.
        bounds = [
            streaming_bound(bytes1, c["expert_step_bytes_1"], c["stream_gb_s"], g)
            if "stream_gb_s" in c
            else None
            for g, c in zip(probes, runs[(name, "colibri")], strict=True)
        ]
        summary[name]["roofline_paired"] = {
            "gb_s": probes,
            "colibri_ratio": ratios,
            "stream_gb_s": [c.get("stream_gb_s") for c in runs[(name, "colibri")]],
            "stream_bound": bounds,
        }
        rows.append(
            {
                "model": name,
                "engine": "roofline, probed just before colibri (median of rounds)",
                "decode tok/s (batch 1)": float(np.median(probes)) * 1e9 / bytes1,
                "colibri / this": float(np.median(ratios)),
            }
        )
    table = pd.DataFrame(rows)
    batch_rows = []
    for name in names:
        cfg = load_config(inputs[name]["colibri"])
        col = summary[name]["peers"]["colibri"]
        moved = {b: moved_by(cfg, col, b, args) for b in (1, 4, 16)}
        flops = {b: step_flops(cfg, b, args.prompt, args.tokens) for b in (1, 4, 16)}
        summary[name]["step_bytes"] = moved
        summary[name]["step_flops"] = flops
        # Each round's 16-row rate against the memory roofline of the probe run just before
        # that round (the table's is at the run's best probe, which a fast minute can lift).
        probes = summary[name]["roofline_paired"]["gb_s"]
        summary[name]["roofline_paired"]["rows_16_ratio"] = [
            c["decode_tok_s_16"] / (16 * g * 1e9 / moved_by(cfg, c, 16, args))
            for g, c in zip(probes, runs[(name, "colibri")], strict=True)
        ]
        # The most of that roofline the step's parts allow, each the longer of reading its
        # bytes at the probe's rate and computing its FLOPs: the weights' at the rate the
        # 16-row kernel computed on the model's rows in that probe, attention's at the cores'
        # multiply-add ceiling (accounting.part_bound).
        summary[name]["roofline_paired"]["rows_16_parts_allow"] = [
            rows_16_bound(cfg, c, p, args)
            for p, c in zip(runs[(name, "probe")], runs[(name, "colibri")], strict=True)
        ]
        by_pass = {  # every pass of every round
            b: [x for r in runs[(name, "colibri")] for x in r[f"x_vs_1_by_pass_{b}"]]
            for b in (4, 16)
        }
        summary[name]["x_vs_1_by_pass"] = by_pass
        lf32, lq8 = (summary[name]["peers"].get(p, {}) for p in PEERS[2:])
        for b in (1, 4, 16):
            batch_rows.append(
                {
                    "model": name,
                    "rows": b,
                    "aggregate tok/s": col[f"decode_tok_s_{b}"],
                    "x vs batch 1": col[f"decode_tok_s_{b}"] / col["decode_tok_s_1"],
                    "x vs batch 1 within a pass (median)": (
                        1.0 if b == 1 else float(np.median(by_pass[b]))
                    ),
                    "one step a forward": col[f"decode_tok_s_{b}_single"],
                    "distinct experts / layer": float(np.mean(col[f"distinct_experts_{b}"])),
                    "MB a step (weights, KV)": moved[b] / 1e6,
                    "GB/s moved": col[f"decode_tok_s_{b}"] / b * moved[b] / 1e9,
                    "GFLOP a step": flops[b] / 1e9,
                    "roofline tok/s, memory": b * gb_s * 1e9 / moved[b],
                    "tok/s at the 16-row kernel's GFLOP/s": (
                        b * gflop_s * 1e9 / flops[b] if gflop_s else None  # no native kernels
                    ),
                    "roofline tok/s, multiply-adds": b * peak * 1e9 / flops[b] if peak else None,
                    "aggregate / lower roofline": col[f"decode_tok_s_{b}"]
                    / min(b * gb_s * 1e9 / moved[b], b * peak * 1e9 / flops[b] if peak else 1e30),
                    "llama.cpp f32 tok/s": lf32.get(f"decode_tok_s_{b}"),
                    "colibri / llama.cpp f32": (
                        col[f"decode_tok_s_{b}"] / lf32[f"decode_tok_s_{b}"] if lf32 else None
                    ),
                    "llama.cpp q8_0 tok/s": lq8.get(f"decode_tok_s_{b}"),
                }
            )
    batch = pd.DataFrame(batch_rows)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    print(batch.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    write_results(args, host(), bw, gb_s, gflop_s, peak, table, batch, summary)


def moved_by(cfg, run: dict, b: int, args) -> float:
    """What a step of b rows of a colibri run reads: the weights it touches (the distinct
    experts its routers chose), and its rows' keys and values (at 16 rows, 7-22% of the bytes
    on these shapes; at one row 1-2%)."""
    experts = run[f"distinct_experts_{b}"]
    return step_bytes(cfg, experts, b) + kv_bytes(cfg, b, args.prompt, args.tokens)


def rows_16_bound(cfg, run: dict, probe: dict, args) -> float | None:
    """The most of a round's 16-row memory roofline (at its probe's rate) the step's parts
    allow: the routed experts the run's rows chose, the other weights, the keys and values,
    each the longer of its reads and its FLOPs, the weights' at the probe's 16-row kernel rate
    on rows of the model's hidden size, attention's at the multiply-add ceiling (None where the
    probe has no such rate: no kernels)."""
    rate = probe.get("kernel_16_gflop_s_at", {}).get(str(cfg.hidden), 0.0)
    ceiling = max(probe.get("fma_peak_gflop_s", 0.0), probe.get("fma_peak_512_gflop_s", 0.0))
    if not rate or not ceiling:
        return None
    parts = f32_step_parts(cfg, run["distinct_experts_16"], 16, args.prompt, args.tokens)
    return part_bound(parts, probe["gb_s"], part_rates(rate, ceiling))


def llama_rows(summary: dict) -> str:
    """How llama.cpp's rates at 4 and 16 rows were taken, and whether decoding its first
    conversation beside 15 others kept its batch-1 tokens."""
    kept = [
        f"{name} {peer.removeprefix('llama.cpp ')} "
        f"{agreement(r['tokens'], r['batch_16_tokens_0'])}/{len(r['tokens'])}"
        for name, res in summary.items()
        for peer, r in res["peers"].items()
        if "batch_16_tokens_0" in r
    ]
    if not kept:
        return "llama.cpp not run: no rates of several conversations beside colibri's."
    return (
        "llama.cpp at 4 and 16 rows: the same conversations as colibri's, a sequence each, one "
        "llama_decode a step with a token of each (llama-server's parallel slots), f32 KV "
        "cache, the rate over the steps after the first batched one, best round. Its first "
        "conversation's tokens at 16 rows against its own at batch 1: " + ", ".join(kept) + "."
    )


def six_times(summary: dict, gb_s: float, gflop_s: float) -> str:
    """What the 16-slot target (6x batch 1) asks, per model: the GB/s a 16-row step would move
    and the GFLOP/s it would compute at 6x the batch-1 rate, against the probes and against
    what batch 1 moves."""
    parts = []
    for name, res in summary.items():
        col, moved, flops = res["peers"]["colibri"], res["step_bytes"], res["step_flops"]
        one = col["decode_tok_s_1"]
        steps = 6 * one / 16  # 16-row steps a second at 6x
        need, compute = steps * moved[16] / 1e9, steps * flops[16] / 1e9
        parts.append(
            f"{name}: {need:.1f} GB/s moved ({need / gb_s:.0%} of the best probe; batch 1 "
            f"moves {one * moved[1] / 1e9:.1f}, 16 rows now "
            f"{col['decode_tok_s_16'] / 16 * moved[16] / 1e9:.1f}) while "
            f"computing {compute:.0f} GFLOP/s"
            + (f" ({compute / gflop_s:.0%} of the 16-row kernel's rate)" if gflop_s else "")
        )
    return "16 slots at 6x the best batch-1 rate would need, " + "; ".join(parts) + "."


def at_85(summary: dict, gb_s: float, gflop_s: float, peak: float) -> str:
    """What 16 rows at 85% of their memory roofline ask, per model: the GFLOP/s the step would
    compute at that rate against the cores' multiply-add ceiling and the 16-row kernel's rate;
    and the tok/s those two allow against the memory roofline (a target beyond them is beyond
    what the cores can compute while streaming, not a matter of streaming)."""
    parts = []
    for name, res in summary.items():
        moved, flops = res["step_bytes"][16], res["step_flops"][16]
        roof = 16 * gb_s * 1e9 / moved
        compute = 0.85 * roof / 16 * flops / 1e9
        part = f"{name}: {0.85 * roof:.0f} tok/s computing {compute:.0f} GFLOP/s"
        if peak:
            part += f" ({compute / peak:.0%} of the multiply-add ceiling"
            if gflop_s:
                part += f", {compute / gflop_s:.0%} of the 16-row kernel's rate"
            part += ")"
        if gflop_s:
            part += (
                f"; at the 16-row kernel's rate the FLOPs alone allow "
                f"{16 * gflop_s * 1e9 / flops / roof:.0%} of the memory roofline"
            )
        parts.append(part)
    return "16 rows at 85% of their memory roofline would be " + "; ".join(parts) + "."


def write_results(
    args, hw, bw: dict, gb_s: float, gflop_s: float, peak: float, table, batch, summary: dict
) -> None:
    probes = "; ".join(
        f"{when}: plain read {b['read_gb_s']:.1f}, numpy sums {b['sum_gb_s']:.1f}, "
        f"OpenBLAS gemv {b['gemv_gb_s']:.1f}, "
        f"XLA gemv {b['xla_gemv_gb_s']:.1f}, colibri linear kernel {b['kernel_gemv_gb_s']:.1f} "
        f"(on 16 rows: {b['kernel_16_gflop_s']:.1f} GFLOP/s)"
        for when, b in bw.items()
    )
    ceiling = "; ".join(
        f"{when}: {b['fma_peak_gflop_s']:.1f} on 256-bit vectors"
        + (f", {b['fma_peak_512_gflop_s']:.1f} on 512-bit" if b["fma_peak_512_gflop_s"] else "")
        for when, b in bw.items()
        if "fma_peak_gflop_s" in b
    )
    machine = (
        f"{hw.cores} cores, {cpu_detail()}, {hw.ram_total_gb:.0f} GB RAM; memory bandwidth "
        f"{gb_s:.1f} GB/s, the best probe before and after the runs ({probes}); "
        f"multiply-add ceiling of both cores, GFLOP/s ({ceiling or 'not probed'})"
    )
    shapes = {
        n: f"synthetic {s.family}: {s.layers} layers x {s.experts} experts (top-{s.top_k}), "
        f"hidden {s.hidden}, moe_ff {s.moe_ff}, vocab {s.vocab}, f32"
        for n, s in ALL_SHAPES.items()
        if n in summary
    }
    cmd = (
        f"python experiments/bench_peers.py --rounds {args.rounds} --tokens {args.tokens} "
        f"--prompt {args.prompt}"
        + (f" --shapes {args.shapes}" if args.shapes != ",".join(SHAPES) else "")
        + (f" --out {args.out}" if args.out != "peers" else "")
    )
    paired = []
    for n, res in summary.items():
        pr = res["roofline_paired"]
        rounds = zip(pr["colibri_ratio"], pr["gb_s"], pr["stream_bound"], strict=True)
        paired.append(
            f"{n} "
            + ", ".join(
                f"{r:.2f} ({g:.1f} GB/s" + (f"; {b:.2f})" if b is not None else ")")
                for r, g, b in rounds
            )
        )
    md = [
        "# colibri beside its peers",
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {machine}  ",
        *[f"{n}: {d}  " for n, d in shapes.items()],
        "",
        f"Batch-1 greedy decode of {args.tokens} tokens after a {args.prompt}-token prompt; "
        f"best of {args.rounds} alternating rounds, each configuration in its own process.",
        "Each round also probes the bandwidth in a process of its own just before colibri "
        "runs; colibri / roofline per round (probe; the most of that roofline the kernels' "
        "own streaming allows, the chosen experts at the rate the expert kernel streams every "
        "expert's rows from memory on both cores, measured in the same run): "
        f"{'; '.join(paired)}.",
        "",
        markdown_table(table, index=False),
        "",
        "## colibri with several conversations decoding at once",
        "",
        markdown_table(batch, index=False),
        "",
        "16 rows against the memory roofline of the probe run just before each round (that "
        "round's own rate and distinct experts; the most of it the step's parts allow, the "
        "routed experts, the other weights and the keys and values each the longer of its reads "
        "and its FLOPs, the weights' at the rate the probe's 16-row kernel computed on the "
        "model's rows from DRAM): "
        + "; ".join(
            f"{n} "
            + ", ".join(
                f"{r:.2f} ({g:.1f} GB/s" + (f"; {b:.2f})" if b is not None else ")")
                for r, g, b in zip(
                    s["roofline_paired"]["rows_16_ratio"],
                    s["roofline_paired"]["gb_s"],
                    s["roofline_paired"]["rows_16_parts_allow"],
                    strict=True,
                )
            )
            for n, s in summary.items()
        )
        + ".",
        "",
        llama_rows(summary),
        "",
        "Bytes a step: the weights it touches (the distinct experts chosen) and its "
        "conversations' keys and values (f32, the mean over the steps); GB/s moved: at the "
        "aggregate rate. Roofline, memory: bytes a step over the best bandwidth probe. Tok/s "
        "at the 16-row kernel's GFLOP/s: FLOPs a step at the rate of colibri's linear kernel on "
        "16 rows streaming "
        f"1 GiB from DRAM on both cores ({gflop_s:.1f} GFLOP/s, the best probe), a reference "
        "rather than a roof (the expert calls' shapes can run faster or slower). Roofline, "
        f"multiply-adds: FLOPs a step at the cores' multiply-add ceiling ({peak:.1f} GFLOP/s, "
        "the best probe, on the widest vectors); aggregate / lower roofline: the rate against "
        "the lower of the two "
        f"roofs. {six_times(summary, gb_s, gflop_s)} {at_85(summary, gb_s, gflop_s, peak)}",
        "",
    ]
    (RESULTS / f"{args.out}.md").write_text("\n".join(md))
    (RESULTS / f"{args.out}.json").write_text(
        json.dumps(
            {
                "command": cmd,
                "machine": machine,
                "bandwidth": bw,
                "shapes": shapes,
                "results": summary,
            },
            indent=1,
        )
    )
    print(f"wrote {RESULTS / args.out}.md")


if __name__ == "__main__":
    main()
