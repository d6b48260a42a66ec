"""experiments/bench_linear_rows.py: the kernel and XLA's product of the same rows, side by
side, for the matrices the engine holds, as float32 and as int4 rows."""

import pytest
from experiment_util import experiment, run_experiment

from colibri import kernels
from colibri.bench.shapes import ALL_SHAPES
from colibri.synth import hf_config

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no native kernels")


def test_the_matrices_are_the_shapes_attention_projections_and_router():
    script = experiment("bench_linear_rows")
    for shape in ("qwen3_moe", "wide"):
        cfg = hf_config(ALL_SHAPES[shape])
        d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
        assert script.matrices(shape) == {
            "qkv": (q + 2 * kv, cfg["hidden_size"]),
            "o": (cfg["hidden_size"], q),
            "router": (cfg["num_experts"], cfg["hidden_size"]),
        }


def test_every_matrix_format_and_row_count_is_timed_both_ways(tmp_path):
    res = run_experiment(
        "bench_linear_rows",
        tmp_path / "rows",
        "--rows",
        "3,70",
        "--repeats",
        "3",
        "--shapes",
        "qwen3_moe",
        "--held",
        "f32,int4",
    )
    got = {(r["matrix"].split()[0], r["held"], r["rows"]) for r in res["rows"]}
    matrices, held = ("qkv", "o", "router"), ("f32", "int4")
    assert got == {(m, h, n) for m in matrices for h in held for n in (3, 70)}
    for r in res["rows"]:
        assert r["kernel ms"] > 0 and r["XLA ms"] > 0 and r["kernel / XLA"] > 0
    assert (tmp_path / "rows.md").read_text().startswith("# The native linear kernel")
