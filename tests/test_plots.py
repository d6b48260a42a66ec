"""Plots rendered to PNG and read back: colours at known cells, bar tops at known values."""

from __future__ import annotations

import io

import matplotlib.image
import numpy as np
import pandas as pd
import pytest
from matplotlib import colormaps
from matplotlib.colors import Normalize, to_rgb

from colibri.client import Turn, emap_frame, entropy_frame, turns_frame
from colibri.protocol.codec import Done, Emap, Hits, Perf
from colibri.widgets import plots

TOL = 3 / 255  # PNG rounding plus antialiasing at a cell's interior


def render(fig) -> np.ndarray:
    """RGB float [H, W, 3] of the PNG, with the transforms of that very draw."""
    img = matplotlib.image.imread(io.BytesIO(plots.to_png(fig)), format="png")
    return img[..., :3]


def pixel(img: np.ndarray, ax, x: float, y: float) -> np.ndarray:
    """The PNG pixel at data point (x, y) of ax (display y grows upward, PNG rows downward)."""
    px, py = ax.transData.transform((x, y))
    return img[int(img.shape[0] - py), int(px)]


def nearest_tier(rgb: np.ndarray) -> int:
    """The tier whose palette colour has the closest hue direction (depth only scales 1-rgb)."""
    v = 1 - rgb
    scores = {}
    for t, c in plots.TIER_COLORS.items():
        w = 1 - np.asarray(to_rgb(c))
        scores[t] = float(v @ w / (np.linalg.norm(v) * np.linalg.norm(w) + 1e-9))
    return max(scores, key=scores.get)


# ---------------------------------------------------------------------------- tier map

TIER = np.array([[2, 2, 1, 0, 0, 2], [1, 1, 1, 0, 2, 2], [0, 0, 2, 2, 1, 0]], np.uint8)
HEAT = np.array([[9, 0, 4, 1, 9, 5], [3, 3, 0, 7, 8, 2], [1, 2, 9, 6, 0, 4]], np.uint8)
HIT_CELLS = {(0, 0), (1, 3), (2, 5), (2, 2)}


def emap_of(tier: np.ndarray, heat: np.ndarray) -> Emap:
    return Emap(*tier.shape, ((tier << 6) | heat).astype(np.uint8).tobytes())


@pytest.mark.parametrize("as_frame", [False, True])
def test_tier_map_colours_each_cell_by_tier_and_heat(as_frame):
    emap = emap_of(TIER, HEAT)
    hits = Hits.from_set(3, 6, HIT_CELLS)
    fig = (
        plots.plot_tier_map(emap_frame(emap, hits)) if as_frame else plots.plot_tier_map(emap, hits)
    )
    ax = fig.axes[0]
    img = render(fig)
    want = plots.cell_rgb(TIER, HEAT)
    for r in range(3):
        for c in range(6):
            off = pixel(img, ax, c + 0.35, r + 0.35)  # inside the cell, clear of the dot
            assert np.abs(off - want[r, c]).max() <= TOL, (r, c, off, want[r, c])
            assert nearest_tier(off) == TIER[r, c], (r, c)
            centre = pixel(img, ax, c, r)
            if (r, c) in HIT_CELLS:
                assert centre.max() <= TOL, (r, c, centre)  # the black HITS dot
            else:
                assert np.abs(centre - want[r, c]).max() <= TOL, (r, c)


def test_tier_map_depth_follows_heat():
    """Within a tier the hottest expert is the full palette colour, a cold one a pale tint."""
    emap = emap_of(TIER, HEAT)
    fig = plots.plot_tier_map(emap)
    img, ax = render(fig), fig.axes[0]
    device = np.asarray(to_rgb(plots.TIER_COLORS[2]))
    hottest = pixel(img, ax, 0.3, 0.3)  # (0, 0): device, heat 9 = the map's maximum
    cold = pixel(img, ax, 1.3, 0.3)  # (0, 1): device, heat 0
    assert np.abs(hottest - device).max() <= TOL
    assert np.abs((1 - cold) - plots.MIN_DEPTH * (1 - device)).max() <= TOL
    assert cold.mean() > hottest.mean()  # colder is lighter


# ---------------------------------------------------------------------------- PERF


def perf_turn(rid: int, dt: float, ewait, emm, attn, kvb, head, tag=None) -> Turn:
    return Turn(
        id=rid,
        slot=0,
        prompt="",
        tag=tag,
        text="",
        tokens=(),
        accept=None,
        done=Done(rid, 4, 10.0, 100.0, 0.3, 3, False),
        error=None,
        perf=Perf(rid, dt, 0.9, ewait, emm, attn, kvb, head),
        entropy=(1.0, 2.0),
        topk=(),
        hits=(),
        emap=None,
        tiers=None,
        gpus=None,
        hwinfo=None,
        repins=(),
    )


TURNS = [
    perf_turn(1, 2.0, 0.3, 0.5, 0.6, 0.1, 0.2, tag="short"),
    perf_turn(2, 3.5, 1.0, 0.8, 0.4, 0.0, 0.3),
    perf_turn(3, 1.0, 0.0, 0.2, 0.3, 0.05, 0.1, tag="long"),
]


def test_perf_bars_stack_to_dt():
    fig = plots.plot_perf(turns_frame(TURNS))
    ax = fig.axes[0]
    tops = np.zeros(len(TURNS))
    for bars in ax.containers:
        tops += [b.get_height() for b in bars]
    assert tops == pytest.approx([t.perf.dt for t in TURNS])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["short", "#2", "long"]


def test_perf_picture_top_and_segment_colours():
    fig = plots.plot_perf(TURNS)
    ax = fig.axes[0]
    img = render(fig)
    y_top = ax.transData.transform((0, ax.get_ylim()[1]))[1]
    y_bottom = ax.transData.transform((0, 0))[1]
    for x, turn in enumerate(TURNS):
        px = int(ax.transData.transform((x, 0))[0])
        first = int(img.shape[0] - y_top) + 4  # below the top spine
        column = img[first : int(img.shape[0] - y_bottom), px]
        filled = np.nonzero(np.abs(column - 1).max(axis=1) > 0.05)[0]
        top_row = first + filled[0]
        top = ax.transData.inverted().transform((px, img.shape[0] - top_row))[1]
        one_px = ax.transData.inverted().transform((0, y_bottom + 1))[1]
        assert abs(top - turn.perf.dt) <= 1.5 * one_px, (x, top, turn.perf.dt)
        lo = 0.0
        parts = plots.perf_frame(turns_frame([turn])).iloc[0]
        for part in plots.PERF_PARTS:
            h = parts[part]
            if h / turn.perf.dt > 0.05:  # tall enough to sample its middle
                got = pixel(img, ax, x, lo + h / 2)
                assert np.abs(got - to_rgb(plots.PERF_COLORS[part])).max() <= TOL, part
            lo += h


# ---------------------------------------------------------------------------- entropy


def test_entropy_bars_reach_their_values():
    values = [0.5, 2.75, 1.5, 3.0]
    fig = plots.plot_entropy(values, n_experts=8)
    ax = fig.axes[0]
    img = render(fig)
    blue = to_rgb(plots.TIER_COLORS[2])
    for layer, h in enumerate(values):
        assert np.abs(pixel(img, ax, layer, h * 0.98) - blue).max() <= TOL
        above = pixel(img, ax, layer, h + 0.08)
        assert np.abs(above - blue).max() > 0.2  # the bar ends at h
    line = ax.lines[0].get_ydata()
    assert line[0] == pytest.approx(3.0)  # log2(8): the uniform maximum


def test_entropy_heatmap_cells():
    frame = entropy_frame(TURNS[:2])
    frame.loc[frame.turn == 1, "entropy_bits"] = [3.0, 0.5]
    fig = plots.plot_entropy_turns(frame)
    ax = fig.axes[0]
    img = render(fig)
    norm = Normalize(0.5, 3.0)
    want = {(0, 0): 1.0, (1, 0): 2.0, (0, 1): 3.0, (1, 1): 0.5}  # (layer, turn): bits
    for (layer, turn), bits in want.items():
        got = pixel(img, ax, turn, layer)
        assert np.abs(got - colormaps["viridis"](norm(bits))[:3]).max() <= TOL
    assert [t.get_text() for t in ax.get_xticklabels()] == ["short", "#2"]


def test_plots_draw_into_given_axes():
    from matplotlib.figure import Figure

    fig = Figure()
    a, b, c = fig.subplots(1, 3)
    assert plots.plot_entropy([1, 2], ax=a) is fig
    assert plots.plot_tier_map(emap_of(TIER, HEAT), ax=b) is fig
    assert plots.plot_perf(pd.DataFrame(turns_frame(TURNS)), ax=c) is fig
    assert render(fig).shape[2] == 3


def test_figures_show_inline_as_png():
    fig = plots.plot_entropy([1.0, 2.0])
    assert fig._repr_png_().startswith(b"\x89PNG")  # Jupyter shows it without pyplot
    grid, axes = plots.subplots(2, 3, figsize=(6, 4))
    assert axes.shape == (2, 3) and plots.plot_entropy([1.0], ax=axes[1, 2]) is grid


# ---------------------------------------------------------------------------- sizes and labels


def test_figures_are_sized_in_pixels_and_drawn_sharp():
    """Inline figures: a PNG of SCALE x their pixel size, shown at that pixel size (metadata),
    so a frontend never enlarges them; the aspect ratio is the figure's."""
    fig = plots.plot_perf(TURNS)
    assert fig.dpi == plots.DPI
    w, h = plots.pixel_size(fig)
    inches = fig.get_size_inches()
    assert (w, h) == (round(inches[0] * plots.DPI), round(inches[1] * plots.DPI))
    data, meta = fig._repr_mimebundle_()
    pw, ph = plots.png_size(data["image/png"])
    assert meta["image/png"] == {"width": w, "height": h}
    assert abs(pw - plots.SCALE * w) <= 1 and abs(ph - plots.SCALE * h) <= 1
    assert plots.png_size(fig._repr_png_()) == (w, h)  # the plain PNG: 1 pixel a pixel
    grid, _ = plots.subplots(1, 2, figsize=(6, 2))
    assert plots.pixel_size(grid) == (600, 200)
    with pytest.raises(ValueError):
        plots.png_size(b"GIF89a" + bytes(30))


def test_long_turn_labels_are_cut():
    turns = [perf_turn(1, 1.0, 0, 0, 0, 0, 0, tag="def fibonacci(n):\n    return n if n < 2")]
    ax = plots.plot_perf(turns).axes[0]
    (label,) = [t.get_text() for t in ax.get_xticklabels()]
    assert label == plots.short_label("def fibonacci(n): return n if n < 2")
    assert len(label) == plots.LABEL_CHARS and label.endswith("…") and "\n" not in label
    assert plots.short_label("  a\tb  ") == "a b"


def test_perf_running_turns_are_hatched_outlines():
    fig = plots.plot_perf(TURNS[:2], running=[("now", 1.25)])
    ax = fig.axes[0]
    running = [b for bars in ax.containers for b in bars if b.get_gid() == "running"]
    assert [b.get_height() for b in running] == [1.25] and running[0].get_x() == pytest.approx(1.65)
    assert running[0].get_hatch() == "//"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["short", "#2", "now"]
    assert "running (not split yet)" in [t.get_text() for t in ax.get_legend().get_texts()]
    alone = plots.plot_perf(turns_frame([]), running=[("first", 0.5)])
    assert [t.get_text() for t in alone.axes[0].get_xticklabels()] == ["first"]


def test_perf_says_when_phases_are_not_timed():
    untimed = [perf_turn(1, 0.8, 0, 0, 0, 0, 0, tag="resident")]
    texts = [t.get_text() for t in plots.plot_perf(untimed).axes[0].texts]
    assert any("not timed" in t for t in texts)
    assert not plots.plot_perf(TURNS).axes[0].texts


def test_entropy_estimate_is_hatched():
    ax = plots.plot_entropy([1.0, 2.0], hatch="//").axes[0]
    assert [b.get_hatch() for b in ax.patches] == ["//", "//"]
    assert [b.get_height() for b in ax.patches] == [1.0, 2.0]


def test_entropy_finite_sample_uniform_line():
    ax = plots.plot_entropy([4.0, 4.2], n_experts=32, uniform_bits=4.64, tokens=16).axes[0]
    assert [ln.get_ydata()[0] for ln in ax.lines] == pytest.approx([5.0, 4.64])
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["uniform, many tokens", "uniform at 16 tokens"]
