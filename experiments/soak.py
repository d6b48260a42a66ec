"""python experiments/soak.py [--seconds 600] [--clients 16] [--model DIR] [--no-warmup]

A soak of the gateway and its engine: `--clients` streaming clients for `--seconds`, each
leaving some streams midway, with malformed requests mixed in (lone surrogates, huge integers,
oversize and deeply nested bodies, foreign Host and Origin, wrong content types). Every few
seconds it samples the resident memory of both processes. At the end no slot may be held (all
free once the clients stop) and each process's memory should stay within 10% of where it was
after the first minute. The engine warms up (WARMUP=1: every program compiled after READY)
unless --no-warmup. Prints a table and writes experiments/results/soak.md. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pandas as pd
import psutil

from colibri.client import default_model
from colibri.report import markdown_table, write_report

RESULTS = Path(__file__).parent / "results"
SAMPLE_S = 5.0
MALFORMED = [
    ("surrogate", {"prompt": "a\ud800b", "max_tokens": 4}, {}),
    ("huge max_tokens", {"prompt": "hi", "max_tokens": 10**20, "temperature": 0}, {}),
    ("tiny temperature", {"prompt": "hi", "max_tokens": 4, "temperature": 5e-324}, {}),
    ("foreign host", {"prompt": "hi", "max_tokens": 4}, {"Host": "evil.example"}),
    ("foreign origin", {"prompt": "hi", "max_tokens": 4}, {"Origin": "http://evil.example"}),
    ("text/plain", {"prompt": "hi", "max_tokens": 4}, {"Content-Type": "text/plain"}),
]
PROMPTS = ["def fibonacci(n):", "The GNU General Public License", "Der schnelle braune Fuchs"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_gateway(
    model: Path, port: int, slots: int, log: Path, warmup: bool = True
) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "colibri.cli", "gateway", "--model", str(model)]
    cmd += ["--port", str(port), "--kv-slots", str(slots), "--max-queue", "64"]
    env = {**os.environ, "WARMUP": "1" if warmup else "0"}
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=err, stderr=err, env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"gateway did not start:\n{log.read_text()}")


def client(url: str, seed: int, until: float, counts: Counter, lock: threading.Lock) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        outcome = "ok"
        try:
            if rng.random() < 0.15:
                name, body, headers = rng.choice(MALFORMED)
                data = json.dumps(body).encode()
                headers = {"Content-Type": "application/json", **headers}
                r = httpx.post(url + "/v1/completions", content=data, headers=headers, timeout=120)
                outcome = f"{name}: {r.status_code}"
            else:
                body = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(8, 64)}
                body |= {"stream": True, "temperature": rng.choice([0, 0.8])}
                leave_after = rng.choice([None, None, 1, 3])  # some clients leave midway
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                    outcome = f"stream: {r.status_code}"
                    for i, _ in enumerate(r.iter_lines()):
                        if leave_after is not None and i >= leave_after:
                            outcome = "stream: left"
                            break
        except httpx.HTTPError as e:
            outcome = f"error: {type(e).__name__}"
        with lock:
            counts[outcome] += 1


def rss_mb(proc: psutil.Process) -> float:
    try:
        return proc.memory_info().rss / 2**20
    except psutil.Error:
        return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--stem", default="soak", help="result file names in experiments/results")
    ap.add_argument("--no-warmup", action="store_true", help="WARMUP=0: compile as traffic comes")
    args = ap.parse_args()
    model = args.model or default_model()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="colibri-soak-")) / "gateway.log"
    gateway = start_gateway(model, port, min(args.clients, 16), log, not args.no_warmup)
    gw = psutil.Process(gateway.pid)
    engine = gw.children()[0]
    counts: Counter = Counter()
    lock = threading.Lock()
    start = time.monotonic()
    until = start + args.seconds
    threads = [
        threading.Thread(target=client, args=(url, i, until, counts, lock), daemon=True)
        for i in range(args.clients)
    ]
    for t in threads:
        t.start()
    samples = []
    while time.monotonic() < until:
        samples.append((time.monotonic() - start, rss_mb(gw), rss_mb(engine)))
        time.sleep(SAMPLE_S)
    for t in threads:
        t.join(timeout=180)
    time.sleep(2)
    health = httpx.get(url + "/health", timeout=10).json()
    samples.append((time.monotonic() - start, rss_mb(gw), rss_mb(engine)))
    gateway.terminate()
    gateway.wait(timeout=60)
    warm = re.search(r"warm-up: (\d+) programs compiled in ([\d.]+) s", log.read_text())

    settled = [s for s in samples if s[0] >= min(60.0, args.seconds / 3)] or samples
    base_gw, base_engine = settled[0][1], settled[0][2]
    drift_gw = max(s[1] for s in settled) / base_gw - 1
    drift_engine = max(s[2] for s in settled) / base_engine - 1
    half = [s for s in samples if s[0] >= args.seconds / 2]  # after the shapes have compiled
    late_engine = max(s[2] for s in half) / half[0][2] - 1
    summary = {
        "requests": sum(counts.values()),
        "slots held after": health["busy"] + health["waiting"],
        "gateway RSS MB (settled, last)": f"{base_gw:.0f}, {samples[-1][1]:.0f}",
        "engine RSS MB (settled, last)": f"{base_engine:.0f}, {samples[-1][2]:.0f}",
        "gateway RSS drift (max over settled)": f"{100 * drift_gw:+.1f}%",
        "engine RSS drift (max over settled)": f"{100 * drift_engine:+.1f}%",
        "engine RSS drift over the second half": f"{100 * late_engine:+.1f}%",
        "engine restarts": health.get("restarts", 0),
        "engine warm-up": f"{warm[1]} programs in {float(warm[2]):.0f} s" if warm else "none",
    }
    table = markdown_table(pd.DataFrame({"value": summary}).rename_axis("measure"))
    detail = markdown_table(pd.DataFrame({"count": dict(sorted(counts.items()))}))
    print(table, "", detail, sep="\n")
    lines = [
        f"# Soak: {args.clients} clients, {args.seconds:.0f} s",
        "",
        f"`python experiments/soak.py --seconds {args.seconds:.0f} --clients {args.clients}"
        f"{' --no-warmup' if args.no_warmup else ''}` on"
        f" {os.path.relpath(model)}; {psutil.cpu_count()} cores. Targets: no slot held after,"
        " each process's RSS within 10% of its level after the first minute.",
        "",
        table,
        "",
        "## Outcomes",
        "",
        detail,
    ]
    data = {"summary": summary, "outcomes": dict(counts), "rss_samples": samples}
    write_report(RESULTS, args.stem, lines, data)


if __name__ == "__main__":
    main()
