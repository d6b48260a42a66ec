"""Live ipywidgets views of a running engine: EntropyPlot, TierMap, PerfBreakdown, Dashboard.

Each view shows a `plots` figure as an `ipywidgets.Image` (a PNG render: no frontend matplotlib
backend needed, and safe to update from the client's reader thread). Views subscribe to an
`Engine` and redraw when their data changes, at most once per `min_interval` seconds; the last
change is always drawn (trailing edge). Without an engine, call `update(...)` yourself.
"""

from __future__ import annotations

import html
import threading
import time

import ipywidgets as widgets
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from colibri.client import Engine, Request, Turn, entropy_frame, turns_frame
from colibri.protocol import codec
from colibri.protocol.codec import Data, Done, Emap, Error, Hits
from colibri.widgets import plots

_RENDER_LOCK = threading.Lock()  # Agg text rendering is not thread-safe across figures
MIN_INTERVAL = 0.25  # seconds between redraws of one view


class FigureView(widgets.VBox):
    """A figure as a PNG image, redrawn on demand with throttling. Subclasses build `figure()`."""

    def __init__(self, min_interval: float = MIN_INTERVAL, width: str | None = None):
        self.image = widgets.Image(format="png", layout=widgets.Layout(width=width or "auto"))
        super().__init__([self.image])
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
            png = plots.to_png(fig)
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


class EntropyPlot(FigureView):
    """Routing entropy per MoE layer of the latest turn, beside layers x turns so far."""

    def __init__(self, engine: Engine | None = None, *, n_experts: int | None = None, **kw):
        super().__init__(**kw)
        self.n_experts = n_experts
        self._engine: Engine | None = None
        self.values: tuple[float, ...] = ()
        self.table = entropy_frame([])
        if engine is not None:
            self.attach(engine)

    def update(self, values, table: pd.DataFrame | None = None) -> None:
        """Show `values` (a Turn, ENTROPY line or bits per layer) and optionally a history."""
        self.values = tuple(plots._entropy_values(values))
        if table is not None:
            self.table = table
        self.request_redraw()

    def figure(self) -> Figure | None:
        if not self.values:
            return None
        history = self.table.turn.nunique() if len(self.table) else 0
        fig = Figure(figsize=(10, 3.2) if history else (5, 3.2), layout="constrained")
        axes = fig.subplots(1, 2 if history else 1, squeeze=False)[0]
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
        if isinstance(ev, Done) and req is not None:
            self.update(req.wait(0), self._engine.entropy_df())


class TierMap(FigureView):
    """Which experts sit in which tier (EMAP) and which were just routed (the latest HITS)."""

    def __init__(self, engine: Engine | None = None, **kw):
        super().__init__(**kw)
        self.emap: Emap | None = None
        self.hits: Hits | None = None
        self.hits_updates = 0  # HITS windows received (they arrive every few tokens)
        if engine is not None:
            self.attach(engine)

    def update(self, emap: Emap | None = None, hits: Hits | None = None) -> None:
        if emap is not None:
            self.emap = emap
        if hits is not None:
            self.hits = hits
            self.hits_updates += 1
        self.request_redraw()

    def figure(self) -> Figure | None:
        if self.emap is None:
            return None
        hits = self.hits
        if hits is not None and (hits.rows, hits.cols) != (self.emap.rows, self.emap.cols):
            hits = None
        return plots.plot_tier_map(self.emap, hits)

    def _from_engine(self, engine: Engine) -> None:
        s = engine.session
        if s.emap is not None:
            self.update(s.emap, s.hits)

    def _on_event(self, ev, req) -> None:
        if isinstance(ev, Emap):
            self.update(emap=ev)
        elif isinstance(ev, Hits):
            self.update(hits=ev)


class PerfBreakdown(FigureView):
    """Stacked PERF bars of the last `last` turns (disk wait, matmul, attention, ...)."""

    def __init__(self, engine: Engine | None = None, *, last: int = 12, **kw):
        super().__init__(**kw)
        self.last = last
        self._engine: Engine | None = None
        self.turns = turns_frame([])
        if engine is not None:
            self.attach(engine)

    def update(self, turns: pd.DataFrame | list[Turn]) -> None:
        df = turns if isinstance(turns, pd.DataFrame) else turns_frame(turns)
        self.turns = df.tail(self.last)
        self.request_redraw()

    def figure(self) -> Figure | None:
        return plots.plot_perf(self.turns) if len(self.turns) else None

    def _from_engine(self, engine: Engine) -> None:
        self._engine = engine
        if engine.turns:
            self.update(engine.turns_df())

    def _on_event(self, ev, req) -> None:
        if isinstance(ev, Done) and req is not None:
            self.update(self._engine.turns_df())


class Dashboard(widgets.VBox):
    """A prompt box, streamed text and the three views updating live, with slot and sampling
    controls. Drive it by hand or from Python: set `prompt.value`, `run_button.click()`,
    `wait()` for the Turn."""

    def __init__(self, engine: Engine, *, max_tokens: int = 64, min_interval: float = MIN_INTERVAL):
        self.engine = engine
        self.prompt = widgets.Textarea(
            placeholder="Prompt", layout=widgets.Layout(width="100%", height="5em")
        )
        self.slot = widgets.Dropdown(options=list(range(engine.slots)), value=0, description="slot")
        self.max_tokens = widgets.BoundedIntText(max_tokens, min=1, max=4096, description="tokens")
        self.temperature = widgets.FloatSlider(0.0, min=0.0, max=2.0, step=0.05, description="temp")
        self.top_p = widgets.FloatSlider(1.0, min=0.05, max=1.0, step=0.05, description="top_p")
        self.run_button = widgets.Button(description="Run", button_style="primary", icon="play")
        self.stop_button = widgets.Button(description="Stop", icon="stop", disabled=True)
        self.output = widgets.HTML(_pre(""))
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
        buttons = widgets.HBox([self.run_button, self.stop_button, self.status])
        views = widgets.Tab([self.tiers, self.entropy, self.perf])
        for i, name in enumerate(("Tier map", "Entropy", "PERF")):
            views.set_title(i, name)
        super().__init__([self.prompt, controls, buttons, self.output, views])

    def run(self) -> Request | None:
        """Submit the prompt with the controls' settings (ignored while a turn streams)."""
        if (self.request is not None and not self.request.done) or not self.prompt.value:
            return None
        self._idle.clear()
        self.text = ""
        self.output.value = _pre("")
        self.status.value = "<i>running…</i>"
        self.run_button.disabled, self.stop_button.disabled = True, False
        self.request = self.engine.submit(
            self.prompt.value,
            slot=self.slot.value,
            max_tokens=self.max_tokens.value,
            temperature=self.temperature.value,
            top_p=self.top_p.value,
            tag="dashboard",
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

    def _on_event(self, ev: codec.Event, req: Request | None) -> None:
        if req is None or req is not self.request:
            return
        if isinstance(ev, Data):
            self.text = req.text
            self.output.value = _pre(self.text)
        elif isinstance(ev, Done | Error):
            self._finish(req.wait(0))

    def _finish(self, turn: Turn) -> None:
        self.text = turn.text
        self.output.value = _pre(turn.text)
        self.status.value = _status(turn)
        for view in (self.entropy, self.tiers, self.perf):
            view.redraw()  # the final state, not throttled
        self.run_button.disabled, self.stop_button.disabled = False, True
        self._idle.set()


def _pre(text: str) -> str:
    return f"<pre style='white-space: pre-wrap; margin: 0'>{html.escape(text)}</pre>"


def _status(turn: Turn) -> str:
    if turn.error is not None:
        return f"<b>error</b> {html.escape(turn.error.code)}"
    d, p = turn.done, turn.perf
    assert d is not None
    h = np.mean(turn.entropy) if turn.entropy else float("nan")
    dt = f", {p.dt:.2f} s" if p else ""
    return (
        f"{d.emitted} tokens, {d.tok_s:.1f} tok/s, hit {d.hit_pct:.1f}%, "
        f"mean entropy {h:.2f} bits{dt}"
    )
