"""The live views headless (ipywidgets without a frontend): the Dashboard driven through its
Python API against the real engine, and the views' throttling."""

from __future__ import annotations

import io
import threading
import time

import matplotlib.image
import numpy as np
import pytest

from colibri import client
from colibri.client import Engine
from colibri.protocol.codec import Data, Emap, Hits
from colibri.widgets.views import Dashboard, EntropyPlot, FigureView, PerfBreakdown, TierMap

L, E = 3, 8
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = client.synthetic_model(
        tmp_path_factory.mktemp("widgets") / "synth",
        layers=L,
        experts=E,
        top_k=2,
        hidden=64,
        moe_ff=32,
        vocab=300,
    )
    e = Engine(model, slots=2, ctx=128)
    yield e
    assert e.close() == 0, e.stderr()


def picture(view: FigureView) -> np.ndarray:
    png = bytes(view.image.value)
    assert png.startswith(PNG)
    return matplotlib.image.imread(io.BytesIO(png), format="png")


def test_dashboard_run_updates_every_view(engine):
    dash = Dashboard(engine, min_interval=0.05)
    views = (dash.entropy, dash.tiers, dash.perf)
    before = {v: (v.draws, v.image.value) for v in views}
    hits_before = dash.tiers.hits_updates
    streamed: list[str] = []
    engine.subscribe(
        lambda ev, req: streamed.append(dash.text) if isinstance(ev, Data) and req else None
    )

    dash.prompt.value = "The quick brown fox"
    dash.slot.value = 1
    dash.max_tokens.value = 24
    dash.temperature.value = 0.0
    dash.run_button.click()
    assert dash.run_button.disabled and not dash.stop_button.disabled
    turn = dash.wait(120)

    assert turn.ok and turn.slot == 1 and turn.tag == "dashboard"
    assert 1 <= turn.done.emitted <= 24
    assert dash.text == turn.text
    assert len(set(streamed)) > 1  # the text grew while tokens streamed
    assert "tok/s" in dash.status.value and not dash.run_button.disabled
    for v in views:
        draws, png = before[v]
        assert v.draws > draws and bytes(v.image.value) != bytes(png), type(v).__name__
        picture(v)
    # each view shows this turn's data
    assert dash.entropy.values == turn.entropy
    assert dash.tiers.emap == turn.emap and dash.tiers.hits == turn.hits[-1]
    assert dash.perf.turns.id.iloc[-1] == turn.id
    if turn.done.emitted > 12:  # HITS every 6 decode steps: the map moved while streaming
        assert dash.tiers.hits_updates - hits_before >= 2
    dash.close()


def test_dashboard_stop_and_busy(engine):
    dash = Dashboard(engine, min_interval=0.05)
    dash.prompt.value = "Le renard brun"
    dash.max_tokens.value = 200
    req = dash.run()
    assert dash.run() is None  # a second run while streaming is ignored
    for ev in req:
        if isinstance(ev, Data):
            dash.stop_button.click()
            break
    turn = dash.wait(120)
    assert turn.ok and turn.done.emitted < 200 and not turn.done.length_limited
    dash.prompt.value = ""
    assert dash.run() is None  # nothing to send
    dash.close()


def test_views_offline_update_and_render():
    emap = Emap(2, 4, bytes([0x80, 0x41, 0x03, 0x8F, 0x80, 0x80, 0x40, 0x00]))
    tiers = TierMap(min_interval=0)
    assert tiers.figure() is None
    tiers.update(emap, Hits.from_set(2, 4, [(0, 1)]))
    tiers.redraw()  # now, in this thread (the update's own draw may have run already)
    assert tiers.draws >= 1 and picture(tiers).shape[2] in (3, 4)
    ent = EntropyPlot(n_experts=4, min_interval=0)
    ent.update([1.0, 1.5])
    ent.redraw()
    assert ent.draws >= 1 and picture(ent).shape[1] > 0
    perf = PerfBreakdown(min_interval=0)
    perf.redraw()
    assert perf.draws == 0  # nothing to show yet: no picture


class _Counting(FigureView):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.state = self.drawn = -1

    def figure(self):
        from matplotlib.figure import Figure

        self.drawn = self.state
        fig = Figure(figsize=(1, 1))
        fig.text(0.5, 0.5, str(self.state))
        return fig


def test_redraws_are_throttled_and_trailing():
    view = _Counting(min_interval=0.2)
    t0, i = time.monotonic(), 0
    while time.monotonic() - t0 < 1.0:  # a second of updates, as DATA and HITS cause
        view.state = i
        view.request_redraw()
        i += 1
        time.sleep(0.002)
    time.sleep(0.6)
    assert i > 100 and 2 <= view.draws <= 1 + 1.0 / 0.2 + 1  # at most one per interval
    assert view.drawn == i - 1  # the last change was drawn (trailing edge)
    assert picture(view).shape[0] > 0


def test_views_update_from_another_thread(engine):
    """Subscribers run on the client's reader thread; the views accept that."""
    view = TierMap(engine, min_interval=0.05)
    assert view.emap is not None  # the engine's current map at attach
    done = threading.Event()
    engine.subscribe(lambda ev, req: done.set() if req and req.done else None)
    engine.generate("int main(void) {", slot=0, max_tokens=8, timeout=120)
    assert done.wait(10)
    deadline = time.monotonic() + 5
    while view.draws < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert view.draws >= 2
    view.detach()
