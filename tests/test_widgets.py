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
from colibri.client import Engine, Request, Session
from colibri.protocol.codec import (
    Accept,
    Data,
    Done,
    Emap,
    Entropy,
    Hits,
    HwInfo,
    Perf,
    Ready,
    Stat,
    Tiers,
)
from colibri.widgets import plots
from colibri.widgets.views import (
    Dashboard,
    EntropyPlot,
    FigureView,
    PerfBreakdown,
    TierMap,
    prompt_label,
)

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

    assert turn.ok and turn.slot == 1 and turn.tag == "The quick brown fox"  # its prompt
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
    assert dash.perf.turns.id.iloc[-1] == turn.id and dash.perf.turns.tag.iloc[-1] == turn.tag
    assert (dash.tiers.routed == turn.routed()).all()  # every window of the turn, not the last
    assert dash.perf.running == [] and dash.entropy.live is None
    assert turn.tag in dash.status.value and "prefill" in dash.status.value
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


def test_dashboard_labels_and_bounded_output(engine):
    dash = Dashboard(engine, min_interval=0.05, output_height="10em")
    dash.prompt.value = "int main(void) {\n    return 0;\n}  /* a prompt longer than a label */"
    assert dash.turn_label() == prompt_label(dash.prompt.value) == "int main(void) { return…"
    dash.label.value = "  my tag "
    dash.max_tokens.value = 8
    dash.run()
    turn = dash.wait(120)
    assert turn.tag == "my tag" and engine.turns_df().tag.iloc[-1] == "my tag"
    box = dash.output.value  # a box of bounded height that scrolls, anchored at its end
    assert "max-height: 10em" in box and "overflow-y: auto" in box
    assert "column-reverse" in box and dash.output.layout.max_height == "10em"
    dash.close()


# ---------------------------------------------------------------------------- live, offline

HW = HwInfo(2, 16.0, 8.0, 0, 0.0, "cpu", "")
EMAP = Emap(2, 4, bytes([0x80, 0x41, 0x03, 0x8F, 0x80, 0x80, 0x40, 0x00]))


class _Stub:
    """What the views use of an Engine, over a client Session fed by hand."""

    def __init__(self) -> None:
        self.session = Session()
        for ev in (Ready(), Stat(0, 0.0, 0.0, 0.1), HW, Tiers(6, 1, 1, 0.0, 0.0), EMAP):
            self.session.dispatch(ev)

    def subscribe(self, fn):
        return self.session.subscribe(fn)

    @property
    def turns(self):
        return self.session.turns

    def turns_df(self):
        return self.session.turns_df()

    def entropy_df(self):
        return self.session.entropy_df()

    def open(self, rid: int, prompt: str, tag: str | None = None) -> Request:
        req = Request(None, rid, 0, prompt, tag)
        self.session.register(req)
        self.session.dispatch(Accept(rid, 4, 0))
        return req

    def finish(self, rid: int, hits: Hits, entropy=(1.0, 1.5)) -> None:
        block = [
            HW,
            Perf(rid, 0.5, 0.0, 0.1, 0.1, 0.1, 0.0, 0.05),
            Entropy(entropy),
            Tiers(6, 1, 1, 0.0, 0.0),
            EMAP,
            hits,
            Done(rid, 3, 10.0, 80.0, 0.1, 4, False),
        ]
        for ev in block:
            self.session.dispatch(ev)


def test_views_follow_a_turn_from_its_hits():
    """Routed marks accumulate over the turn's HITS windows (and restart with the next turn),
    the entropy view shows an estimate from them while the turn runs, the PERF view a growing
    bar labelled by the prompt; at DONE, the turn's own ENTROPY and PERF."""
    eng = _Stub()
    tiers = TierMap(eng, min_interval=60)  # no timed draws: the test draws by hand
    ent = EntropyPlot(eng, min_interval=60)
    perf = PerfBreakdown(eng, min_interval=60)
    req = eng.open(1, "The history of the city of Lyon")
    assert perf.running[0][0] == "The history of the city…"
    windows = [[(0, 1)], [(0, 1), (1, 2)], [(1, 3)]]
    for i, cells in enumerate(windows):
        eng.session.dispatch(Data(1, b"x"))
        eng.session.dispatch(Hits.from_set(2, 4, cells))
        want = {c for w in windows[: i + 1] for c in w}
        assert {tuple(c) for c in np.argwhere(tiers.routed)} == want
        assert ent.live_windows == i + 1
    counts = np.array([[0, 2, 0, 0], [0, 0, 1, 1]])  # windows that routed each expert
    assert (ent.live == counts).all()
    assert ent.live_values() == pytest.approx([0.0, 1.0])  # bits of those counts per layer
    ent.redraw()
    assert "estimate, 3 HITS windows" in ent.figure().axes[0].get_title()
    time.sleep(0.02)
    ((label, secs),) = perf.running
    assert secs >= 0.02 and secs == pytest.approx(req.running_s(), abs=0.05)
    perf.redraw()
    assert perf.draws >= 1 and picture(perf).shape[0] > 0  # the running bar alone

    eng.finish(1, Hits.from_set(2, 4, [(0, 0)]))
    assert {tuple(c) for c in np.argwhere(tiers.routed)} == {(0, 0), (0, 1), (1, 2), (1, 3)}
    assert (tiers.routed == req.wait(0).routed()).all()
    assert ent.live is None and ent.values == (1.0, 1.5)
    assert "Last turn" in ent.figure().axes[0].get_title()
    assert perf.running == [] and list(perf.turns.id) == [1]

    eng.open(2, "next")  # a new turn: the marks start afresh
    assert tiers.routed is None
    eng.session.dispatch(Hits.from_set(2, 4, [(1, 0)]))
    assert {tuple(c) for c in np.argwhere(tiers.routed)} == {(1, 0)}
    assert tiers.hits_updates == 5 and tiers.hits == Hits.from_set(2, 4, [(1, 0)])


def test_views_show_images_at_their_pixel_size():
    """The PNG holds SCALE x the figure's pixels; the image is shown at the figure's pixel
    width with no CSS width, so nothing stretches it."""
    tiers = TierMap(min_interval=60)
    tiers.update(EMAP, Hits.from_set(2, 4, [(0, 1)]))
    ent = EntropyPlot(n_experts=4, min_interval=60)
    ent.update([1.0, 1.5])
    for view in (tiers, ent):
        view.redraw()
        fig = view.figure()
        w, h = plots.pixel_size(fig)
        assert view.pixels == (w, h) and view.image.width == str(w)
        pw, ph = plots.png_size(bytes(view.image.value))
        assert abs(pw - plots.SCALE * w) <= 1 and abs(ph - plots.SCALE * h) <= 1
        assert view.image.layout.width is None and view.image.height == ""
        assert view.image.layout.align_self == "flex-start"  # not stretched by its box
