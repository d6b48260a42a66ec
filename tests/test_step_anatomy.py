"""Where a decode step's time goes (colibri.bench.anatomy, experiments/step_anatomy.py): the
compiled program's kernel calls read from XLA's dump, a profile's ops split into steps and
parts, and the experiment run end to end on a tiny checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import tiny
from experiment_util import experiment, run_experiment
from fake_runner import FakeRunner

from colibri.bench import anatomy
from colibri.config import load_config


def test_decode_bursts_are_as_long_as_stream_ms_allows():
    """With stream_ms, the first forward is two steps and each later one no longer than the
    last one's steps say fit in it, as the engine's STREAM_MS (one step a forward where not
    two fit); without, every burst `burst` steps but the last; the tokens and routes are the
    same either way."""
    runs = {}
    for stream_ms in (None, 45.0, 15.0):
        runner = FakeRunner(slots=1, capacity=64)
        runner.step_s = 0.01
        runner.prefill(0, [1, 2, 3])
        tokens, routes = [], []
        anatomy.decode_bursts(runner, [4], 3, 30, 16, routes, tokens, stream_ms)
        runs[stream_ms] = [steps for steps, _, _ in runner.calls], tokens, routes
    assert runs[None][0] == [16, 14]
    lengths = runs[45.0][0]
    assert lengths[0] == 2 and sum(lengths) == 30
    assert max(lengths) <= 4 and all(k >= 2 for k in lengths[:-1])  # (steps of 10 ms or more)
    assert runs[15.0][0] == [2] + [1] * 28
    for other in (45.0, 15.0):
        assert runs[other][1] == runs[None][1] and len(runs[None][1]) == 30
        np.testing.assert_array_equal(np.array(runs[other][2]), np.array(runs[None][2]))


HLO = """\
  %ffi_call.1 = f32[1,96]{1,0} custom-call(%a, %w), custom_call_target="colibri_linear", \
operand_layout_constraints={f32[1,64]{1,0}, f32[96,64]{1,0}}, api_version=API_VERSION_TYPED_FFI
  %ffi_call.2 = f32[1,2,64]{2,1,0} custom-call(%g, %u, %d, %x, %i), \
custom_call_target="colibri_moe_experts_int8", operand_layout_constraints={\
s32[8,32,18]{2,1,0}, s32[8,32,18]{2,1,0}, s32[8,64,10]{2,1,0}, f32[1,64]{1,0}, s32[1,2]{1,0}}, \
api_version=API_VERSION_TYPED_FFI
  %ffi_call.3 = s32[1]{0} custom-call(%c), custom_call_target="colibri_cut_requested", \
operand_layout_constraints={s32[1]{0}}, api_version=API_VERSION_TYPED_FFI
  %add.4 = f32[1,64]{1,0} add(%p, %q)
"""

HEADS = """  %ffi_call.5 = f32[2,4,16]{2,1,0} custom-call(%o, %kv), custom_call_target=\
"colibri_linear_heads", operand_layout_constraints={f32[2,4,64]{2,1,0}, f32[4,40,64]{2,1,0}}, \
api_version=API_VERSION_TYPED_FFI, backend_config={first = 24 : i64}
  %ffi_call.6 = f32[2,4,64]{2,1,0} custom-call(%q, %kv), custom_call_target=\
"colibri_linear_heads_t", operand_layout_constraints={f32[2,4,24]{2,1,0}, f32[4,40,64]{2,1,0}}, \
api_version=API_VERSION_TYPED_FFI, backend_config={first = 0 : i64}
"""


def test_kernel_calls_name_each_kernel_and_its_weights():
    calls = anatomy.kernel_calls(HLO)
    assert set(calls) == {"ffi_call.1", "ffi_call.2", "ffi_call.3"}
    assert calls["ffi_call.1"] == anatomy.Kernel(
        "colibri_linear", "linear [96, 64]", 96 * 64 * 4, 2 * 96 * 64
    )
    experts = calls["ffi_call.2"]
    assert experts.label == "routed experts (int8 rows)"
    assert experts.weight_bytes == (2 * 32 * 18 + 64 * 10) * 4  # one expert's rows, as held
    # One row, two chosen experts, each 32 x 64 gate and up rows and 64 x 32 down rows.
    assert experts.flops == 2 * 2 * 3 * 32 * 64
    assert calls["ffi_call.3"].target == anatomy.CUT


def test_kernel_calls_name_the_mla_heads_products_and_the_rows_they_read():
    """MLA's per-head products read rows first .. of each head's kv_b rows: 16 a head of the
    value rows (40 - 24), the query's 24 (its inputs)."""
    calls = anatomy.kernel_calls(HEADS)
    out, into = calls["ffi_call.5"], calls["ffi_call.6"]
    assert out == anatomy.Kernel(
        "colibri_linear_heads", "linear_heads [4 x 16, 64]", 4 * 16 * 64 * 4, 2 * 2 * 4 * 16 * 64
    )
    assert into.label == "linear_heads_t [4 x 24, 64]"
    assert (into.weight_bytes, into.flops) == (4 * 24 * 64 * 4, 2 * 2 * 4 * 24 * 64)


def op(ts, dur, name, run):
    args = {"hlo_module": "jit__decode_burst", "hlo_op": name, "run_id": run}
    return {"ph": "X", "ts": ts, "dur": dur, "name": name, "args": args}


def test_a_profile_splits_into_steps_and_parts():
    calls = anatomy.kernel_calls(HLO)
    # Two bursts of two steps: the cut check in the loop's condition (steps + 1 times), a
    # linear call, an XLA op, the experts. The second burst starts 30 µs after the first ends.
    first = [
        op(0, 1, "ffi_call.3", "a"),
        op(2, 10, "ffi_call.1", "a"),
        op(12, 2, "add.4", "a"),
        op(15, 100, "ffi_call.2", "a"),
        op(116, 1, "ffi_call.3", "a"),
        op(118, 10, "ffi_call.1", "a"),
        op(128, 2, "add.4", "a"),
        op(131, 100, "ffi_call.2", "a"),
        op(232, 1, "ffi_call.3", "a"),
    ]
    second = [op(e["ts"] + 263, e["dur"], e["name"], "b") for e in first]
    first.append(op(1.5, 200, "while.5", "a"))  # control flow, around the ops it runs
    other = {"ph": "X", "ts": 5, "dur": 1, "name": "x", "args": {"hlo_module": "jit_other"}}
    a = anatomy.anatomy([*second, other, *first], calls, "jit__decode_burst")
    assert (a.steps, a.runs) == (4, 2)
    assert a.parts["linear [96, 64]"].us == pytest.approx(10.0)
    assert a.parts["linear [96, 64]"].calls == pytest.approx(1.0)
    assert a.parts["routed experts (int8 rows)"].us == pytest.approx(100.0)
    assert a.parts[anatomy.XLA_OPS].us == pytest.approx(2.0)
    assert a.parts["cut check"].calls == pytest.approx(1.5)
    # Each burst spans 233 µs, ops run 227 of them: 6 µs idle over 2 steps, twice.
    assert a.between_ops_us == pytest.approx(3.0)
    # 30 µs between the bursts, spread over the second burst's 2 steps.
    assert a.between_bursts_us == pytest.approx(15.0)
    assert a.overlap_us == 0.0
    assert a.xla_ops == {"add.4": pytest.approx(2.0)}
    assert a.step_us == pytest.approx(1.5 + 10 + 2 + 100 + 3 + 15)
    # Bursts of different lengths (the last as long as the steps left): a one-step burst 104 µs
    # after the second; a gap before every burst, the mean of the two seen: 67 µs, 3 of them
    # over 5 steps.
    third = [op(e["ts"] + 600, e["dur"], e["name"], "c") for e in first[:5]]
    a = anatomy.anatomy([*first, *second, *third], calls, "jit__decode_burst")
    assert (a.steps, a.runs) == (5, 3)
    assert a.between_bursts_us == pytest.approx(67 * 3 / 5)


def test_the_experiment_profiles_a_tiny_model(tmp_path):
    ckpt = tiny.build("qwen3_moe", tmp_path / "ckpt")
    out = tmp_path / "anatomy"
    args = ("--ckpt", str(ckpt), "--tokens", "60", "--prompt", "12", "--rows", "3")
    res = run_experiment("step_anatomy", out, *args, "--rounds", "1", timeout=300)["ckpt"]
    (rnd,) = res["rounds"]
    assert res["rows"] == 3
    assert res["top_k"] <= res["distinct_experts"] <= 3 * res["top_k"]
    assert rnd["steps"] == 60  # a burst of 48, then one of 12 (the same program)
    parts = rnd["parts"]
    cfg = load_config(ckpt)
    layers = cfg.num_layers
    assert parts["routed experts"]["calls"] == len(cfg.moe_layer_ids) < layers
    # Fused q, k and v; the output projection; the routers; lm_head (the dense layer: its own).
    assert parts["linear [128, 64]"]["calls"] == layers  # (4 + 2 + 2) heads x 16
    assert parts["linear [64, 64]"]["calls"] == layers
    assert parts["linear [8, 64]"]["calls"] == len(cfg.moe_layer_ids)  # routers
    assert parts[f"linear [{tiny.VOCAB}, 64]"]["calls"] == 1
    assert parts["attention"]["calls"] == layers
    assert rnd["between_bursts_us"] > 0 and rnd["tok_s"] > 0
    assert 0 < rnd["roofline_ratio"]
    # The program holds four rows (three padded to a bucket), each of two chosen experts of
    # 2 x 3 x 32 x 64 FLOPs.
    assert parts["routed experts"]["flops"] == 4 * 2 * 2 * 3 * 32 * 64
    assert parts["linear [64, 64]"]["flops"] == 4 * 2 * 64 * 64
    report = out.with_suffix(".md").read_text()
    assert "| routed experts |" in report and "3-row decode step" in report
    # Each weight call against the longer of reading its weights and computing its FLOPs.
    assert res["fma_gflop_s"] > 0 and "of their bound" in report
    assert 0 < res["attainable_step_us"] < rnd["profiled_step_us"] and "at best" in report


def test_bf16_products_calls_are_bounded_by_the_dot_products_ceiling():
    """A bf16 products call's bound takes the bfloat16 dot products' ceiling where the run
    measured one; every other call, and every call without it, the FMA's."""
    script = _script()
    res = {"fma_gflop_s": 100.0, "bf16_dot_gflop_s": 200.0}
    assert script.ceiling(res, "routed experts (bf16p rows)") == 200.0
    assert script.ceiling(res, "linear [64, 64] (bf16p rows)") == 200.0
    assert script.ceiling(res, "routed experts (bf16 rows)") == 100.0
    assert script.ceiling({"fma_gflop_s": 100.0}, "routed experts (bf16p rows)") == 100.0


def test_the_attainable_step_puts_weight_calls_and_attention_at_their_bounds():
    """Weight calls at their bound, attention at the keys and values over the faster read, the
    rest as it ran; the step's own row is not a part."""
    script = _script()
    rows = [
        {"part": "routed experts", "µs a step": 100.0, "/ bound": 0.5},
        {"part": "attention", "µs a step": 40.0},
        {"part": "RMSNorm", "µs a step": 10.0},
        {"part": "between bursts", "µs a step": 5.0},
        {"part": "step (profiled)", "µs a step": 160.0},
    ]
    res = {"step_bytes": 3e6, "weight_bytes": 2e6}  # 1 MB of keys and values: 20 µs at 50 GB/s
    rnd = {"read_gb_s": [40.0, 50.0]}
    assert script.attainable_step(res, rnd, rows) == pytest.approx(50 + 20 + 10 + 5)


def _script():
    """experiments/step_anatomy.py as a module."""
    return experiment("step_anatomy")
