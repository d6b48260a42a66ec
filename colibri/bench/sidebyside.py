"""colibri beside a peer on the same model: batch-1 greedy decode and 16 conversations decoding
together, each engine in a process of its own (colibri.bench.workers), the order flipping every
round, colibri against the roofline of the bytes it holds; and how many leading greedy tokens two
runs share."""

from __future__ import annotations

from pathlib import Path

from colibri.bench.accounting import streaming_bound
from colibri.bench.conversations import conversation_prompts, prompt_ids
from colibri.bench.workers import run_probe, run_worker
from colibri.config import load_config


def agreement(a: list[int], b: list[int]) -> int:
    """Leading greedy tokens two runs share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def side_by_side(
    name: str,
    paths: dict[str, Path],
    rounds: int,
    tokens: int = 64,
    envs: dict[str, dict[str, str]] | None = None,
) -> list[dict]:
    """Batch-1 greedy decode of `tokens` tokens after a 128-token prompt by each engine on its
    checkpoint (label -> path; the first a colibri checkpoint, labels starting "colibri" or
    "llama.cpp"; `envs`: label -> variables its runs get, e.g. COLIBRI_BF16=products), each
    run in a process of its own (workers.run_worker), the order flipping
    every round: each engine's best round, against the first engine's; and the same for the
    aggregate rate of 16 conversations decoding together (conversations.conversation_prompts:
    colibri's 16 slots, llama.cpp's 16 sequences). Each colibri run comes
    right after a bandwidth probe in a process of its own (workers.run_probe): its rate against
    the roofline of that probe, the bytes a step reads as colibri holds the weights
    (accounting.held_step_bytes) over the probe's rate, round by round; and the most of that
    roofline its arithmetic allows: a step's experts take at least the time the cores need to
    put the chosen experts' rows through the kernels' tiles from L2 (workers.expert_widen_rate),
    however well streaming hides behind it, and the rest of the step at least its reading (at
    most 1). And
    the most the kernels allow while they stream: the chosen experts' bytes at the rate both
    cores stream experts' rows through the expert kernel from memory at one row
    (workers.expert_stream_rate, in the same process), the rest of the step's bytes at the
    probe's rate."""
    first = next(iter(paths))
    vocab = load_config(paths[first]).vocab_size
    prompt = prompt_ids(vocab, 128)
    conversations = conversation_prompts(prompt, 16, vocab)
    runs = {k: [] for k in paths}
    for r in range(rounds):
        for peer in list(paths) if r % 2 == 0 else list(paths)[::-1]:
            kind = "colibri" if peer.startswith("colibri") else "llama.cpp"
            probe = run_probe() if kind == "colibri" else None
            res = run_worker(
                kind,
                paths[peer],
                prompt,
                tokens,
                env=(envs or {}).get(peer),
                conversations=conversations,
            )
            if probe:
                roof = probe["gb_s"] * 1e9 / res["held_step_bytes_1"]
                res["roofline"] = {"gb_s": probe["gb_s"], "ratio": res["decode_tok_s_1"] / roof}
                if "widen_gb_s" in res:  # measured where the CPU kernels run
                    res["roofline"]["bound"] = streaming_bound(
                        res["held_step_bytes_1"],
                        res["expert_step_bytes_1"],
                        res["widen_gb_s"],
                        probe["gb_s"],
                    )
                if "stream_gb_s" in res:
                    res["roofline"]["stream_bound"] = streaming_bound(
                        res["held_step_bytes_1"],
                        res["expert_step_bytes_1"],
                        res["stream_gb_s"],
                        probe["gb_s"],
                    )
                    res["roofline"]["stream_gb_s"] = res["stream_gb_s"]
            runs[peer].append(res)
    ours = max(runs[first], key=lambda res: res["decode_tok_s_1"])
    best_16 = {k: max(x.get("decode_tok_s_16", 0.0) for x in res) for k, res in runs.items()}
    rows = []
    for peer, res in runs.items():
        best = max(res, key=lambda x: x["decode_tok_s_1"])
        roofs = [x["roofline"] for x in res if "roofline" in x]
        rows.append(
            {
                "model": name,
                "engine": peer,
                "decode tok/s (batch 1, best of rounds)": best["decode_tok_s_1"],
                "colibri / this": ours["decode_tok_s_1"] / best["decode_tok_s_1"],
                "decode tok/s, 16 conversations (best of rounds)": best_16[peer] or None,
                "colibri / this, 16 conversations": (
                    best_16[first] / best_16[peer] if best_16[peer] else None
                ),
                "prefill tok/s": best["prefill_tok_s"],
                "peak RSS MB": best["peak_rss_mb"],
                "greedy tokens as colibri's": f"{agreement(ours['tokens'], best['tokens'])}"
                f"/{len(ours['tokens'])}",
                "MB a step, as held": best["held_step_bytes_1"] / 1e6 if roofs else None,
                "/ roofline, per round (probe GB/s)": ", ".join(
                    f"{x['ratio']:.2f} ({x['gb_s']:.1f})" for x in roofs
                )
                or None,
                "most the widening allows, per round": ", ".join(
                    f"{x['bound']:.2f}" for x in roofs if "bound" in x
                )
                or None,
                "most the kernels' streaming allows, per round (their GB/s)": ", ".join(
                    f"{x['stream_bound']:.2f} ({x['stream_gb_s']:.1f})"
                    for x in roofs
                    if "stream_bound" in x
                )
                or None,
            }
        )
    return rows
