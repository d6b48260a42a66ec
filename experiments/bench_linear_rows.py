"""python experiments/bench_linear_rows.py [--rows 16,32,64,128,256] [--held f32,int4]
    [--shapes qwen3_moe,wide] [--repeats 21] [--out linear_rows]

Up to how many rows the native linear kernel (`kernels.linear`) beats XLA's own product of the
same rows, the number that sets `colibri.model.layers.NATIVE_ROWS` (the rows of a decode step
or a prefill chunk that go to the kernel). For each shape's attention projections (qkv, o) and
router, as the peers benchmark's checkpoints and the rows of Qwen3-30B-A3B (`wide`) have them,
random weights held as float32 or as int4 rows (XLA's path widens the whole matrix first, as
`layers.linear` does past NATIVE_ROWS), and each row count: the two products alternate call by
call in one process (the machine's speed moves within minutes), and the figure is the median
over --repeats pairs of kernel / XLA time. Below 1 the kernel is faster.
Writes experiments/results/NAME.md and NAME.json.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
from tqdm import tqdm

from colibri import kernels
from colibri.bench.formats import packed_pair
from colibri.bench.shapes import ALL_SHAPES
from colibri.engine.hwinfo import cpu_detail
from colibri.model.layers import EXACT, NATIVE_ROWS, widen_rows
from colibri.report import markdown_table, write_report

HERE = Path(__file__).parent
RESULTS = HERE / "results"


def matrices(shape: str) -> dict[str, tuple[int, int]]:
    """The shape's attention projections and router: name -> [out, in]."""
    s = ALL_SHAPES[shape]
    q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    return {
        "qkv": (q + 2 * kv, s.hidden),
        "o": (s.hidden, q),
        "router": (s.experts, s.hidden),
    }


def ratio(x: jax.Array, w: jax.Array, repeats: int) -> tuple[float, float, float]:
    """(kernel ms, XLA ms, median of kernel / XLA) over `repeats` alternating pairs."""
    cols = x.shape[-1]
    native = jax.jit(kernels.linear)
    xla = jax.jit(lambda x, w: jnp.einsum("ri,oi->ro", x, widen_rows(w, cols), precision=EXACT))
    want = np.asarray(xla(x, w))
    np.testing.assert_allclose(np.asarray(native(x, w)), want, rtol=1e-3, atol=1e-3)
    tk, tx = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        native(x, w).block_until_ready()
        t1 = time.perf_counter()
        xla(x, w).block_until_ready()
        t2 = time.perf_counter()
        tk.append(t1 - t0)
        tx.append(t2 - t1)
    ratios = np.asarray(tk) / np.asarray(tx)
    return 1e3 * float(np.median(tk)), 1e3 * float(np.median(tx)), float(np.median(ratios))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="16,32,64,128,256")
    ap.add_argument("--held", default="f32,int4")
    ap.add_argument("--shapes", default="qwen3_moe,wide")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--out", default="linear_rows")
    args = ap.parse_args()
    if not kernels.available():
        raise SystemExit("the native kernels are unavailable here")
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    out = []
    cases = [
        (shape, name, oi, held)
        for shape in args.shapes.split(",")
        for name, oi in matrices(shape).items()
        for held in args.held.split(",")
    ]
    for shape, name, (O, I), held in tqdm(cases, unit="matrix"):
        w = rng.standard_normal((O, I), dtype=np.float32)
        if held == "int4":
            w = packed_pair(w[None])[0][0]
        w = jnp.asarray(w)
        for r in rows:
            x = jnp.asarray(rng.standard_normal((r, I), dtype=np.float32))
            k_ms, x_ms, kx = ratio(x, w, args.repeats)
            gflop = 2 * r * O * I / 1e9
            out.append(
                {
                    "shape": shape,
                    "matrix": f"{name} [{O}, {I}]",
                    "held": held,
                    "rows": r,
                    "kernel ms": k_ms,
                    "XLA ms": x_ms,
                    "kernel GFLOP/s": gflop / k_ms * 1e3,
                    "XLA GFLOP/s": gflop / x_ms * 1e3,
                    "kernel / XLA": kx,
                }
            )
    df = pd.DataFrame(out)
    wide = df.pivot_table(
        index=["shape", "matrix", "held"], columns="rows", values="kernel / XLA", sort=False
    )
    wide.columns = [f"{c} rows" for c in wide.columns]
    print(wide.round(2).to_string())
    cmd = "python experiments/bench_linear_rows.py " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items() if k != "out"
    )
    lines = [
        "# The native linear kernel against XLA's product, by rows",
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {cpu_detail()}  ",
        f"Rows up to `layers.NATIVE_ROWS` ({NATIVE_ROWS}) go to the kernel in the engine. Each "
        f"figure: the median over {args.repeats} alternating pairs of calls of the kernel's time "
        "over XLA's (below 1: the kernel is faster); int4: XLA widens the whole matrix first, "
        "as `layers.linear` does past NATIVE_ROWS.",
        "",
        markdown_table(wide.reset_index(), floatfmt=".2f", index=False),
        "",
        "Each call:",
        "",
        markdown_table(df, floatfmt=".3f", index=False),
    ]
    write_report(RESULTS, args.out, lines, {"args": vars(args), "rows": out})


if __name__ == "__main__":
    main()
