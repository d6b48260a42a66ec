"""python experiments/bench_scale.py [--shape qwen3_moe] [--devices 1,2,4] [--steps 24]

The cost of expert parallel (colibri/model/parallel.py, docs/scaling.md): the same decode steps
with the routed experts on one device and spread over n, each in a process of its own. On a
machine without n accelerators the n devices are simulated CPU devices sharing its cores, so
what this measures is the overhead of the mechanism (the split per device, the `psum` of the
expert outputs, replicated attention), not a speed-up; on a GPU machine the same command runs
on its devices. Per device count and batch (1 and 4 conversations): ms a decode step (median
of the steps after a warm-up), that against one device, and whether the greedy tokens are the
one-device ones. Writes experiments/results/scale.md and scale.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd

from colibri.report import markdown_table

RESULTS = Path(__file__).parent / "results"


def worker(model: str, devices: int, steps: int) -> dict:
    """In this process (its devices set before JAX starts): greedy decode of `steps` tokens
    for 1 and 4 conversations; ms per step and the tokens."""
    import time

    import numpy as np

    from colibri.engine.model import load_model
    from colibri.engine.runner import Row, Runner
    from colibri.model import parallel

    parallel.use_devices(devices)
    runner = Runner(load_model(model, progress=False), slots=4, capacity=256)
    out = {}
    for rows in (1, 4):
        prompts = [[11 + 7 * s + i for i in range(16)] for s in range(rows)]
        nxt = [int(np.argmax(runner.prefill(s, p)[0])) for s, p in enumerate(prompts)]
        pos = [len(p) for p in prompts]
        times, tokens = [], [[] for _ in prompts]
        for _ in range(steps):
            t = time.perf_counter()
            logits, _ = runner.decode([Row(s, nxt[s], pos[s]) for s in range(rows)])
            times.append(time.perf_counter() - t)
            for s in range(rows):
                tokens[s].append(nxt[s])
                nxt[s] = int(np.argmax(logits[s]))
                pos[s] += 1
        out[rows] = {"ms": float(np.median(times[4:])) * 1e3, "tokens": tokens}
    return out


def run(model: Path, devices: int, steps: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    code = (
        "import json, sys; sys.path.insert(0, 'experiments'); import bench_scale; "
        f"print(json.dumps(bench_scale.worker({str(model)!r}, {devices}, {steps})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"devices={devices} failed:\n{done.stderr[-3000:]}")
    return {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    from colibri.bench.shapes import shape_checkpoint
    from colibri.engine.hwinfo import cpu_detail, host

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3_moe")
    ap.add_argument("--devices", default="1,2,4")
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    model = shape_checkpoint(args.shape, "f32")
    counts = [int(n) for n in args.devices.split(",")]
    got = {}
    for n in counts:
        print(f"{n} device(s)", flush=True)
        got[n] = run(model, n, args.steps)
    rows = []
    for n in counts:
        for b in (1, 4):
            one = got[counts[0]][b]
            rows.append(
                {
                    "devices": n,
                    "conversations": b,
                    "ms a step": got[n][b]["ms"],
                    f"x vs {counts[0]} device": got[n][b]["ms"] / one["ms"],
                    "same greedy tokens": got[n][b]["tokens"] == one["tokens"],
                }
            )
    table = pd.DataFrame(rows)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    hw = host()
    cmd = f"python experiments/bench_scale.py --shape {args.shape} --devices {args.devices}"
    md = [
        "# Expert parallel: its cost",
        "",
        f"Command: `{cmd} --steps {args.steps}`  ",
        f"Machine: {hw.cores} cores, {cpu_detail()}, {hw.ngpu} GPU(s); the devices beyond one "
        "are simulated CPU devices sharing the cores, so this is the mechanism's overhead, "
        "not a speed-up.  ",
        f"Model: the peers benchmark's {args.shape} shape (f32), every expert resident.",
        "",
        markdown_table(table, index=False),
        "",
        "One step a forward (`Runner.decode`, no bursts). On simulated devices each device also "
        "runs the replicated part (attention, routers, head) on the same cores, so the ratios "
        "bound the exchange's cost from above; on real devices that part runs in parallel.",
        "",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "scale.md").write_text("\n".join(md))
    (RESULTS / "scale.json").write_text(
        json.dumps({"command": cmd, "rows": rows, "runs": got}, indent=1, default=str)
    )
    print(f"wrote {RESULTS / 'scale.md'}")


if __name__ == "__main__":
    main()
