"""python experiments/kvsave_memory.py [--ckpt .cache/synth-kvsave] [--turns 2400] [--every 200]

The engine's resident memory over many turns, with and without KVSAVE.

The real `colibri engine` (mux protocol, SERVE_BATCH=1, KV_SLOTS=2, CTX=256, STATE_DIR a
temporary folder) on a small synthetic qwen3_moe checkpoint, run twice, one after the other:
KVSAVE=1 and KVSAVE=0. Each turn extends the conversation of one slot (the two slots take turns)
by a few words and asks for a few greedy tokens, so the cached lengths a turn end persists
differ from turn to turn; a conversation starts over now and then (at random, and before it
would outgrow the context), which rewrites its slot file. The engine's RSS (psutil, on its pid)
is sampled every --every turns. JAX_LOG_COMPILES=1 is set in the engine, and the XLA programs
it compiled by each sample are counted from its log. Prints a table and writes
experiments/results/kvsave_memory.md and kvsave_memory.json.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import psutil

from colibri.protocol import codec
from colibri.protocol.codec import Done, Error, Submit, format_request
from colibri.report import markdown_table, write_report
from colibri.synth import SynthSpec, synthesize

SPEC = SynthSpec(family="qwen3_moe", layers=4, experts=16, top_k=4, hidden=128, moe_ff=64)
SLOTS = 2
CTX = 256
MAX_TOKENS = 4
LONGEST_PROMPT = CTX - 32  # tokens; a conversation past this starts over
WORDS = "the quick brown fox jumps over a lazy dog while colibri hums in the garden".split()
RESULTS = Path(__file__).parent / "results"
# jax's log line of each program compiled (the engine's log may print it twice: once a handler)
COMPILED = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}).*(Finished XLA compilation .*)")


class Engine:
    """`colibri engine` on the mux protocol, its log in a file."""

    def __init__(self, ckpt: Path, state: Path, kvsave: bool, log: Path):
        env = {**os.environ, "SERVE_BATCH": "1", "KV_SLOTS": str(SLOTS), "CTX": str(CTX)}
        env |= {"KVSAVE": str(int(kvsave)), "STATE_DIR": str(state), "JAX_LOG_COMPILES": "1"}
        cmd = [sys.executable, "-m", "colibri.cli", "engine", "--model", str(ckpt)]
        self.log = log
        with log.open("wb") as err:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env
            )
        self.ps = psutil.Process(self.proc.pid)
        self.handshake = [self.next() for _ in range(5)]
        self.next_id = 1

    def next(self) -> codec.Event:
        ev = codec.read_event(self.proc.stdout)
        if ev is None:
            raise EOFError(f"the engine exited; its log: {self.log}")
        return ev

    def turn(self, slot: int, prompt: str) -> Done:
        """One request to its end; its DONE."""
        rid, self.next_id = self.next_id, self.next_id + 1
        self.proc.stdin.write(
            format_request(Submit(rid, slot, MAX_TOKENS, 0.0, 1.0, prompt.encode()))
        )
        self.proc.stdin.flush()
        while True:
            ev = self.next()
            if isinstance(ev, Error) and ev.id == rid:
                raise RuntimeError(f"turn {rid} failed: {ev}")
            if isinstance(ev, Done) and ev.id == rid:
                return ev

    def rss_mb(self) -> float:
        return self.ps.memory_info().rss / 2**20

    def compiles(self) -> int:
        return len(set(COMPILED.findall(self.log.read_text(errors="replace"))))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def drive(ckpt: Path, kvsave: bool, turns: int, every: int, seed: int = 0) -> list[dict]:
    """Samples {turn, rss_mb, compiles, lengths} of one engine over `turns` turns."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="kvsave-") as tmp:
        engine = Engine(ckpt, Path(tmp) / "state", kvsave, Path(tmp) / "engine.log")
        try:
            convo = [f"Conversation {s}:" for s in range(SLOTS)]
            used = [0] * SLOTS  # each conversation's prompt tokens at its last turn
            lengths: set[int] = set()  # distinct cached lengths at a turn end
            rows = [dict(turn=0, rss_mb=engine.rss_mb(), compiles=engine.compiles(), lengths=0)]
            for t in range(1, turns + 1):
                slot = t % SLOTS
                more = " ".join(rng.choices(WORDS, k=rng.randint(1, 3)))
                if used[slot] > LONGEST_PROMPT or rng.random() < 0.02:
                    convo[slot] = f"New conversation {t}:"  # starts over: the file is rewritten
                convo[slot] += " " + more
                done = engine.turn(slot, convo[slot])
                used[slot] = done.prompt_tokens
                lengths.add(done.prompt_tokens + done.emitted)
                if t % every == 0:
                    rows.append(
                        dict(
                            turn=t,
                            rss_mb=engine.rss_mb(),
                            compiles=engine.compiles(),
                            lengths=len(lengths),
                        )
                    )
                    print(f"KVSAVE={int(kvsave)} {rows[-1]}", flush=True)
        finally:
            engine.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", type=Path, default=Path(".cache/synth-kvsave"))
    ap.add_argument("--turns", type=int, default=2400)
    ap.add_argument("--every", type=int, default=200)
    args = ap.parse_args()
    if not (args.ckpt / "config.json").exists():
        synthesize(SPEC, args.ckpt, progress=False)
    t0 = time.perf_counter()
    runs = {kv: drive(args.ckpt, kv, args.turns, args.every) for kv in (True, False)}
    wall = time.perf_counter() - t0
    on, off = pd.DataFrame(runs[True]), pd.DataFrame(runs[False])
    table = pd.DataFrame(
        {
            "turns": on["turn"],
            "RSS MB, KVSAVE=1": on["rss_mb"],
            "XLA programs, KVSAVE=1": on["compiles"],
            "distinct lengths saved": on["lengths"],
            "RSS MB, KVSAVE=0": off["rss_mb"],
            "XLA programs, KVSAVE=0": off["compiles"],
        }
    )
    text = markdown_table(table, floatfmt=".0f", index=False)
    print(text)
    last = {k: r[-1] for k, r in runs.items()}
    lines = [
        "# Engine RSS over many turns, with and without KVSAVE",
        "",
        f"`python experiments/kvsave_memory.py --turns {args.turns} --every {args.every}`: "
        f"the mux engine, KV_SLOTS={SLOTS}, CTX={CTX}, {MAX_TOKENS} greedy tokens a turn, "
        f"on a synthetic {SPEC.family} ({SPEC.layers} layers, {SPEC.experts} experts, hidden "
        f"{SPEC.hidden}); each turn grows one slot's conversation by a few words, a "
        "conversation starts over now and then. XLA programs: those the engine "
        f"compiled by then (its `JAX_LOG_COMPILES` log). {wall:.0f} s for both runs.",
        "",
        text,
        "",
        f"At turn {args.turns}: KVSAVE=1 {last[True]['rss_mb']:.0f} MB and "
        f"{last[True]['compiles']} programs, KVSAVE=0 {last[False]['rss_mb']:.0f} MB and "
        f"{last[False]['compiles']} programs: KVSAVE costs "
        f"{last[True]['rss_mb'] - last[False]['rss_mb']:+.0f} MB.",
    ]
    write_report(RESULTS, "kvsave_memory", lines, {str(int(k)): r for k, r in runs.items()})


if __name__ == "__main__":
    main()
