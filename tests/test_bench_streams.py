"""experiments/bench_streams.py: its driver builds with the kernels' flags, times every layout,
and holds each against the plain read of items as long in the same repeat."""

import pytest
from experiment_util import experiment

from colibri import kernels

pytestmark = pytest.mark.skipif(kernels.compiler() is None, reason="no C++ compiler")


def test_every_layout_is_timed_against_the_read_of_its_items(tmp_path):
    script = experiment("bench_streams")
    exe = script.build(tmp_path)
    row_floats = 64  # rows of 256 bytes; items of 64 and of 256 rows
    rows = script.run(exe, row_floats, 8, 3)
    by_name = {r["layout"]: r for r in rows}
    assert len(by_name) == len(rows)
    chunk = script.CHUNK_ROWS
    row_kib = row_floats * 4 / 1024
    for name in ("read", "read, items 4x as long"):
        assert by_name[name]["/ read (median)"] == 1.0  # each read against itself
    odd = by_name["4 rows an odd number apart, items 4x as long, 1 KiB fetched ahead"]
    assert odd["gap KiB"] == pytest.approx((chunk - 1) * row_kib)  # an odd number of rows
    assert odd["item KiB"] == pytest.approx(4 * chunk * row_kib)
    assert by_name["4 rows a quarter apart"]["gap KiB"] == pytest.approx(chunk / 4 * row_kib)
    for r in rows:
        assert r["GB/s"] > 0 and 0 < r["/ read (median)"] < 100, r
