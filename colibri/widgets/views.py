"""Live ipywidgets views of a running engine: EntropyPlot, TierMap, PerfBreakdown, Dashboard.

Each view shows a `plots` figure as an `ipywidgets.Image` (a PNG render: no frontend matplotlib
backend needed, and safe to update from the client's reader thread). Views subscribe to an
`Engine` and redraw when their data changes, at most once per `min_interval` seconds; the last
change is always drawn (trailing edge). Without an engine, call `update(...)` yourself.

Images are sized in pixels: the PNG is drawn at `plots.SCALE` times the figure's pixel size
and the image's `width` attribute is that pixel size, so it is shown sharp, never enlarged
(no CSS width: a narrower output area only shrinks it, keeping its proportions).

While a turn runs (from its ACCEPT to its DONE) the views follow it: the tier map marks every
expert routed in the turn's HITS windows so far, the entropy view shows an estimate from those
windows, and the PERF view a hatched bar of the seconds since acceptance; at DONE they show
the turn's own ENTROPY and PERF.
"""

from __future__ import annotations

import html
import threading
import time

import ipywidgets as widgets
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from colibri.analysis import entropy_bits
from colibri.client import Engine, Request, Turn, entropy_frame, hits_grid, turns_frame
from colibri.protocol import codec
from colibri.protocol.codec import Accept, Data, Done, Emap, Error, Hits
from colibri.widgets import plots

_RENDER_LOCK = threading.Lock()  # Agg text rendering is not thread-safe across figures
MIN_INTERVAL = 0.25  # seconds between redraws of one view
OUTPUT_HEIGHT = "16em"  # the Dashboard's text area: taller answers scroll inside it
LABEL_CHARS = 24  # a turn labelled by its prompt keeps this many characters


def prompt_label(prompt: str, limit: int = LABEL_CHARS) -> str:
    """A turn's label from its prompt: one line, at most `limit` characters (an ellipsis
    marks a cut)."""
    return plots.short_label(prompt, limit) or "(empty)"


def request_label(req: Request) -> str:
    """The request's tag, else its prompt's start."""
    return req.tag or prompt_label(req.prompt)


class FigureView(widgets.VBox):
    """A figure as a PNG image, redrawn on demand with throttling. Subclasses build `figure()`.

    The PNG has `scale` times the figure's pixels (`plots.pixel_size`) and is shown at that
    pixel size (`image.width`). `width`, if given, bounds the view (CSS, e.g. "600px"): a wider
    image scrolls inside it instead of being scaled."""

    def __init__(
        self,
        min_interval: float = MIN_INTERVAL,
        width: str | None = None,
        scale: float | None = None,
    ):
        self.image = widgets.Image(format="png", layout=widgets.Layout(align_self="flex-start"))
        box = widgets.Layout(align_items="flex-start")
        if width:
            box = widgets.Layout(align_items="flex-start", max_width=width, overflow="auto")
        super().__init__([self.image], layout=box)
        self.scale = scale or plots.SCALE
        self.pixels: tuple[int, int] | None = None  # the shown figure's size, screen pixels
        self.min_interval = min_interval
        self.draws = 0  # renders so far (tests and curious users)
        self._lock = threading.Lock()
        self._last = 0.0
        self._timer: threading.Timer | None = None
        self._unsubscribe = None

    def figure(self) -> Figure | None:
        """The figure of the current state; None while there is nothing to show."""
        raise NotImplementedError

    def redraw(self) -> None:
        """Render now, in the calling thread."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._last = time.monotonic()
        with _RENDER_LOCK:
            fig = self.figure()
            if fig is None:
                return
            png = plots.to_png(fig, scale=self.scale)
            self.pixels = plots.pixel_size(fig)
        with self.image.hold_sync():
            self.image.width = str(self.pixels[0])  # the height follows (CSS height: auto)
            self.image.value = png
        self.draws += 1

    def request_redraw(self) -> None:
        """Redraw soon, off the caller's thread, and no sooner than min_interval after the last."""
        with self._lock:
            if self._timer is not None:
                return  # the pending draw will show the latest state
            wait = max(0.0, self._last + self.min_interval - time.monotonic())
            self._timer = threading.Timer(wait, self._fire)
            self._timer.daemon = True
            self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            self._timer = None
            self._last = time.monotonic()  # requests during this draw wait a full interval
        self.redraw()

    def attach(self, engine: Engine) -> None:
        """Follow `engine`'s events (replacing any engine followed before)."""
        self.detach()
        self._unsubscribe = engine.subscribe(self._on_event)
        self._from_engine(engine)

    def detach(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def _from_engine(self, engine: Engine) -> None:
        """Take the engine's current state (at attach)."""

    def _on_event(self, ev: codec.Event, req: Request | None) -> None:
        """Reader thread: update state and request_redraw() when something shown changed."""


class _TurnFollower:
    """Which requests are in flight, from their ACCEPT to their DONE or ERROR (the reader
    thread's view); `began` is true for the ACCEPT that starts a turn after an idle spell."""

    def __init__(self) -> None:
        self.running: dict[int, Request] = {}

    def follow(self, ev: codec.Event, req: Request | None) -> str | None:
        """The step `ev` is: began (the first of a run of overlapping turns), accepted, ended
        or None."""
        if req is None:
            return None
        if isinstance(ev, Accept):
            began = not self.running
            self.running[req.id] = req
            return "began" if began else "accepted"
        if isinstance(ev, Done | Error):
            self.running.pop(req.id, None)
            return "ended"
        return None


class EntropyPlot(FigureView):
    """Routing entropy per MoE layer of the latest turn, beside layers x turns so far.

    While a turn runs, the left panel is an estimate from its HITS windows (hatched): the
    entropy of how many windows routed each expert (an expert counts once a window however
    many tokens chose it, so it runs below ENTROPY when few experts take many tokens); at
    DONE the turn's ENTROPY (selection counts) replaces it."""

    def __init__(self, engine: Engine | None = None, *, n_experts: int | None = None, **kw):
        super().__init__(**kw)
        self.n_experts = n_experts
        self._engine: Engine | None = None
        self._turns = _TurnFollower()
        self.values: tuple[float, ...] = ()
        self.table = entropy_frame([])
        self.live: np.ndarray | None = None  # int [L, E]: HITS windows routing each expert
        self.live_windows = 0
        if engine is not None:
            self.attach(engine)

    def update(self, values, table: pd.DataFrame | None = None) -> None:
        """Show `values` (a Turn, ENTROPY line or bits per layer) and optionally a history."""
        self.values = tuple(plots._entropy_values(values))
        if table is not None:
            self.table = table
        self.request_redraw()

    def start_turn(self) -> None:
        """Begin a live estimate (shown once a HITS window arrives)."""
        self.live, self.live_windows = None, 0

    def add_hits(self, hits: Hits | np.ndarray) -> None:
        """Count one HITS window into the live estimate."""
        grid = hits_grid(hits) if isinstance(hits, Hits) else np.asarray(hits, bool)
        live = self.live
        if live is None or live.shape != grid.shape:
            live = np.zeros(grid.shape, np.int64)
        self.live = live + grid  # a new array: a draw in progress keeps the one it read
        self.live_windows += 1
        self.request_redraw()

    def end_turn(self) -> None:
        self.live, self.live_windows = None, 0

    def live_values(self) -> np.ndarray | None:
        """float [L]: the live estimate, bits; None while there is none."""
        live = self.live
        return None if live is None or not live.any() else entropy_bits(live)

    def figure(self) -> Figure | None:
        live = self.live_values()
        if not self.values and live is None:
            return None
        history = self.table.turn.nunique() if len(self.table) else 0
        fig = plots.PlotFigure(figsize=(10, 3.2) if history else (5, 3.2), layout="constrained")
        axes = fig.subplots(1, 2 if history else 1, squeeze=False)[0]
        if live is not None:
            n = self.live_windows
            title = f"This turn so far (estimate, {n} HITS window{'s' * (n != 1)})"
            plots.plot_entropy(live, n_experts=self.n_experts, ax=axes[0], title=title, hatch="//")
        else:
            plots.plot_entropy(self.values, n_experts=self.n_experts, ax=axes[0], title="Last turn")
        if history:
            plots.plot_entropy_turns(self.table, ax=axes[1], title="All turns")
        return fig

    def _from_engine(self, engine: Engine) -> None:
        emap = engine.session.handshake.emap
        self.n_experts = self.n_experts or (emap.cols if emap else None)
        if engine.turns:
            self.update(engine.turns[-1], engine.entropy_df())
        self._engine = engine

    def _on_event(self, ev, req) -> None:
        step = self._turns.follow(ev, req)
        if step == "began":
            self.start_turn()
        elif isinstance(ev, Hits) and self._turns.running:
            self.add_hits(ev)
        elif isinstance(ev, Done) and req is not None:
            if not self._turns.running:
                self.end_turn()
            self.update(req.wait(0), self._engine.entropy_df() if self._engine else None)
        elif step == "ended" and not self._turns.running:
            self.end_turn()
            self.request_redraw()


class TierMap(FigureView):
    """Which experts sit in which tier (EMAP) and which were routed (dots).

    The dots accumulate: every expert routed in any HITS window since the current turn began
    (its ACCEPT, when no other turn was running; `reset_routed()` by hand), so after a turn
    they show all it routed, not only its last window. `hits` is the latest window;
    `accumulate=False` shows only it."""

    def __init__(self, engine: Engine | None = None, *, accumulate: bool = True, **kw):
        super().__init__(**kw)
        self.accumulate = accumulate
        self.emap: Emap | None = None
        self.hits: Hits | None = None
        self.routed: np.ndarray | None = None  # bool [L, E]: routed since the turn began
        self.hits_updates = 0  # HITS windows received (they arrive every few tokens)
        self._turns = _TurnFollower()
        if engine is not None:
            self.attach(engine)

    def update(self, emap: Emap | None = None, hits: Hits | None = None) -> None:
        if emap is not None:
            self.emap = emap
        if hits is not None:
            self.hits = hits
            self.hits_updates += 1
            grid = hits_grid(hits)
            old = self.routed
            keep = self.accumulate and old is not None and old.shape == grid.shape
            self.routed = old | grid if keep else grid
        self.request_redraw()

    def reset_routed(self) -> None:
        """Start the routed marks afresh (a turn begins)."""
        self.routed = None
        self.request_redraw()

    def figure(self) -> Figure | None:
        if self.emap is None:
            return None
        routed = self.routed
        if routed is not None and routed.shape != (self.emap.rows, self.emap.cols):
            routed = None
        title = "Expert tiers (deeper = hotter); dots: routed " + (
            "this turn" if self.accumulate else "in the latest HITS window"
        )
        return plots.plot_tier_map(self.emap, routed, title=title)

    def _from_engine(self, engine: Engine) -> None:
        s = engine.session
        if s.emap is not None:
            self.update(s.emap, s.hits)

    def _on_event(self, ev, req) -> None:
        if self._turns.follow(ev, req) == "began" and self.accumulate:
            self.reset_routed()
        elif isinstance(ev, Emap):
            self.update(emap=ev)
        elif isinstance(ev, Hits):
            self.update(hits=ev)


class PerfBreakdown(FigureView):
    """Stacked PERF bars of the last `last` turns (disk wait, matmul, attention, ...), and a
    hatched bar per turn in flight: the seconds since its ACCEPT on this client's clock,
    growing as its tokens arrive, until its PERF splits it."""

    def __init__(self, engine: Engine | None = None, *, last: int = 12, **kw):
        super().__init__(**kw)
        self.last = last
        self._engine: Engine | None = None
        self._turns = _TurnFollower()
        self.turns = turns_frame([])
        if engine is not None:
            self.attach(engine)

    @property
    def running(self) -> list[tuple[str, float]]:
        """(label, seconds since acceptance) of the turns in flight."""
        now = time.monotonic()
        reqs = list(self._turns.running.values())
        return [(request_label(r), r.running_s(now) or 0.0) for r in reqs]

    def update(self, turns: pd.DataFrame | list[Turn]) -> None:
        df = turns if isinstance(turns, pd.DataFrame) else turns_frame(turns)
        self.turns = df.tail(self.last)
        self.request_redraw()

    def figure(self) -> Figure | None:
        running = self.running
        if not len(self.turns) and not running:
            return None
        return plots.plot_perf(self.turns.tail(max(1, self.last - len(running))), running=running)

    def _from_engine(self, engine: Engine) -> None:
        self._engine = engine
        if engine.turns:
            self.update(engine.turns_df())

    def _on_event(self, ev, req) -> None:
        step = self._turns.follow(ev, req)
        if isinstance(ev, Done) and req is not None and self._engine is not None:
            self.update(self._engine.turns_df())
        elif step is not None or (isinstance(ev, Data) and req is not None):
            self.request_redraw()


class Dashboard(widgets.VBox):
    """A prompt box, streamed text and the three views updating live, with slot and sampling
    controls. Drive it by hand or from Python: set `prompt.value`, `run_button.click()`,
    `wait()` for the Turn.

    Each turn is tagged with `label.value`, or when that is empty with the prompt's start
    (`prompt_label`), so tables and PERF bars tell turns apart. The text streams into a box
    `output_height` tall that scrolls (showing the newest text) once the answer outgrows it.
    The status line counts tokens and the decode rate on this client's clock while the turn
    runs, then gives DONE's figures (`client.TURN_COLUMNS` defines them)."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_tokens: int = 64,
        min_interval: float = MIN_INTERVAL,
        output_height: str = OUTPUT_HEIGHT,
    ):
        self.engine = engine
        self.output_height = output_height
        self.prompt = widgets.Textarea(
            placeholder="Prompt", layout=widgets.Layout(width="100%", height="5em")
        )
        self.label = widgets.Text(
            placeholder="the prompt's start", description="label", layout={"width": "20em"}
        )
        self.slot = widgets.Dropdown(options=list(range(engine.slots)), value=0, description="slot")
        self.max_tokens = widgets.BoundedIntText(max_tokens, min=1, max=4096, description="tokens")
        self.temperature = widgets.FloatSlider(0.0, min=0.0, max=2.0, step=0.05, description="temp")
        self.top_p = widgets.FloatSlider(1.0, min=0.05, max=1.0, step=0.05, description="top_p")
        self.run_button = widgets.Button(description="Run", button_style="primary", icon="play")
        self.stop_button = widgets.Button(description="Stop", icon="stop", disabled=True)
        self.output = widgets.HTML(
            self._box(""), layout=widgets.Layout(width="100%", max_height=output_height)
        )
        self.status = widgets.HTML("")
        self.entropy = EntropyPlot(engine, min_interval=min_interval)
        self.tiers = TierMap(engine, min_interval=min_interval)
        self.perf = PerfBreakdown(engine, min_interval=min_interval)
        self.request: Request | None = None
        self.text = ""
        self._idle = threading.Event()  # set once a finished turn is shown everywhere
        self._idle.set()
        self._unsubscribe = engine.subscribe(self._on_event)
        self.run_button.on_click(lambda _: self.run())
        self.stop_button.on_click(lambda _: self.stop())
        controls = widgets.HBox([self.slot, self.max_tokens, self.temperature, self.top_p])
        buttons = widgets.HBox([self.run_button, self.stop_button, self.label, self.status])
        views = widgets.Tab([self.tiers, self.entropy, self.perf])
        for i, name in enumerate(("Tier map", "Entropy", "PERF")):
            views.set_title(i, name)
        super().__init__([self.prompt, controls, buttons, self.output, views])

    def turn_label(self) -> str:
        """The tag the next turn gets: the label box, else the prompt's start."""
        return self.label.value.strip() or prompt_label(self.prompt.value)

    def run(self) -> Request | None:
        """Submit the prompt with the controls' settings (ignored while a turn streams)."""
        if (self.request is not None and not self.request.done) or not self.prompt.value:
            return None
        self._idle.clear()
        self.text = ""
        self.output.value = self._box("")
        self.status.value = "<i>running…</i>"
        self.run_button.disabled, self.stop_button.disabled = True, False
        self.request = self.engine.submit(
            self.prompt.value,
            slot=self.slot.value,
            max_tokens=self.max_tokens.value,
            temperature=self.temperature.value,
            top_p=self.top_p.value,
            tag=self.turn_label(),
        )
        return self.request

    def stop(self) -> None:
        if self.request is not None and not self.request.done:
            self.request.stop()

    def wait(self, timeout: float | None = None) -> Turn:
        """The running (or last) turn once finished, with every view redrawn for it."""
        if self.request is None:
            raise RuntimeError("nothing was run")
        turn = self.request.wait(timeout)
        if not self._idle.wait(timeout):
            raise TimeoutError("the views did not finish redrawing")
        return turn

    def close(self) -> None:
        self._unsubscribe()
        for view in (self.entropy, self.tiers, self.perf):
            view.detach()
        super().close()

    def _box(self, text: str) -> str:
        return _scroll_box(text, self.output_height)

    def _on_event(self, ev: codec.Event, req: Request | None) -> None:
        if req is None or req is not self.request:
            return
        if isinstance(ev, Data):
            self.text = req.text
            self.output.value = self._box(self.text)
            self.status.value = _running_status(req)
        elif isinstance(ev, Done | Error):
            self._finish(req.wait(0))

    def _finish(self, turn: Turn) -> None:
        self.text = turn.text
        self.output.value = self._box(turn.text)
        self.status.value = _status(turn)
        for view in (self.entropy, self.tiers, self.perf):
            view.redraw()  # the final state, not throttled
        self.run_button.disabled, self.stop_button.disabled = False, True
        self._idle.set()


def _pre(text: str) -> str:
    return f"<pre style='white-space: pre-wrap; margin: 0'>{html.escape(text)}</pre>"


def _scroll_box(text: str, height: str) -> str:
    """The text in a box at most `height` tall that scrolls, anchored at its end: a reversed
    flex column starts scrolled to the bottom, so each redraw shows the newest text."""
    return (
        f"<div class='colibri-output' style='max-height: {height}; overflow-y: auto; "
        "display: flex; flex-direction: column-reverse; border: 1px solid #ddd; "
        f"padding: 0.3em'>{_pre(text)}</div>"
    )


def _running_status(req: Request) -> str:
    rate = req.live_tok_s()
    speed = f", {rate:.1f} tok/s decode (client clock)" if rate else ""
    return f"<i>running…</i> {req.emitted} tokens{speed}"


def _status(turn: Turn) -> str:
    if turn.error is not None:
        return f"<b>error</b> {html.escape(turn.error.code)}"
    d, p = turn.done, turn.perf
    assert d is not None
    h = np.mean(turn.entropy) if turn.entropy else float("nan")
    times = f", {p.dt:.2f} s (prefill {turn.prefill_s:.2f} s)" if p else ""
    return (
        f"{html.escape(turn.tag or '')}: {d.emitted} tokens, {d.tok_s:.1f} tok/s decode, "
        f"hit {d.hit_pct:.1f}%, mean entropy {h:.2f} bits{times}"
    )
