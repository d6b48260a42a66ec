"""Each peers configuration in a process of its own, so that peak RSS is its own: the work one
process does (colibri, transformers, llama.cpp, or the bandwidth probe), and the parent's side,
which starts `python -m colibri.bench.workers` and reads back what it wrote."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from colibri.bench.accounting import distinct_experts, held_step_bytes
from colibri.bench.anatomy import decode_bursts
from colibri.bench.bandwidth import call_rate, memory_bandwidth, widen_rate
from colibri.bench.conversations import BURST, STREAM_MS, other_conversations
from colibri.bench.shapes import CACHE

PASSES = 3  # colibri's passes over 1, 4 and 16 rows in each round (see work_colibri)


def peak_rss_mb() -> float:
    from colibri.engine.hwinfo import peak_rss_gb

    return peak_rss_gb() * 1024


# -- in the worker process --------------------------------------------------------------------


def work_colibri(ckpt: Path, prompt: list[int], tokens: int) -> dict:
    from colibri import kernels
    from colibri.engine.model import load_model
    from colibri.engine.runner import Row, Runner
    from colibri.formats import Holding

    t0 = time.perf_counter()
    model = load_model(ckpt, progress=False, holding=Holding.from_env(os.environ))
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
        these models (anatomy.decode_bursts: cuttable bursts of up to `burst` steps, as STREAM_MS
        allows, the next one dispatched when one lands)."""
        out, seen = [first], []  # (routes counted after the clock stops)
        if burst > 1:
            steps: list[list[int]] = []
            rate = decode_bursts(
                runner, firsts[:rows], len(prompt), n, burst, seen, steps, STREAM_MS
            )
            out += [toks[0] for toks in steps]
        else:
            t = time.perf_counter()
            fwd = runner.decode_async([Row(s, firsts[s], len(prompt)) for s in range(rows)])
            for i in range(1, n + 1):
                chained = [Row(s, -1, len(prompt) + i, take=s) for s in range(rows)]
                nxt = runner.decode_async(chained, after=fwd) if i < n else None
                seen.append(fwd.result()[1])
                out.append(int(fwd.greedy()[0]))
                fwd = nxt
            rate = rows * n / (time.perf_counter() - t)
        return rate, out[: n + 1], distinct_experts(seen, rows)

    res = {"load_s": load_s, "ttft_s": ttft, "prefill_tok_s": len(prompt) / ttft}
    top_k = [model.cfg.moe.top_k] * len(model.experts)
    res["held_step_bytes_1"] = held_step_bytes(model.params, model.experts, top_k)
    res["expert_step_bytes_1"] = held_step_bytes({}, model.experts, top_k)
    if kernels.available():
        res["widen_gb_s"] = expert_widen_rate(model)
        res["stream_gb_s"] = expert_stream_rate(model)
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


def expert_widen_rate(model) -> float:
    """GB/s at which the cores together put rows of the routed experts, as held, through the
    kernels' one-row tiles with them in L2 (bandwidth.widen_rate): the first layer's first
    expert's gate rows, ~256 KiB of them."""
    gate = model.experts[0]["gate"][0]
    rows = max(8, (256 << 10) // (gate.nbytes // gate.shape[0]))
    return widen_rate(gate[:rows], model.cfg.hidden)


def every_expert_call(model, rows: int = 1):
    """(call, bytes): a call that routes `rows` tokens each to every expert of every layer
    through the expert kernel, all the experts' rows as held streaming from memory at that
    many rows an expert (together far more than the caches hold; compiled and run once here),
    and the bytes it reads."""
    import jax
    import jax.numpy as jnp

    from colibri import kernels

    experts = [{k: layer[k] for k in ("gate", "up", "down")} for layer in model.experts]
    every = jnp.arange(experts[0]["gate"].shape[0], dtype=jnp.int32)
    ids = jnp.broadcast_to(every, (rows, every.size))

    @jax.jit
    def every_expert(x, experts):
        return jnp.stack(
            [kernels.moe_experts(e["gate"], e["up"], e["down"], x, ids)[0, 0, 0] for e in experts]
        )

    # Inputs of ordinary size, different row to row (ones would do as well for the timing).
    x = jnp.cos(jnp.arange(rows * model.cfg.hidden, dtype=jnp.float32)).reshape(rows, -1)
    every_expert(x, experts).block_until_ready()
    nbytes = sum(a.nbytes for e in experts for a in e.values())
    return (lambda: every_expert(x, experts).block_until_ready()), nbytes


def expert_stream_rate(model, passes: int = 3) -> float:
    """GB/s at which the expert kernel, on every core, streams the routed experts' rows as held
    from memory at one row (`every_expert_call`); the best of `passes`. Where the rows are
    widened (int8, int4) this is what the widening lets both cores stream while they read; for
    float32 rows, about the memory's own rate (experiments/bench_held_streams.py)."""
    return call_rate(*every_expert_call(model), passes)


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


def work_llama(
    gguf: Path, prompt: list[int], tokens: int, conversations: list[list[int]] | None = None
) -> dict:
    """Batch 1, then, given `conversations` (colibri's, `conversation_prompts`), their first 4
    and all 16 decoding together (`llama_generate_parallel`)."""
    from colibri.gguf import llama_generate, llama_generate_parallel

    threads = os.cpu_count() or 1
    t0 = time.perf_counter()
    # An f32 KV cache, as colibri keeps (llama.cpp's default f16 cache moves logits by ~1e-3).
    out, timings = llama_generate(gguf, prompt, tokens + 1, n_threads=threads, kv_type="f32")
    wall = time.perf_counter() - t0
    res = {
        "load_s": timings["load_s"],
        "ttft_s": timings["prefill_s"],
        "prefill_tok_s": len(prompt) / timings["prefill_s"],
        "decode_tok_s_1": tokens / timings["decode_s"],
        "tokens": out,
        "wall_s": wall,
    }
    for rows in (4, 16) if conversations else ():
        outs, t = llama_generate_parallel(
            gguf, conversations[:rows], tokens + 1, n_threads=threads, kv_type="f32"
        )
        res[f"decode_tok_s_{rows}"] = t["decode_tok_s"]
        res[f"batch_{rows}_tokens_0"] = outs[0]  # its first conversation, batch 1's prompt
    return res


def worker(args) -> None:
    if args.worker == "bandwidth":
        columns = tuple(int(c) for c in args.columns.split(",") if c) if args.columns else ()
        Path(args.out).write_text(json.dumps(memory_bandwidth(columns=columns)))
        return
    prompt = json.loads(args.prompt_ids)
    if args.worker == "colibri":
        res = work_colibri(Path(args.path), prompt, args.tokens)
    elif args.worker == "transformers":
        res = work_transformers(Path(args.path), prompt, args.tokens)
    else:
        conversations = json.loads(args.conversations) if args.conversations else None
        res = work_llama(Path(args.path), prompt, args.tokens, conversations)
    res["peak_rss_mb"] = peak_rss_mb()
    Path(args.out).write_text(json.dumps(res))


def main() -> None:
    ap = argparse.ArgumentParser(description="one peers configuration (run by run_worker)")
    ap.add_argument(
        "--worker", required=True, choices=("colibri", "transformers", "llama", "bandwidth")
    )
    ap.add_argument("--path")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-ids")
    ap.add_argument("--conversations", help="llama: prompts (JSON) to decode together as well")
    ap.add_argument(
        "--columns", help="bandwidth: row widths (comma-separated) to time the 16-row kernel on"
    )
    ap.add_argument("--out", required=True)
    worker(ap.parse_args())


# -- in the parent ----------------------------------------------------------------------------


def worker_command(kind: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "colibri.bench.workers", "--worker", kind, "--out", str(out)]


def run_worker(
    peer: str,
    path: Path,
    prompt: list[int],
    tokens: int,
    env: dict[str, str] | None = None,
    tree: Path | None = None,
    conversations: list[list[int]] | None = None,
) -> dict:
    """One run of `peer` on `path` in a process of its own (`env`: variables added to this
    process's, e.g. COLIBRI_BF16=products for a colibri run; `tree`: a checkout of colibri
    whose code the worker runs, instead of this one's; `conversations`: for llama.cpp, the
    prompts it also decodes 4 and 16 at a time)."""
    out = (CACHE / f"worker-{os.getpid()}.json").resolve()
    kind = "llama" if peer.startswith("llama") else peer
    cmd = worker_command(kind, out) + ["--path", str(Path(path).resolve())]
    cmd += ["--tokens", str(tokens), "--prompt-ids", json.dumps(prompt)]
    if conversations and kind == "llama":
        cmd += ["--conversations", json.dumps(conversations)]
    env = {**os.environ, **(env or {})}
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env, cwd=tree)
    res = json.loads(out.read_text())
    out.unlink()
    print(
        f"  {peer:16s} decode {res['decode_tok_s_1']:7.2f} tok/s  prefill "
        f"{res['prefill_tok_s']:8.1f} tok/s  rss {res['peak_rss_mb']:6.0f} MB  "
        f"({time.perf_counter() - t:.0f} s)",
        flush=True,
    )
    return res


def run_probe(columns: tuple[int, ...] = ()) -> dict:
    """memory_bandwidth() in a process of its own, as each configuration runs; `columns`: its
    16-row kernel's rate over rows of those widths too."""
    out = CACHE / f"probe-{os.getpid()}.json"
    cmd = worker_command("bandwidth", out)
    if columns:
        cmd += ["--columns", ",".join(map(str, columns))]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    res = json.loads(out.read_text())
    out.unlink()
    print(f"  {'bandwidth probe':16s} {res['gb_s']:7.2f} GB/s", flush=True)
    return res


if __name__ == "__main__":
    main()
