"""python experiments/bench_kernel_revs.py [--base HEAD~1] [--passes 10] [--rows 1,16]

The routed-expert kernel of two versions of colibri/kernels/cpu.cc side by side, in one
process: the working tree's and that of --base (any git revision). Both libraries are built
as the engine builds its own and registered with XLA under names of their own; their calls
alternate, so that both meet the same phases of a machine whose speed moves by a quarter
within minutes (runs in separate processes could not tell 5% apart here).

What they compute: the routes the checkpoints of experiments/bench_peers.py (made there, or
here if missing) choose when --rows conversations decode at once (as there: one prompt, the
last 8 tokens changed in each conversation; 24 greedy steps), replayed on random weights of
the same shapes, every layer of every step per pass. The two outputs must agree bitwise (the
kernels' results never depend on how work is shared out). Reported: ms of expert calls a step
for each version (median of passes), GB/s of distinct experts' weights and GFLOP/s, and the
median over passes of new / base time.
Writes experiments/results/kernel_revs.md and kernel_revs.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd

from colibri import kernels
from colibri.report import markdown_table

HERE = Path(__file__).parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
from bench_peers import SHAPES, ensure_inputs, prompt_ids  # noqa: E402

STEPS = 24


def record_routes(ckpt: Path, rows: int, prompt_len: int = 128) -> np.ndarray:
    """[steps, layers, rows, top_k] slot ids the routers chose, greedy from the prompt."""
    from colibri.engine.model import load_model
    from colibri.engine.runner import Row, Runner

    model = load_model(ckpt, progress=False)
    runner = Runner(model, slots=rows, capacity=prompt_len + STEPS + 8)
    prompt = prompt_ids(model.cfg.vocab_size, prompt_len)
    logits, _ = runner.prefill(0, prompt)
    firsts = [int(np.argmax(logits))]
    head = prompt_len - 8
    kv = runner.export_slot(0, head)
    rng = np.random.default_rng(1)
    for s in range(1, rows):
        runner.import_slot(s, kv)
        tail = rng.integers(0, min(model.cfg.vocab_size, 4096), 8).tolist()
        logits_s, _ = runner.prefill(s, tail, start=head)
        firsts.append(int(np.argmax(logits_s)))
    toks, routes, done = firsts, [], 0
    while done < STEPS:
        at = [Row(s, toks[s], prompt_len + done) for s in range(rows)]
        fwd = runner.decode_async(at, steps=STEPS - done)
        greedy = fwd.tokens()
        routes += list(fwd.result()[1])
        toks, done = greedy[-1].tolist(), done + fwd.ran()
    return np.asarray(routes)[:, :, :rows]


def source_at(rev: str, into: Path) -> Path:
    """cpu.cc as it is at git revision `rev`."""
    text = subprocess.run(
        ["git", "show", f"{rev}:colibri/kernels/cpu.cc"],
        cwd=HERE.parent,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    out = into / "cpu.cc"
    out.write_text(text)
    return out


def expert_call(lib_path: Path, name: str):
    """The library's expert kernel, registered with XLA as `name`: f(gate, up, down, x, ids)."""
    lib = ctypes.cdll.LoadLibrary(str(lib_path))
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(lib.ColibriMoeExperts), platform="cpu")

    def call(gate, up, down, x, ids):
        shape = (*ids.shape, x.shape[1])
        out = jax.ShapeDtypeStruct(shape, jnp.float32)
        return jax.ffi.ffi_call(name, out, vmap_method="sequential")(gate, up, down, x, ids)

    return jax.jit(call)


def compare(calls: dict, cfg, routes: np.ndarray, passes: int) -> dict:
    """Time every version on the routes, alternating; ms a step per pass for each version."""
    m = cfg.moe
    S, D, F, L = m.num_experts, cfg.hidden, m.moe_ff, routes.shape[1]
    rng = np.random.default_rng(0)

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02)

    weights = [(w(S, F, D), w(S, F, D), w(S, D, F)) for _ in range(L)]
    x = jnp.asarray(rng.standard_normal((routes.shape[2], D), np.float32))
    ids = [[jnp.asarray(r, jnp.int32) for r in step] for step in routes]
    first = {v: np.asarray(f(*weights[0], x, ids[0][0])) for v, f in calls.items()}
    ref = next(iter(first.values()))
    for v, y in first.items():
        assert np.array_equal(y, ref), f"{v}: outputs differ bitwise from the other version"
    ms = {v: [] for v in calls}
    order = list(calls)
    for p in range(passes):
        for v in order if p % 2 == 0 else order[::-1]:
            f = calls[v]
            t = time.perf_counter()
            for step in ids:
                for layer, e in zip(weights, step, strict=True):
                    y = f(*layer, x, e)
            y.block_until_ready()
            ms[v].append((time.perf_counter() - t) / len(ids) * 1e3)
    distinct = np.mean([[len(np.unique(r)) for r in step] for step in routes], axis=0)
    gb = float(distinct.sum()) * 3 * D * F * 4 / 1e9
    gflop = routes.shape[2] * m.top_k * L * 3 * D * F * 2 / 1e9
    return {"ms": ms, "gb_per_step": gb, "gflop_per_step": gflop, "distinct": distinct.tolist()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD~1", help="git revision to compare with")
    ap.add_argument("--passes", type=int, default=10)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    if not kernels.available():
        sys.exit("colibri CPU kernels unavailable (see the log)")
    from colibri.config import load_config

    with tempfile.TemporaryDirectory() as tmp:
        base_lib = kernels.build(source_at(args.base, Path(tmp)))
    calls = {
        args.base: expert_call(base_lib, "colibri_moe_experts_base"),
        "working tree": expert_call(kernels.build(), "colibri_moe_experts_new"),
    }
    rows_out, raw = [], {}
    for name in args.shapes.split(","):
        ckpt = ensure_inputs(name, SHAPES[name], with_llama=False)["colibri"]
        cfg = load_config(ckpt)
        for rows in (int(r) for r in args.rows.split(",")):
            routes = record_routes(ckpt, rows)
            res = compare(calls, cfg, routes, args.passes)
            raw[f"{name}/{rows}"] = res
            base, new = (np.asarray(res["ms"][v]) for v in calls)
            for v, t in zip(calls, (base, new), strict=True):
                med = float(np.median(t))
                rows_out.append(
                    {
                        "model": name,
                        "rows": rows,
                        "kernel": v,
                        "ms a step (median)": med,
                        "best": float(t.min()),
                        "GB/s": res["gb_per_step"] / med * 1e3,
                        "GFLOP/s": res["gflop_per_step"] / med * 1e3,
                        "time / base (median of passes)": float(np.median(t / base)),
                    }
                )
            print(pd.DataFrame(rows_out[-2:]).to_string(index=False), flush=True)
    table = pd.DataFrame(rows_out)
    cmd = f"python experiments/bench_kernel_revs.py --base {args.base} --passes {args.passes}"
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=HERE.parent, capture_output=True, text=True
    ).stdout.strip()
    md = [
        "# The expert kernel of two revisions, side by side",
        "",
        f"Command: `{cmd} --rows {args.rows}` (working tree at {head}, base `{args.base}`)  ",
        f"Expert calls of {STEPS} greedy steps per pass, the versions alternating over "
        f"{args.passes} passes; outputs bitwise equal.",
        "",
        markdown_table(table, index=False, floatfmt=".3f"),
        "",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kernel_revs.md").write_text("\n".join(md))
    (RESULTS / "kernel_revs.json").write_text(json.dumps({"command": cmd, "runs": raw}, indent=1))
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"wrote {RESULTS / 'kernel_revs.md'}")


if __name__ == "__main__":
    main()
