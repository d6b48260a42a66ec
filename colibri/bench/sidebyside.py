"""colibri beside a peer on the same model: batch-1 greedy decode, each engine in a process of
its own (colibri.bench.workers), the order flipping every round; and how many leading greedy
tokens two runs share."""

from __future__ import annotations

from pathlib import Path

from colibri.bench.conversations import prompt_ids
from colibri.bench.workers import run_worker
from colibri.config import load_config


def agreement(a: list[int], b: list[int]) -> int:
    """Leading greedy tokens two runs share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def side_by_side(name: str, paths: dict[str, Path], rounds: int, tokens: int = 64) -> list[dict]:
    """Batch-1 greedy decode of `tokens` tokens after a 128-token prompt by each engine on its
    checkpoint (label -> path; the first a colibri checkpoint, labels starting "colibri" or
    "llama.cpp"), each run in a process of its own (workers.run_worker), the order flipping
    every round: each engine's best round, against the first engine's."""
    first = next(iter(paths))
    prompt = prompt_ids(load_config(paths[first]).vocab_size, 128)
    runs = {k: [] for k in paths}
    for r in range(rounds):
        for peer in list(paths) if r % 2 == 0 else list(paths)[::-1]:
            kind = "colibri" if peer.startswith("colibri") else "llama.cpp"
            runs[peer].append(run_worker(kind, paths[peer], prompt, tokens))
    ours = max(runs[first], key=lambda res: res["decode_tok_s_1"])
    rows = []
    for peer, res in runs.items():
        best = max(res, key=lambda x: x["decode_tok_s_1"])
        rows.append(
            {
                "model": name,
                "engine": peer,
                "decode tok/s (batch 1, best of rounds)": best["decode_tok_s_1"],
                "colibri / this": ours["decode_tok_s_1"] / best["decode_tok_s_1"],
                "prefill tok/s": best["prefill_tok_s"],
                "peak RSS MB": best["peak_rss_mb"],
                "greedy tokens as colibri's": f"{agreement(ours['tokens'], best['tokens'])}"
                f"/{len(ours['tokens'])}",
            }
        )
    return rows
