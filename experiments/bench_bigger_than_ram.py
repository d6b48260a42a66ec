"""python experiments/bench_bigger_than_ram.py [--shapes olmoe-bf16,qwen3-int4] [--layers N]
       [--experts N] [--vocab N] [--cap-gb G] [--tokens 64] [--greedy 16] [--prompt 16]
       [--seed 0] [--timeout 3600] [--stem bigger_than_ram]

(a size override is N for every shape or SHAPE=N,SHAPE=N, e.g. --layers olmoe-bf16=4,qwen3-int4=12)

Models bigger than the memory they may use, colibri beside llama.cpp under one cap (issue 31).
Two real shapes, random weights, from the configs in data/configs/ (`synth --config`, cached
under .cache/bigger-than-ram/): OLMoE-1B-7B in bf16 and Qwen3-30B-A3B in int4 (pack-quantized,
a scale per 128 columns). Full scale by default; --layers, --experts and --vocab make a reduced
run (the result says so; --cap-gb applies to every shape, so leave it to the default there).
llama.cpp (llama-cpp-python, mmap on) reads the same weights exported to the nearest GGUF
format: bf16, and q4_0 for int4 (the int4 weights dequantized and quantized again); without
llama_cpp its rows say "not installed". Its weight repacking is off (`--no-repack`: on x86 it
copies Q4_0 matrices into anonymous memory at load, which a model bigger than the memory cannot
survive); for q4_0 a second row, "llama.cpp repack", runs llama.cpp's default.

Each engine runs in a process of its own inside a memory cgroup this script makes under its own
(v1 `memory.limit_in_bytes`, or v2 `memory.max`; where neither can be made the runs are
uncapped and marked so), capped at --cap-gb (default: the checkpoint's size / 2.5), from a cold
page cache (the model's files dropped with posix_fadvise, checked with mincore). Both engines
see the same prompt (--prompt token ids); each first warms up on another prompt of that length
(compiling colibri's programs), then takes the prompt (TTFT: to the first sampled token), then
decodes --tokens tokens at batch 1 sampling at temperature 1 with --seed (random weights decoding
greedily loop on a few tokens and so on a few experts, which flatters any cache), then --greedy
greedy tokens from the prompt, whose agreeing prefix with colibri's is reported. colibri runs
with no tier settings: its budgets are the automatic ones, read from the cgroup's headroom.

Per engine: decode tok/s, TTFT, bytes read from storage a token (the worker's /proc/self/io
read_bytes over the decode; for colibri also its expert store's own count), the cgroup's peak
usage (page cache included), peak anonymous memory in the cgroup (polled) and the worker's VmHWM.
For colibri also: the expert hit rate, the (layer, expert) pairs a token touches, the distinct
experts of a layer the whole decode touched, the share of a token's experts the token before had
touched, and per token the time waiting on expert reads (t_ewait) and computing (attention,
expert matmuls and the head: t_attn + t_emm + t_head). A run that crashes, is OOM-killed or
times out is a row with that outcome.

The bound for colibri: per token, the bytes of its misses at its measured hit rate (lookups a
token x miss share x bytes of one expert on disk) over the disk bandwidth probed in the same run
(a cold 4-thread pread of the checkpoint's files in 4 MiB requests, up to 2 GB of them, before
and after each shape's runs: the better of the two), overlapped with its compute time a token:
bound tok/s = 1 / max(I/O s, compute s). colibri's rate is given as a share of that bound and
against llama.cpp's. Writes experiments/results/<stem>.md and .json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import psutil
from tqdm import tqdm

from colibri.bench.bandwidth import pread_bandwidth
from colibri.bench.capped import read_ahead_kb, run_capped
from colibri.bench.conversations import prompt_ids
from colibri.bench.sidebyside import agreement
from colibri.checkpoint import Checkpoint
from colibri.config import load_config
from colibri.engine.hwinfo import cpu_detail
from colibri.report import markdown_table, write_report
from colibri.synth import synthesize_config

CONFIGS = Path(__file__).resolve().parent.parent / "data" / "configs"
# shape -> (config file, checkpoint dtype, GGUF dtype)
SHAPES = {
    "olmoe-bf16": ("OLMoE-1B-7B-0924.json", "bf16", "bf16"),
    "qwen3-int4": ("Qwen3-30B-A3B.json", "int4", "q4_0"),
}
CACHE = Path(".cache/bigger-than-ram")
RESULTS = Path(__file__).parent / "results"
SIZES = ("layers", "experts", "vocab")  # what the command line may override (synth's names)
RATIO = 2.5  # the default cap: the checkpoint's size over this
PROBE_BYTES = 2 * 10**9  # the disk probe reads at most this much of the files


def per_shape(text: str) -> dict[str, int]:
    """ "N" (every shape) or "SHAPE=N,SHAPE=N": {shape or "*": N}."""
    out = {}
    for part in text.split(","):
        shape, _, n = part.rpartition("=")
        if shape and shape not in SHAPES:
            raise argparse.ArgumentTypeError(f"unknown shape {shape!r}: {', '.join(SHAPES)}")
        out[shape or "*"] = int(n)
    return out


def checkpoint(shape: str, sizes: dict) -> Path:
    """The shape's random checkpoint (made once, cached), sizes overridden where given."""
    config, dtype, _ = SHAPES[shape]
    tag = "".join(f"-{k[0]}{v}" for k, v in sorted(sizes.items()) if v is not None)
    out = CACHE / f"{shape}{tag}"
    if not (out / "config.json").exists():  # config.json is written last
        print(f"synthesizing {out} from {config} ...", flush=True)
        synthesize_config(CONFIGS / config, out, dtype=dtype, seed=0, **sizes)
    return out


def gguf_file(ckpt: Path, gtype: str) -> Path | str:
    """The checkpoint exported to GGUF as `gtype` (made once, cached), or why it is not."""
    from colibri.gguf import export_gguf

    out = ckpt.with_name(f"{ckpt.name}.{gtype}.gguf")
    if not out.exists():
        # q4_0 takes 4.5 bits a weight where int4 with a scale per 128 columns takes 4.125
        need = 1.2 * sum(p.stat().st_size for p in Checkpoint(ckpt).files)
        free = shutil.disk_usage(out.parent).free
        if free < need:
            return f"no disk for the GGUF ({free / 1e9:.0f} GB free, ~{need / 1e9:.0f} GB needed)"
        print(f"exporting {out} ...", flush=True)
        t = time.perf_counter()
        export_gguf(ckpt, out, dtype=gtype)
        print(f"  {time.perf_counter() - t:.0f} s", flush=True)
    return out


def llama_engines(gtype: str) -> list[tuple[str, bool]]:
    """The llama.cpp rows of a shape: (name, whether llama.cpp repacks the weights). The
    first is how a model bigger than the memory runs in llama.cpp: mmap on, repacking off
    (`--no-repack`); where llama.cpp's default repacks the GGUF's matrices on this kind of CPU
    (Q4_0 on x86: into anonymous memory, at load), that default is a second row."""
    engines = [("llama.cpp", False)]
    if gtype == "q4_0":
        engines.append(("llama.cpp repack", True))
    return engines


def llama_missing() -> str | None:
    """Why llama.cpp cannot run here, or None."""
    for module, what in (("llama_cpp", "not installed"), ("gguf", "no gguf package")):
        if importlib.util.find_spec(module) is None:
            return what
    return None


def probe(files: list[Path]) -> float:
    return pread_bandwidth(files, threads=4, max_bytes=PROBE_BYTES)


def bound(r: dict, gb_s: float) -> dict:
    """colibri's bound from its own run: miss bytes a token at its hit rate over the probed
    disk bandwidth, overlapped with its compute time a token."""
    d = r["decode"]
    miss_share = 1 - r["hit_pct"] / 100
    miss_bytes = d["lookups"] * miss_share * r["expert_bytes_disk"]
    io_s = miss_bytes / (gb_s * 1e9)
    compute_s = d["t_attn"] + d["t_emm"] + d["t_head"]
    fused = compute_s == 0  # every expert resident: one fused program a token, not timed
    if fused:
        compute_s = 1 / r["decode_tok_s"]
    return {
        "fused": fused,
        "miss_bytes_per_token": miss_bytes,
        "io_s_per_token": io_s,
        "compute_s_per_token": compute_s,
        "bound_tok_s": 1 / max(io_s, compute_s),
    }


def row(shape: str, engine: str, r: dict, llama: dict | None, gb_s: float) -> dict:
    ok = r.get("outcome") == "ok"
    outcome = r.get("outcome", "")
    if ok and not r.get("capped"):
        outcome = "ok (uncapped)"
    d, gb = r.get("decode", {}), 1e9
    out = {
        "shape": shape,
        "engine": engine,
        "outcome": outcome,
        "tok/s": r.get("decode_tok_s", float("nan")),
        "TTFT s": r.get("ttft_s", float("nan")),
        "read MB/tok": d.get("read_bytes", float("nan")) / 1e6,
        "store MB/tok": d.get("store_bytes", float("nan")) / 1e6,
        "hit %": r.get("hit_pct", float("nan")),
        "experts/tok": r.get("distinct_per_token", float("nan")),
        "distinct/layer": r.get("distinct_per_layer_run", float("nan")),
        "reuse %": r.get("reuse_pct", float("nan")),
        "I/O wait ms/tok": 1e3 * d.get("t_ewait", float("nan")),
        "compute ms/tok": float("nan"),
        "bound tok/s": float("nan"),
        "% of bound": float("nan"),
        "colibri / llama.cpp": float("nan"),
        "greedy agree": "",
        "cgroup peak GB": (r.get("cgroup_peak_bytes") or float("nan")) / gb,
        "anon peak GB": (r.get("cgroup_peak_anon_bytes") or float("nan")) / gb,
        "VmHWM GB": r.get("vm_hwm_bytes", float("nan")) / gb,
    }
    if engine == "colibri" and ok:
        b = bound(r, gb_s)
        out["compute ms/tok"] = 1e3 * b["compute_s_per_token"]
        out["bound tok/s"] = b["bound_tok_s"]
        out["% of bound"] = 100 * r["decode_tok_s"] / b["bound_tok_s"]
        if llama and llama.get("outcome") == "ok":
            out["colibri / llama.cpp"] = r["decode_tok_s"] / llama["decode_tok_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    for size in SIZES:
        ap.add_argument(
            f"--{size}",
            type=per_shape,
            help=f"override the configs' {size}: N, or SHAPE=N,SHAPE=N for each shape",
        )
    ap.add_argument("--cap-gb", type=float, help="memory cap (default: checkpoint / 2.5)")
    ap.add_argument("--tokens", type=int, default=64, help="sampled decode tokens")
    ap.add_argument("--greedy", type=int, default=16, help="greedy tokens compared")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds a worker may take")
    ap.add_argument("--stem", default="bigger_than_ram", help="result file names")
    args = ap.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = set(shapes) - set(SHAPES)
    if unknown:
        ap.error(f"unknown shapes {sorted(unknown)}: {', '.join(SHAPES)}")
    sizes = {
        shape: {k: (getattr(args, k) or {}).get(shape, (getattr(args, k) or {}).get("*"))
                for k in SIZES}
        for shape in shapes
    }  # fmt: skip
    reduced = {
        shape: {k: v for k, v in given.items() if v is not None} for shape, given in sizes.items()
    }
    reduced = {shape: given for shape, given in reduced.items() if given}
    command = shlex.join(["python", "experiments/bench_bigger_than_ram.py", *sys.argv[1:]])
    no_llama = llama_missing()
    if no_llama:
        print(f"llama.cpp: {no_llama}; its rows say so", flush=True)

    prepared = {}
    for shape in shapes:
        ckpt = checkpoint(shape, sizes[shape])
        gguf = no_llama or gguf_file(ckpt, SHAPES[shape][2])
        prepared[shape] = (ckpt, gguf)  # gguf: the file, or why llama.cpp does not run

    work = CACHE / "runs"
    rows, runs, shape_info = [], {}, {}
    total = sum(1 + len(llama_engines(SHAPES[s][2])) for s in shapes)
    bar = tqdm(total=total, desc="runs", unit="run")
    for shape in shapes:
        ckpt, gguf = prepared[shape]
        files = Checkpoint(ckpt).files
        size = sum(p.stat().st_size for p in files)
        gguf_size = gguf.stat().st_size if isinstance(gguf, Path) else None
        cap = int(args.cap_gb * 1e9) if args.cap_gb else int(size / RATIO)
        cfg = load_config(ckpt)
        prompt = prompt_ids(cfg.vocab_size, args.prompt)
        warm = np.random.default_rng(11).integers(0, min(cfg.vocab_size, 4096), args.prompt)
        spec = {
            "prompt": prompt,
            "warm": warm.tolist(),
            "tokens": args.tokens,
            "greedy": args.greedy,
            "seed": args.seed,
        }
        probes = [probe(files)]
        bar.set_postfix_str(f"{shape} colibri")
        res = {
            "colibri": run_capped(
                "colibri",
                ckpt,
                spec,
                cap=cap,
                files=files,
                work_dir=work,
                label=f"{shape}-colibri",
                timeout=args.timeout,
            )  # fmt: skip
        }
        bar.update()
        for engine, repack in llama_engines(SHAPES[shape][2]):
            if isinstance(gguf, str):
                res[engine] = {"outcome": gguf}
            else:
                bar.set_postfix_str(f"{shape} {engine}")
                res[engine] = run_capped(
                    "llama", gguf, {**spec, "repack": repack}, cap=cap, files=[gguf],
                    work_dir=work, label=f"{shape}-{engine.replace(' ', '')}",
                    timeout=args.timeout,
                )  # fmt: skip
            bar.update()
        probes.append(probe(files))
        gb_s = max(probes)
        ours, theirs = res["colibri"], res["llama.cpp"]
        agree = ""
        for engine, r in res.items():
            rows.append(row(shape, engine, r, theirs, gb_s))
            if engine != "colibri" and "greedy_tokens" in ours and "greedy_tokens" in r:
                n = agreement(ours["greedy_tokens"], r["greedy_tokens"])
                rows[-1]["greedy agree"] = f"{n}/{len(ours['greedy_tokens'])}"
                agree = agree or rows[-1]["greedy agree"]
        runs[shape] = res
        shape_info[shape] = {
            "checkpoint": str(ckpt),
            "config": SHAPES[shape][0],
            "dtype": SHAPES[shape][1],
            "gguf": str(gguf) if isinstance(gguf, Path) else None,
            "gguf_dtype": SHAPES[shape][2],
            "checkpoint_bytes": size,
            "gguf_bytes": gguf_size,
            "cap_bytes": cap,
            "checkpoint_over_cap": size / cap,
            "gguf_over_cap": gguf_size / cap if gguf_size else None,
            "layers": cfg.num_layers,
            "experts": cfg.moe.num_experts,
            "top_k": cfg.moe.top_k,
            "hidden": cfg.hidden,
            "moe_ff": cfg.moe.moe_ff,
            "vocab": cfg.vocab_size,
            "read_ahead_kb": read_ahead_kb(files[0]),
            "disk_gb_s_probes": probes,
            "disk_gb_s": gb_s,
            "bound": bound(ours, gb_s) if ours.get("outcome") == "ok" else None,
            "greedy_agree": agree,
        }
        bar.write(
            f"{shape}: colibri {ours.get('outcome')} {ours.get('decode_tok_s', float('nan')):.2f}"
            f" tok/s, llama.cpp {theirs.get('outcome')} "
            f"{theirs.get('decode_tok_s', float('nan')):.2f} tok/s"
        )
    bar.close()

    df = pd.DataFrame(rows).set_index("shape")
    mem = psutil.virtual_memory().total
    machine = f"{cpu_detail()}, {os.cpu_count()} cores, {mem / 2**30:.1f} GiB RAM, " + (
        platform.platform()
    )
    capped = [r.get("capped") for res in runs.values() for r in res.values() if "capped" in r]
    how = next((r.get("cold", {}).get("how") for res in runs.values() for r in res.values()), "")
    md = [
        "# Bigger than RAM: colibri and llama.cpp under one memory cap",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine}  ",
        "Scale: "
        + (
            "**reduced** ("
            + "; ".join(
                f"{shape}: " + ", ".join(f"{k} {v}" for k, v in given.items())
                for shape, given in reduced.items()
            )
            + ")"
            if reduced
            else "full (the configs' own sizes)"
        )
        + "  ",
        f"Prompt {args.prompt} tokens; {args.tokens} tokens sampled at temperature 1 (seed "
        f"{args.seed}); {args.greedy} greedy tokens compared. Cold page cache before each run "
        f"({how}).  ",
    ]
    if not all(capped):
        whys = {r.get("uncapped_why") for res in runs.values() for r in res.values()}
        md.append(f"**Some runs are uncapped**: no memory cgroup could be made ({whys}).  ")
    for shape, info in shape_info.items():
        md.append(
            f"- {shape}: {info['layers']} layers x {info['experts']} experts top-{info['top_k']}, "
            f"hidden {info['hidden']}, expert width {info['moe_ff']}, vocab {info['vocab']}; "
            f"checkpoint {info['checkpoint_bytes'] / 1e9:.2f} GB ({info['dtype']})"
            + (
                f", GGUF {info['gguf_bytes'] / 1e9:.2f} GB ({info['gguf_dtype']})"
                if info["gguf_bytes"]
                else ""
            )
            + f"; cap **{info['cap_bytes'] / 1e9:.2f} GB** (checkpoint "
            f"{info['checkpoint_over_cap']:.2f}x the cap"
            + (f", GGUF {info['gguf_over_cap']:.2f}x" if info["gguf_over_cap"] else "")
            + f"); disk probed at {', '.join(f'{p:.2f}' for p in info['disk_gb_s_probes'])} "
            f"GB/s (cold pread, before and after); the disk's read-ahead "
            f"{info['read_ahead_kb']} KiB (what a fault on a mapped file reads around it)"
        )
    md += ["", markdown_table(df), ""]
    summary = summarize(runs, shape_info)
    md += ["## Summary", "", *summary, ""]
    md.append(
        "Columns: read MB/tok: bytes the worker read from storage a decoded token "
        "(/proc/self/io read_bytes); store MB/tok: colibri's expert store's own count; "
        "experts/tok: (layer, expert) pairs a token touches; distinct/layer: experts of one "
        "layer the whole sampled decode touched (mean over layers); reuse %: share of a "
        "token's experts the token before touched; I/O wait and compute: colibri's timers "
        "(t_ewait; t_attn + t_emm + t_head) a token; bound: 1 / max(miss bytes a token / disk "
        "GB/s, compute a token); greedy agree: leading greedy tokens llama.cpp shares with "
        "colibri; cgroup peak: the cgroup's high-water mark, page cache included; anon peak: "
        "its anonymous memory, polled every 0.2 s; VmHWM: the worker's own peak resident set."
    )
    data = {
        "command": command,
        "machine": machine,
        "cpu": cpu_detail(),
        "cores": os.cpu_count(),
        "ram_bytes": mem,
        "reduced": reduced,
        "args": vars(args),
        "shapes": shape_info,
        "runs": runs,
        "rows": rows,
        "summary": summary,
    }
    print("\n".join(md))
    write_report(RESULTS, args.stem, md, json.loads(json.dumps(data, default=float)))


def summarize(runs: dict, info: dict) -> list[str]:
    """A few lines per shape, from the figures measured."""
    lines = []
    for shape, res in runs.items():
        ours, i = res["colibri"], info[shape]
        if ours.get("outcome") != "ok":
            lines.append(
                f"- {shape}: colibri **{ours.get('outcome')}** (in phase {ours.get('phase')}, "
                f"{ours.get('oom_kills', 0)} OOM kills)."
            )
        else:
            b, cap, d = i["bound"], i["cap_bytes"], ours["decode"]
            peak, anon = ours.get("cgroup_peak_bytes"), ours.get("cgroup_peak_anon_bytes")
            lines.append(
                f"- {shape}: colibri {ours['decode_tok_s']:.2f} tok/s at {ours['hit_pct']:.0f}% "
                f"hits = **{100 * ours['decode_tok_s'] / b['bound_tok_s']:.0f}%** of its bound "
                f"({b['bound_tok_s']:.2f} tok/s: {b['miss_bytes_per_token'] / 1e6:.0f} MB of "
                f"misses a token over {i['disk_gb_s']:.2f} GB/s = "
                f"{1e3 * b['io_s_per_token']:.0f} ms, compute {1e3 * b['compute_s_per_token']:.0f}"
                f" ms; a token took {1e3 / ours['decode_tok_s']:.0f} ms, "
                f"{1e3 * d['t_ewait']:.0f} of them waiting on reads); "
                f"{ours['slots_per_layer']}/{ours['experts_per_layer']} expert slots a layer "
                "from the automatic budgets; the decode touched "
                f"{ours['distinct_per_layer_run']:.0f} distinct experts a layer, a token "
                f"reusing {ours['reuse_pct']:.0f}% of the last one's; cgroup peak "
                + (f"{peak / 1e9:.2f} GB of a {cap / 1e9:.2f} GB cap" if peak else "not read")
                + (f" ({anon / 1e9:.2f} GB anonymous)" if anon else "")
                + f", {ours['oom_kills']} OOM kills."
            )
        for engine, r in res.items():
            if engine == "colibri":
                continue
            if r.get("outcome") != "ok":
                extra = f" (in phase {r['phase']})" if "phase" in r else ""
                lines.append(f"- {shape}: {engine} **{r.get('outcome')}**{extra}.")
                continue
            line = (
                f"- {shape}: {engine} {r['decode_tok_s']:.2f} tok/s, reading "
                f"{r['decode']['read_bytes'] / 1e6:.0f} MB a token from storage"
            )
            if ours.get("outcome") == "ok":
                read = ours["decode"]["read_bytes"]
                if read > 0:
                    line += f" ({r['decode']['read_bytes'] / read:.1f}x colibri's)"
                n = agreement(ours["greedy_tokens"], r["greedy_tokens"])
                line += (
                    f"; colibri / {engine} **{ours['decode_tok_s'] / r['decode_tok_s']:.2f}x**; "
                    f"TTFT {ours['ttft_s']:.2f} s against {r['ttft_s']:.2f} s; greedy tokens "
                    f"agree for {n}/{len(ours['greedy_tokens'])}"
                )
            lines.append(line + f"; {r['oom_kills']} OOM kills.")
    return lines


if __name__ == "__main__":
    main()
