"""Matplotlib figures of engine telemetry (routing entropy, tier map, PERF breakdown), for
notebooks, scripts and papers alike.

Every function returns a `PlotFigure` (a matplotlib Figure built without pyplot: no global
state, safe off the main thread, shown inline by Jupyter as a PNG), or draws into a given `ax`
and returns its figure; `subplots` makes a grid of axes to draw several into.

Palettes are fixed so figures compare across runs:

- tiers (`TIER_COLORS`): device blue, RAM orange, disk grey (Okabe-Ito: told apart under the
  common colour-vision deficiencies; the gateway's page, web/dist/palette.js, uses the same).
  In the tier map an expert's heat (bit length of its cumulative selection count) sets how
  deep its tier colour is: the hottest expert of the map gets the full colour, a
  never-selected one a pale tint (`MIN_DEPTH`).
  Experts routed in the HITS window carry a black dot.
- PERF parts (`PERF_COLORS`), bottom to top: disk wait, expert matmul, attention, kv expansion,
  head, other; each turn's stack is exactly its dt (see `colibri.client.perf_parts`). A turn
  still running is a hatched outline of the seconds since its acceptance (not yet split).

Sizes are in pixels: figures are `DPI` dots per inch, and shown inline at their own size
(width and height in the display metadata) from a PNG drawn at `SCALE` times that, so they
stay sharp on high-density screens and are never enlarged; `pixel_size` gives the size.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.collections import PatchCollection
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Ellipse, Patch

from colibri.client import (
    PERF_PARTS,
    TIER_NAMES,
    Turn,
    heat_grid,
    hits_grid,
    perf_frame,
    tier_grid,
    turns_frame,
)
from colibri.protocol.codec import Emap, Entropy, Hits

TIER_COLORS = {2: "#0072B2", 1: "#E69F00", 0: "#999999"}  # device, RAM, disk
PERF_COLORS = dict(
    zip(PERF_PARTS, ("#d7191c", "#2c7bb6", "#fdae61", "#abd9e9", "#7b3294", "#bababa"), strict=True)
)
RUNNING_COLOR = "#555555"  # outline of a turn in flight (PERF)
HIT_COLOR = "#000000"
MIN_DEPTH = 0.25  # colour depth of a never-selected expert (1 = the full tier colour)
HIT_RADIUS = 0.2  # of a cell
DPI = 100  # figure pixels per inch: a figure's size in inches x DPI is its size on screen
SCALE = 2  # PNG pixels per screen pixel (sharp on high-density screens)
LABEL_CHARS = 18  # turn labels longer than this are cut (with an ellipsis) under the axis


class PlotFigure(Figure):
    """A Figure (`DPI` dots per inch unless given) that Jupyter displays as a PNG even when
    pyplot is not in use: drawn at `SCALE` times its pixel size, shown at its pixel size."""

    def __init__(self, *args, dpi: float | None = None, **kw):
        super().__init__(*args, dpi=dpi or DPI, **kw)

    def _repr_png_(self) -> bytes:
        return to_png(self)

    def _repr_mimebundle_(self, include=None, exclude=None):
        w, h = pixel_size(self)
        return {"image/png": to_png(self, scale=SCALE)}, {"image/png": {"width": w, "height": h}}


def pixel_size(fig: Figure) -> tuple[int, int]:
    """(width, height) of the figure in screen pixels: its size in inches times its dpi."""
    w, h = fig.get_size_inches() * fig.dpi
    return int(round(w)), int(round(h))


def subplots(
    nrows: int = 1, ncols: int = 1, *, figsize=None, dpi: float | None = None, **kw
) -> tuple[PlotFigure, np.ndarray]:
    """A PlotFigure with a grid of axes (always a 2-D array), constrained layout."""
    fig = PlotFigure(figsize=figsize, dpi=dpi, layout="constrained")
    return fig, fig.subplots(nrows, ncols, squeeze=False, **kw)


# ---------------------------------------------------------------------------- tier map


def cell_rgb(tier: np.ndarray, heat: np.ndarray, max_heat: int | None = None) -> np.ndarray:
    """float [L, E, 3]: the tier colour, blended toward white as heat falls."""
    base = np.array([to_rgb(TIER_COLORS[t]) for t in range(3)])[tier]  # [L, E, 3]
    top = max(int(heat.max()) if heat.size else 0, 1) if max_heat is None else max(max_heat, 1)
    depth = MIN_DEPTH + (1 - MIN_DEPTH) * np.clip(heat / top, 0, 1)
    return 1 - (1 - base) * depth[..., None]


def plot_tier_map(
    emap: Emap | pd.DataFrame,
    hits: Hits | np.ndarray | None = None,
    *,
    ax=None,
    title: str | None = "Expert tiers (deeper = hotter)",
) -> Figure:
    """Rows MoE layers, columns experts: colour the tier, depth the heat, dots the HITS.

    `emap` is an EMAP line or a `client.emap_frame` table (whose `hit` column is used when
    `hits` is None).
    """
    tier, heat, hit = _map_grids(emap, hits)
    L, E = tier.shape
    fig, ax = _axes(ax, (min(16.0, 2.5 + 0.28 * E), 1.6 + 0.32 * L))
    ax.imshow(cell_rgb(tier, heat), aspect="auto", interpolation="nearest")
    rows, cols = np.nonzero(hit)
    dots = [
        Ellipse((c, r), 2 * HIT_RADIUS, 2 * HIT_RADIUS) for r, c in zip(rows, cols, strict=True)
    ]
    ax.add_collection(PatchCollection(dots, facecolor=HIT_COLOR, edgecolor="none"))
    ax.set(xlabel="expert", ylabel="MoE layer", title=title)
    ax.set_xticks(_ticks(E))
    ax.set_yticks(range(L))
    handles = [Patch(color=TIER_COLORS[t], label=TIER_NAMES[t]) for t in (2, 1, 0)]
    handles.append(Line2D([], [], ls="", marker="o", color=HIT_COLOR, label="routed (HITS)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return fig


def _map_grids(emap, hits) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if isinstance(emap, pd.DataFrame):
        shape = (int(emap.layer.max()) + 1, int(emap.expert.max()) + 1) if len(emap) else (0, 0)
        idx = (emap.layer.to_numpy(), emap.expert.to_numpy())
        tier, heat, hit = (np.zeros(shape, t) for t in (np.uint8, np.uint8, bool))
        tier[idx], heat[idx], hit[idx] = emap.tier, emap.heat, emap.hit.astype(bool)
    else:
        tier, heat = tier_grid(emap), heat_grid(emap)
        hit = np.zeros(tier.shape, bool)
    if hits is not None:
        hit = hits_grid(hits) if isinstance(hits, Hits) else np.asarray(hits, bool)
    return tier, heat, hit


def _ticks(n: int) -> range:
    return range(0, n, 1 if n <= 32 else 4 if n <= 128 else 16)


# ---------------------------------------------------------------------------- entropy


def plot_entropy(
    entropy: Turn | Entropy | Sequence[float],
    *,
    n_experts: int | None = None,
    ax=None,
    title: str | None = "Routing entropy per MoE layer",
    hatch: str | None = None,
    uniform_bits: float | None = None,
    tokens: int | None = None,
) -> Figure:
    """One turn's routing entropy per MoE layer, bits; with `n_experts`, the uniform maximum
    log2(E) (the limit of many tokens). `uniform_bits`: what a uniform router reads at this
    sample size (`routing_stats.uniform_entropy_exact` for the turn's `tokens`), a dotted
    line. `hatch`: draw the bars as hatched outlines (an estimate, e.g. while a turn runs)."""
    values = _entropy_values(entropy)
    fig, ax = _axes(ax, (max(4.0, 1.5 + 0.45 * len(values)), 3.0))
    x = range(len(values))
    if hatch:
        ax.bar(x, values, facecolor="white", edgecolor=TIER_COLORS[2], hatch=hatch, lw=1)
    else:
        ax.bar(x, values, color=TIER_COLORS[2])
    top = values.max(initial=0)
    if n_experts:
        top = max(top, np.log2(n_experts))
        ax.axhline(np.log2(n_experts), color="0.4", ls="--", lw=1, label="uniform, many tokens")
    if uniform_bits is not None:
        at = f" at {tokens} tokens" if tokens else ", this many tokens"
        ax.axhline(uniform_bits, color="0.1", ls=":", lw=1.5, label=f"uniform{at}")
        top = max(top, uniform_bits)
    if n_experts or uniform_bits is not None:
        ax.set_ylim(0, 1.18 * top)
        ax.legend(loc="upper right", frameon=False)
    ax.set(xlabel="MoE layer", ylabel="entropy (bits)", title=title)
    ax.set_xticks(range(len(values)))
    return fig


def plot_entropy_turns(
    entropy: pd.DataFrame,
    *,
    label: str = "tag",
    ax=None,
    title: str | None = "Routing entropy, layers x turns",
) -> Figure:
    """Heat map of a `client.entropy_frame` table: rows MoE layers, columns turns, colour bits.

    Columns are labelled by `label` (the turn's tag) where set, else by request id.
    """
    grid = entropy.pivot_table(index="layer", columns="turn", values="entropy_bits")
    firsts = entropy.drop_duplicates("turn").set_index("turn")
    names = [_turn_label(firsts.loc[t], label) for t in grid.columns]
    fig, ax = _axes(ax, (max(4.0, 2.5 + 0.45 * grid.shape[1]), 1.6 + 0.35 * grid.shape[0]))
    im = ax.imshow(grid.to_numpy(), aspect="auto", interpolation="nearest", cmap="viridis")
    fig.colorbar(im, ax=ax, label="bits")
    _label_turns(ax, names)
    ax.set_yticks(range(grid.shape[0]))
    ax.set(xlabel="turn", ylabel="MoE layer", title=title)
    return fig


def _label_turns(ax, names: list[str]) -> None:
    """Turn names under the x axis (cut to LABEL_CHARS), slanted when they would collide."""
    names = [short_label(n) for n in names]
    slant = len(names) > 6 or max(map(len, names), default=0) > 6
    ax.set_xticks(
        range(len(names)), names, rotation=30 if slant else 0, ha="right" if slant else "center"
    )


def short_label(text: str, limit: int = LABEL_CHARS) -> str:
    """One line of at most `limit` characters: whitespace runs become one space, and a longer
    text is cut with an ellipsis."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1].rstrip() + "…"


def _entropy_values(entropy) -> np.ndarray:
    if isinstance(entropy, Turn):
        return np.asarray(entropy.entropy, float)
    if isinstance(entropy, Entropy):
        return np.asarray(entropy.values, float)
    return np.asarray(entropy, float)


def _turn_label(row, label: str) -> str:
    value = row.get(label) if label in row else None
    return str(value) if value is not None and value == value else f"#{row['id']}"


# ---------------------------------------------------------------------------- PERF


def plot_perf(
    turns: pd.DataFrame | Sequence[Turn],
    *,
    label: str = "tag",
    ax=None,
    title: str | None = "Where each turn's time went",
    running: Sequence[tuple[str, float]] = (),
) -> Figure:
    """Stacked bar per turn of PERF_PARTS (seconds); each bar's height is the turn's dt
    (acceptance to DONE: prefill and decode; `client.TURN_COLUMNS`). `running`: (label,
    seconds since acceptance) of turns in flight, drawn after them as hatched outlines (their
    time is split only at their PERF line). Where no turn has a timed phase (every expert
    resident without `profile=True`: one compiled program a step), the figure says so."""
    df = turns if isinstance(turns, pd.DataFrame) else turns_frame(list(turns))
    parts = perf_frame(df)
    n = len(df) + len(running)
    fig, ax = _axes(ax, (max(4.0, 3.0 + 0.6 * n), 3.4))
    x = np.arange(len(df))
    bottom = np.zeros(len(df))
    for part in PERF_PARTS:
        h = parts[part].to_numpy(float)
        ax.bar(x, h, bottom=bottom, color=PERF_COLORS[part], label=part, width=0.7)
        bottom += h
    names = [_turn_label(row, label) for _, row in df.iterrows()]
    handles = [Patch(color=PERF_COLORS[part], label=part) for part in PERF_PARTS]
    if running:
        style = dict(facecolor="white", edgecolor=RUNNING_COLOR, hatch="//")
        xr = np.arange(len(df), n)
        ax.bar(xr, [float(s) for _, s in running], width=0.7, gid="running", **style)
        handles.append(Patch(label="running (not split yet)", **style))
        names += [str(name) for name, _ in running]
    _label_turns(ax, names)
    ax.set(xlabel="turn", ylabel="seconds", title=title)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    timed = parts.drop(columns="other").to_numpy(float).sum() if len(df) else 1.0
    if len(df) and timed == 0:
        ax.text(
            0.01,
            0.98,
            "phases not timed (every expert resident: one program a step); profile=True times them",
            transform=ax.transAxes,
            va="top",
            fontsize=8,
            color="0.3",
        )
    return fig


# ---------------------------------------------------------------------------- helpers


def _axes(ax, size: tuple[float, float]):
    if ax is not None:
        return ax.figure, ax
    fig = PlotFigure(figsize=size, layout="constrained")
    return fig, fig.add_subplot()


def to_png(fig: Figure, dpi: float | None = None, *, scale: float = 1.0) -> bytes:
    """The figure as PNG bytes (Agg), at its own dpi (or `dpi`) times `scale`."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=(dpi or fig.dpi) * scale)
    return buf.getvalue()


def png_size(png: bytes) -> tuple[int, int]:
    """(width, height) in pixels of PNG bytes (from its IHDR chunk)."""
    if png[:8] != b"\x89PNG\r\n\x1a\n" or png[12:16] != b"IHDR":
        raise ValueError("not a PNG")
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
