"""python experiments/bench_engine_revs.py [--base HEAD~1] [--pairs 4] [--shapes A,B]
    [--tokens 64] [--prompt 128] [--dtype f32] [--env NAME=VALUE ...] [--out engine_revs]

The whole engine at two revisions, side by side: the working tree and --base (any git revision,
checked out in a temporary worktree for the run; it must have colibri/bench/workers.py). Each
pair of runs is the peers benchmark's colibri worker once in each tree, each in its own
process, the one to go first alternating from pair to pair: batch-1 prefill, then 1, 4 and 16
rows decoding in cuttable bursts and one step a forward (the best of the worker's passes, as in
experiments/bench_peers.py). Ratios are taken within a pair, a minute apart, on a machine whose
memory speed moves by 2x between minutes; the median over pairs is the figure. Kernel changes
are timed more finely by bench_kernel_revs.py (call by call, in one process); this shows what
of them reaches a decode step. Both versions must choose the same greedy tokens (a change of
speed never changes tokens); the report says whether they did. --dtype: the peers shape
synthesized as bf16 or a held format of colibri.bench.formats (fp8, int4, awq4, int8), as
bench_bf16.py and bench_quantized.py make it; --env: variables for both workers
(COLIBRI_BF16=products, ...).
Writes experiments/results/NAME.md and NAME.json.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

import pandas as pd

from colibri.bench.conversations import prompt_ids
from colibri.bench.formats import FORMATS
from colibri.bench.shapes import ALL_SHAPES, CACHE, SHAPES, held_checkpoint
from colibri.bench.workers import run_worker
from colibri.engine.hwinfo import cpu_detail
from colibri.report import markdown_table, write_report

HERE = Path(__file__).parent
REPO = HERE.parent
MEASURES = {  # worker result key: what the report calls it
    "prefill_tok_s": "prefill",
    "decode_tok_s_1": "1 row",
    "decode_tok_s_4": "4 rows",
    "decode_tok_s_16": "16 rows",
    "decode_tok_s_1_single": "1 row, one step a forward",
    "decode_tok_s_4_single": "4 rows, one step a forward",
    "decode_tok_s_16_single": "16 rows, one step a forward",
}


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.strip()


def pairs_of_runs(
    trees: dict[str, Path], ckpt: Path, prompt: list[int], tokens: int, pairs: int, env: dict
) -> dict[str, list[dict]]:
    """`pairs` runs of the colibri worker in each tree, the first to go alternating."""
    runs: dict[str, list[dict]] = {v: [] for v in trees}
    order = list(trees)
    for i in range(pairs):
        for v in order if i % 2 == 0 else order[::-1]:
            print(f"  pair {i + 1}/{pairs}, {v}:", flush=True)
            runs[v].append(run_worker("colibri", ckpt, prompt, tokens, env=env, tree=trees[v]))
    return runs


def summarize(name: str, runs: dict[str, list[dict]]) -> list[dict]:
    base, new = runs["base"], runs["working tree"]
    rows = []
    for key, label in MEASURES.items():
        if not all(key in r for r in base + new):
            continue
        ratios = [n[key] / b[key] for b, n in zip(base, new, strict=True)]
        rows.append(
            {
                "model": name,
                "measure": label,
                "base tok/s (median)": statistics.median(r[key] for r in base),
                "working tree tok/s (median)": statistics.median(r[key] for r in new),
                "working tree / base, each pair": ", ".join(f"{x:.2f}" for x in ratios),
                "working tree / base (median of pairs)": statistics.median(ratios),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD~1", help="git revision to compare with")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for both workers")
    ap.add_argument("--dtype", default="f32", choices=("f32", "bf16", *FORMATS))
    ap.add_argument("--out", default="engine_revs")
    args = ap.parse_args()
    env = dict(e.split("=", 1) for e in args.env)
    rev = git("rev-parse", "--short", args.base)
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    CACHE.mkdir(parents=True, exist_ok=True)
    rows, data = [], {"base": rev, "env": env, "shapes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "base"
        git("worktree", "add", "--detach", str(tree), rev)
        try:
            trees = {"base": tree, "working tree": REPO.resolve()}
            for name in args.shapes.split(","):
                spec = ALL_SHAPES[name]
                ckpt = held_checkpoint(name, args.dtype)
                print(f"{name}: {args.pairs} pairs, base {rev} against the working tree")
                prompt = prompt_ids(spec.vocab, args.prompt)
                runs = pairs_of_runs(trees, ckpt, prompt, args.tokens, args.pairs, env)
                pairs = zip(runs["base"], runs["working tree"], strict=True)
                same = all(b["tokens"] == n["tokens"] for b, n in pairs)
                rows += summarize(name, runs)
                data["shapes"][name] = {"runs": runs, "same_tokens": same}
        finally:
            git("worktree", "remove", "--force", str(tree))
    df = pd.DataFrame(rows)
    table = markdown_table(df, index=False)
    print(table)
    env_text = " ".join(f"{k}={v}" for k, v in env.items())
    same = ", ".join(
        f"{name} {'the same' if d['same_tokens'] else 'DIFFERENT'}"
        for name, d in data["shapes"].items()
    )
    lines = [
        "# The engine at two revisions",
        "",
        f"Command: `python experiments/bench_engine_revs.py --base {args.base} --pairs "
        f"{args.pairs} --shapes {args.shapes} --tokens {args.tokens} --prompt {args.prompt}"
        + "".join(f" --env {e}" for e in args.env)
        + (f" --dtype {args.dtype}" if args.dtype != "f32" else "")
        + "`  ",
        f"Machine: {cpu_detail()}  ",
        f"Base: {rev}; working tree: {git('rev-parse', '--short', 'HEAD')}"
        + (" with uncommitted changes" if dirty else "")
        + (f"; environment {env_text}" if env else ""),
        "",
        "Each pair: the peers benchmark's colibri worker once in each tree, in processes of their "
        "own, the first to go alternating; tok/s are the best of the worker's passes (batch-1 "
        f"prefill of {args.prompt} tokens, then {args.tokens} greedy tokens decoded by 1, 4 and "
        f"16 rows). Greedy tokens of the two versions: {same}.",
        "",
        table,
    ]
    write_report(HERE / "results", args.out, lines, data)


if __name__ == "__main__":
    main()
