"""python experiments/bench_peers.py [--rounds 2] [--tokens 64] [--prompt 128] [--shapes A,B]

colibri beside what its users would pick instead, on the same synthetic f32 checkpoints, in one
run: colibri (resident experts), transformers `generate` (greedy), and llama.cpp through
llama-cpp-python (`pip install -e '.[bench]'`, skipped when absent) on the checkpoint converted
to GGUF as f32 and q8_0. Each configuration runs in its own worker process (so peak RSS is its
own) and the configurations alternate over --rounds rounds, best round kept, so that load from
other processes falls on each of them alike. `make bench` runs this with the defaults.

Measured per configuration: load seconds; prefill tok/s and TTFT for a --prompt-token prompt;
greedy decode tok/s at batch 1 over --tokens tokens; for colibri also the aggregate tok/s of 4
and 16 rows decoding at once (16 KV slots); peak RSS. colibri decodes as its engine decodes
greedy requests on these models: bursts of BURST steps a forward, cuttable (a step here takes
longer than BURST_MS / BURST); its rate with one step a forward is reported beside. colibri
measures 1, 4 and 16 rows in PASSES passes a round; the ratios to batch 1 are given both as
best rate over best rate and as the median of the ratios within a pass (every pass of every
round: rates a few seconds apart, in the same phase of the machine). Every configuration's
greedy tokens are compared with colibri's (f32 peers should agree; q8_0 need not).

The roofline (memory only): bytes of weights one decode step touches (attention, router, the
experts chosen, lm_head; f32) divided by the memory bandwidth measured in the same run (the
best of numpy reductions on every core, an OpenBLAS and an XLA matrix-vector product and
colibri's own linear kernel on one row, over 1 GiB on huge pages): once against the best
probe of the run (before and after the rounds), and once paired, each round's colibri rate
against a probe run in its own process just before it (the median of the rounds' ratios; the
machine's bandwidth moves by a quarter within minutes). At 4 and 16 rows the experts touched
are the distinct experts colibri's routers chose, counted per layer, and the table of several
conversations counts their keys and values too (a 16-row step's rows attend over 16 contexts:
7-22% of its bytes here), with the GB/s each batch size moves. A step of 16 rows is as much
arithmetic as memory traffic (8 FLOP a byte of the experts many rows chose), so that table also
gives the tok/s its FLOPs allow at the rate of colibri's linear kernel on 16 rows streaming the
probe's 1 GiB (both cores); and what 16 slots at 6x batch 1 would have to move and compute.
llama.cpp runs with an f32 KV cache, as colibri keeps.
Writes experiments/results/peers.md and peers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd

from colibri import hugepages, kernels
from colibri.engine.settings import EngineSettings
from colibri.report import markdown_table
from colibri.synth import SynthSpec, synthesize

SHAPES = {
    # ~0.5B parameters: 8 layers x 64 experts of 3 x 768 x 384, top-8.
    "qwen3_moe": SynthSpec(
        family="qwen3_moe",
        layers=8,
        experts=64,
        top_k=8,
        hidden=768,
        moe_ff=384,
        vocab=8192,
        kv_heads=4,
        dtype="f32",
        seed=0,
        shard_mb=1024,
    ),
    # ~0.4B parameters: 8 layers x 64 experts of 3 x 512 x 512, top-8; OLMoE has no grouped
    # KV heads (llama.cpp's olmoe expects full-width k norms).
    "olmoe": SynthSpec(
        family="olmoe",
        layers=8,
        experts=64,
        top_k=8,
        hidden=512,
        moe_ff=512,
        vocab=8192,
        kv_heads=8,
        dtype="f32",
        seed=1,
        shard_mb=1024,
    ),
}
PEERS = ["colibri", "transformers", "llama.cpp f32", "llama.cpp q8_0"]
BURST = EngineSettings().burst  # greedy steps a forward, as the engine takes them
PASSES = 3  # colibri's passes over 1, 4 and 16 rows in each round (see work_colibri)
CACHE = Path(".cache/bench-peers")
RESULTS = Path(__file__).parent / "results"


def prompt_ids(vocab: int, n: int) -> list[int]:
    """A fixed prompt of n token ids drawn from the tokenizer's byte range and merges."""
    return np.random.default_rng(7).integers(0, min(vocab, 4096), n).tolist()


def peak_rss_mb() -> float:
    from colibri.engine.hwinfo import peak_rss_gb

    return peak_rss_gb() * 1024


# -- workers (one per process) ----------------------------------------------------------------


def other_conversations(runner, prompt: list[int], slots: int) -> list[int]:
    """Fill slots 1..slots-1 with other conversations, slot 0 holding `prompt`: the prompt with
    its last 8 tokens changed (slot 0's KV copied up to there). Their first greedy tokens."""
    head = len(prompt) - 8
    kv = runner.export_slot(0, head)
    rng = np.random.default_rng(1)
    firsts = []
    for s in range(1, slots):
        runner.import_slot(s, kv)
        tail = rng.integers(0, min(runner.model.cfg.vocab_size, 4096), 8).tolist()
        logits, _ = runner.prefill(s, tail, start=head)
        firsts.append(int(np.argmax(logits)))
    return firsts


def work_colibri(ckpt: Path, prompt: list[int], tokens: int) -> dict:
    from colibri.engine.model import load_model
    from colibri.engine.runner import Row, Runner

    t0 = time.perf_counter()
    model = load_model(ckpt, progress=False)
    assert model.store.all_resident, "the benchmark wants every expert resident"
    runner = Runner(model, slots=16, capacity=len(prompt) + tokens + 8)
    load_s = time.perf_counter() - t0

    runner.prefill(0, prompt)  # compiles
    t0 = time.perf_counter()
    logits, _ = runner.prefill(0, prompt)
    first = int(np.argmax(logits))
    ttft = time.perf_counter() - t0
    firsts = [first, *other_conversations(runner, prompt, 16)]

    def decode(rows: int, n: int, burst: int) -> tuple[float, list[int], list[int]]:
        """n greedy steps of slots 0..rows-1: tok/s, slot 0's tokens, distinct experts per MoE
        layer (mean over steps). burst 1: one step a forward, each forward fed the previous
        one's greedy tokens on the device; burst > 1: as the engine decodes greedy requests on
        these models (cuttable bursts of `burst` steps, the next one dispatched when one
        lands; Scheduler._burst)."""
        out, seen = [first], []  # (routes counted after the clock stops)
        t = time.perf_counter()
        if burst > 1:
            toks, done = firsts[:rows], 0
            while done < n:
                at = [Row(s, toks[s], len(prompt) + done) for s in range(rows)]
                fwd = runner.decode_async(at, steps=burst, cuttable=True)
                greedy = fwd.tokens()
                seen += list(fwd.result()[1])
                toks, done = greedy[-1].tolist(), done + fwd.ran()
                out += greedy[:, 0].tolist()
            rate = rows * done / (time.perf_counter() - t)
        else:
            fwd = runner.decode_async([Row(s, firsts[s], len(prompt)) for s in range(rows)])
            for i in range(1, n + 1):
                chained = [Row(s, -1, len(prompt) + i, take=s) for s in range(rows)]
                nxt = runner.decode_async(chained, after=fwd) if i < n else None
                seen.append(fwd.result()[1])
                out.append(int(fwd.greedy()[0]))
                fwd = nxt
            rate = rows * n / (time.perf_counter() - t)
        distinct = [[len(np.unique(r[:rows])) for r in step] for step in seen]
        return rate, out[: n + 1], np.mean(distinct, axis=0).tolist()

    res = {"load_s": load_s, "ttft_s": ttft, "prefill_tok_s": len(prompt) / ttft}
    sizes, kinds = (1, 4, 16), ((1, "_single"), (BURST, ""))
    for rows in sizes:
        for burst, _ in kinds:
            decode(rows, tokens, burst)  # compiles every KV bucket the measured passes meet
    # PASSES passes over every size: the rates of one pass are close together in time, so
    # the ratios of a pass (4 or 16 rows against 1) are not those of two phases of a machine
    # whose speed moves by a quarter within minutes. Rates reported: the best pass.
    passes = []
    for i in range(PASSES):
        rates = {}
        for rows in sizes:
            for burst, key in kinds:
                rate, out, distinct = decode(rows, tokens, burst)
                rates[f"decode_tok_s_{rows}{key}"] = rate
                if i or not key:
                    continue
                res[f"distinct_experts_{rows}"] = distinct
                if rows == 1:
                    res["tokens"] = out
                else:
                    # Slot 0 holds the batch-1 conversation: batching must not change its text.
                    res[f"batch_{rows}_equals_batch_1"] = out == res["tokens"]
        passes.append(rates)
    for k in passes[0]:
        res[k] = max(p[k] for p in passes)
    for rows in sizes[1:]:
        key = f"decode_tok_s_{rows}"
        res[f"x_vs_1_by_pass_{rows}"] = [p[key] / p["decode_tok_s_1"] for p in passes]
    return res


def work_transformers(ckpt: Path, prompt: list[int], tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    ids = torch.tensor([prompt])

    def gen(n: int) -> tuple[float, list[int]]:
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )
        return time.perf_counter() - t, out[0, len(prompt) :].tolist()

    gen(2)  # warm-up
    ttft, _ = gen(1)
    total, out = gen(tokens + 1)
    return {
        "load_s": load_s,
        "ttft_s": ttft,
        "prefill_tok_s": len(prompt) / ttft,
        "decode_tok_s_1": tokens / (total - ttft),
        "tokens": out,
    }


def work_llama(gguf: Path, prompt: list[int], tokens: int) -> dict:
    from colibri.gguf import llama_generate

    t0 = time.perf_counter()
    # An f32 KV cache, as colibri keeps (llama.cpp's default f16 cache moves logits by ~1e-3).
    out, timings = llama_generate(
        gguf, prompt, tokens + 1, n_threads=os.cpu_count() or 1, kv_type="f32"
    )
    wall = time.perf_counter() - t0
    return {
        "load_s": timings["load_s"],
        "ttft_s": timings["prefill_s"],
        "prefill_tok_s": len(prompt) / timings["prefill_s"],
        "decode_tok_s_1": tokens / timings["decode_s"],
        "tokens": out,
        "wall_s": wall,
    }


def worker(args) -> None:
    if args.worker == "bandwidth":
        Path(args.out).write_text(json.dumps(memory_bandwidth()))
        return
    prompt = json.loads(args.prompt_ids)
    if args.worker == "colibri":
        res = work_colibri(Path(args.path), prompt, args.tokens)
    elif args.worker == "transformers":
        res = work_transformers(Path(args.path), prompt, args.tokens)
    else:
        res = work_llama(Path(args.path), prompt, args.tokens)
    res["peak_rss_mb"] = peak_rss_mb()
    Path(args.out).write_text(json.dumps(res))


# -- the machine ----------------------------------------------------------------------------


def memory_bandwidth(gib: float = 1.0, repeats: int = 5) -> dict:
    """Read bandwidth GB/s: the best of numpy sums over every core's share, OpenBLAS gemv,
    XLA's matrix-vector product (x @ A, A [K, N]: its fastest layout here) and colibri's own
    linear kernel on one row (its streams a quarter of the matrix apart read faster than one
    sequential pass here). The array is on huge pages, as colibri's experts are
    (colibri/hugepages.py). Also the arithmetic rate of that kernel on 16 rows over the same
    array (`kernel_16_gflop_s`): what the cores compute when every weight meets 16 inputs as it
    streams in from DRAM."""
    threads = os.cpu_count() or 1
    a = hugepages.empty(int(gib * (1 << 30)) // 4, np.float32)
    a[:] = 1.0
    parts = np.array_split(a, threads)
    best_sum = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            t = time.perf_counter()
            list(pool.map(np.sum, parts))
            best_sum = max(best_sum, a.nbytes / (time.perf_counter() - t) / 1e9)
    m = a.reshape(-1, 4096)
    v = np.ones(4096, np.float32)
    best_gemv = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        m @ v
        best_gemv = max(best_gemv, a.nbytes / (time.perf_counter() - t) / 1e9)
    import jax
    import jax.numpy as jnp

    dev = jnp.asarray(m.reshape(4096, -1))  # the same memory (JAX takes it without a copy)
    vec = jnp.ones((1, 4096), jnp.float32)
    xla_gemv = jax.jit(lambda a, x: x @ a)
    xla_gemv(dev, vec).block_until_ready()
    best_xla = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        xla_gemv(dev, vec).block_until_ready()
        best_xla = max(best_xla, a.nbytes / (time.perf_counter() - t) / 1e9)
    del dev
    best_kernel = best_16 = 0.0
    if kernels.available():
        w = jnp.asarray(m)  # [rows, 4096], the same memory again
        kernel_gemv = jax.jit(kernels.linear)
        kernel_gemv(vec, w).block_until_ready()
        for _ in range(repeats):
            t = time.perf_counter()
            kernel_gemv(vec, w).block_until_ready()
            best_kernel = max(best_kernel, a.nbytes / (time.perf_counter() - t) / 1e9)
        rows16 = jnp.ones((16, 4096), jnp.float32)
        kernel_gemv(rows16, w).block_until_ready()
        for _ in range(repeats):
            t = time.perf_counter()
            kernel_gemv(rows16, w).block_until_ready()
            best_16 = max(best_16, 16 * 2 * a.size / (time.perf_counter() - t) / 1e9)
        del w
    return {
        "sum_gb_s": best_sum,
        "gemv_gb_s": best_gemv,
        "xla_gemv_gb_s": best_xla,
        "kernel_gemv_gb_s": best_kernel,
        "gb_s": max(best_sum, best_gemv, best_xla, best_kernel),
        "kernel_16_gflop_s": best_16,
    }


def step_bytes(cfg, experts_per_layer: list[float], rows: int) -> float:
    """f32 bytes of weights one decode step of `rows` rows reads (each weight once)."""
    D, V = cfg.hidden, cfg.vocab_size
    q = cfg.num_heads * cfg.head_dim
    kv = 2 * cfg.num_kv_heads * cfg.head_dim
    attn = D * q + D * kv + q * D + 2 * D  # projections and norms (q/k norms are tiny)
    m = cfg.moe
    per_expert = 3 * D * m.moe_ff
    params = cfg.num_layers * (attn + D * m.num_experts)  # + router
    params += sum(e * per_expert for e in experts_per_layer)
    params += rows * D + V * D + D  # embedding rows, lm_head, final norm
    return 4.0 * params


def mean_context(prompt: int, tokens: int) -> float:
    """Positions a decode step attends over, the mean over the benchmark's steps (step i, from
    0, attends over prompt + i + 1)."""
    return prompt + (tokens + 1) / 2


def step_flops(cfg, rows: int, prompt: int, tokens: int) -> float:
    """FLOPs of one decode step of `rows` conversations: projections, routers, every routed
    expert assignment, lm_head, and attention over the mean context."""
    D, V, L = cfg.hidden, cfg.vocab_size, cfg.num_layers
    q = cfg.num_heads * cfg.head_dim
    kv = 2 * cfg.num_kv_heads * cfg.head_dim
    m = cfg.moe
    per_row = L * (D * q + D * kv + q * D + D * m.num_experts + m.top_k * 3 * D * m.moe_ff)
    per_row += V * D
    per_row += L * 2 * q * mean_context(prompt, tokens)  # scores and weighted values
    return 2.0 * rows * per_row


def kv_bytes(cfg, rows: int, prompt: int, tokens: int) -> float:
    """f32 bytes of keys and values one decode step of `rows` conversations reads over the
    mean context."""
    per_position = 2 * cfg.num_kv_heads * cfg.head_dim * 4 * cfg.num_layers
    return rows * per_position * mean_context(prompt, tokens)


# -- the run --------------------------------------------------------------------------------


def ensure_inputs(name: str, spec: SynthSpec, with_llama: bool) -> dict[str, Path]:
    ckpt = CACHE / name
    if not (ckpt / "config.json").exists():
        synthesize(spec, ckpt)
    paths = {"colibri": ckpt, "transformers": ckpt}
    if with_llama:
        from colibri.gguf import export_gguf

        for peer, dtype in (("llama.cpp f32", "f32"), ("llama.cpp q8_0", "q8_0")):
            out = CACHE / f"{name}-{dtype}.gguf"
            if not out.exists():
                export_gguf(ckpt, out, dtype=dtype)
            paths[peer] = out
    return paths


def run_worker(peer: str, path: Path, prompt: list[int], tokens: int) -> dict:
    out = CACHE / f"worker-{os.getpid()}.json"
    kind = "llama" if peer.startswith("llama") else peer
    cmd = [sys.executable, __file__, "--worker", kind, "--path", str(path)]
    cmd += ["--tokens", str(tokens), "--prompt-ids", json.dumps(prompt), "--out", str(out)]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    res = json.loads(out.read_text())
    out.unlink()
    print(
        f"  {peer:16s} decode {res['decode_tok_s_1']:7.2f} tok/s  prefill "
        f"{res['prefill_tok_s']:8.1f} tok/s  rss {res['peak_rss_mb']:6.0f} MB  "
        f"({time.perf_counter() - t:.0f} s)",
        flush=True,
    )
    return res


def run_probe() -> dict:
    """memory_bandwidth() in a process of its own, as each configuration runs."""
    out = CACHE / f"probe-{os.getpid()}.json"
    cmd = [sys.executable, __file__, "--worker", "bandwidth", "--out", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    res = json.loads(out.read_text())
    out.unlink()
    print(f"  {'bandwidth probe':16s} {res['gb_s']:7.2f} GB/s", flush=True)
    return res


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


def agreement(a: list[int], b: list[int]) -> int:
    """Leading greedy tokens two runs share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-ids", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    from colibri.config import load_config
    from colibri.engine.hwinfo import host

    try:
        import llama_cpp  # noqa: F401

        with_llama = True
    except ImportError:
        with_llama = False
        print("llama-cpp-python is not installed (pip install -e '.[bench]'): llama.cpp skipped")
    peers = [p for p in PEERS if with_llama or not p.startswith("llama")]
    CACHE.mkdir(parents=True, exist_ok=True)
    names = args.shapes.split(",")
    inputs = {name: ensure_inputs(name, SHAPES[name], with_llama) for name in names}
    bw = memory_bandwidth()
    print(f"memory bandwidth: {bw['gb_s']:.1f} GB/s", flush=True)
    runs: dict[tuple[str, str], list[dict]] = {}
    for rnd in range(args.rounds):
        for name in names:
            prompt = prompt_ids(SHAPES[name].vocab, args.prompt)
            order = peers[rnd % len(peers) :] + peers[: rnd % len(peers)]  # rotate the order
            print(f"round {rnd + 1}/{args.rounds}, {name}", flush=True)
            for peer in order:
                if peer == "colibri":  # the roofline of this very round (paired below)
                    runs.setdefault((name, "probe"), []).append(run_probe())
                res = run_worker(peer, inputs[name][peer], prompt, args.tokens)
                runs.setdefault((name, peer), []).append(res)
    bw = {"before": bw, "after": memory_bandwidth()}
    gb_s = max(bw["before"]["gb_s"], bw["after"]["gb_s"])
    gflop_s = max(bw["before"]["kernel_16_gflop_s"], bw["after"]["kernel_16_gflop_s"])

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
        summary[name]["roofline_paired"] = {"gb_s": probes, "colibri_ratio": ratios}
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
        # What a step of b rows reads: the weights it touches, and its rows' keys and values
        # (at 16 rows, 7-22% of the bytes on these shapes; at one row 1-2%).
        moved = {
            b: step_bytes(cfg, col[f"distinct_experts_{b}"], b)
            + kv_bytes(cfg, b, args.prompt, args.tokens)
            for b in (1, 4, 16)
        }
        flops = {b: step_flops(cfg, b, args.prompt, args.tokens) for b in (1, 4, 16)}
        summary[name]["step_bytes"] = moved
        summary[name]["step_flops"] = flops
        by_pass = {  # every pass of every round
            b: [x for r in runs[(name, "colibri")] for x in r[f"x_vs_1_by_pass_{b}"]]
            for b in (4, 16)
        }
        summary[name]["x_vs_1_by_pass"] = by_pass
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
                }
            )
    batch = pd.DataFrame(batch_rows)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    print(batch.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    write_results(args, host(), bw, gb_s, gflop_s, table, batch, summary)


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


def write_results(
    args, hw, bw: dict, gb_s: float, gflop_s: float, table, batch, summary: dict
) -> None:
    probes = "; ".join(
        f"{when}: numpy sums {b['sum_gb_s']:.1f}, OpenBLAS gemv {b['gemv_gb_s']:.1f}, "
        f"XLA gemv {b['xla_gemv_gb_s']:.1f}, colibri linear kernel {b['kernel_gemv_gb_s']:.1f} "
        f"(on 16 rows: {b['kernel_16_gflop_s']:.1f} GFLOP/s)"
        for when, b in bw.items()
    )
    machine = (
        f"{hw.cores} cores, {hw.cpu_name}, {hw.ram_total_gb:.0f} GB RAM; memory bandwidth "
        f"{gb_s:.1f} GB/s, the best probe before and after the runs ({probes})"
    )
    shapes = {
        n: f"synthetic {s.family}: {s.layers} layers x {s.experts} experts (top-{s.top_k}), "
        f"hidden {s.hidden}, moe_ff {s.moe_ff}, vocab {s.vocab}, f32"
        for n, s in SHAPES.items()
        if n in summary
    }
    cmd = (
        f"python experiments/bench_peers.py --rounds {args.rounds} --tokens {args.tokens} "
        f"--prompt {args.prompt}"
    )
    paired = []
    for n, res in summary.items():
        pr = res["roofline_paired"]
        rounds = zip(pr["colibri_ratio"], pr["gb_s"], strict=True)
        paired.append(f"{n} " + ", ".join(f"{r:.2f} ({g:.1f} GB/s)" for r, g in rounds))
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
        f"runs; colibri / roofline per round (probe): {'; '.join(paired)}.",
        "",
        markdown_table(table, index=False),
        "",
        "## colibri with several conversations decoding at once",
        "",
        markdown_table(batch, index=False),
        "",
        "Bytes a step: the weights it touches (the distinct experts chosen) and its "
        "conversations' keys and values (f32, the mean over the steps); GB/s moved: at the "
        "aggregate rate. Roofline, memory: bytes a step over the best bandwidth probe. The "
        "last column: FLOPs a step at the rate of colibri's linear kernel on 16 rows streaming "
        f"1 GiB from DRAM on both cores ({gflop_s:.1f} GFLOP/s, the best probe), a reference "
        "rather than a roof (the expert calls' shapes can run faster or slower). "
        f"{six_times(summary, gb_s, gflop_s)}",
        "",
    ]
    (RESULTS / "peers.md").write_text("\n".join(md))
    (RESULTS / "peers.json").write_text(
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
    print(f"wrote {RESULTS / 'peers.md'}")


if __name__ == "__main__":
    main()
