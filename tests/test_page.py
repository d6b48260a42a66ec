"""The gateway's page (web/dist) in a real headless browser: the system Chromium driven by
Playwright, over a real gateway and engine on the tiny qwen3_moe checkpoint (2 MoE layers of 8
experts, held on the device, in RAM and on disk) with an API key and a matching atlas.

It asks for the key (without a 401 logged), refuses a wrong one, then draws one heat map per MoE
layer with labelled axes, each cell in the colour the notebooks give it (`plots.cell_rgb`, the
same palette), routed experts dotted, tier counts equal to those of `/experts`; it updates after
a chat request (its own chat box, and one sent by another client), shows the request's
`colibri` frame and the profiled turns, draws the atlas, keeps the key across a reload, and
logs no console error. A screenshot lands in $COLIBRI_ARTIFACTS, else
<pytest basetemp>/artifacts/page.png. Skipped where no Chromium is installed (`make test`
installs it as root)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
from gateway_util import Gateway

KEY = "sk-page-test"
WEB = Path(__file__).resolve().parent.parent / "web" / "dist"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
TIMEOUT_MS = 180_000  # an engine's first turn compiles: slow on a busy 2-core box
TIER_NAMES = {2: "device", 1: "RAM", 0: "disk"}
browser_only = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH")


def atlas_for(layers: int, experts: int) -> dict:
    """A colibri atlas (data/experts.json's schema, the fields the gateway keys) of this shape."""
    cats = ["python", "german", "french"]
    rows = []
    for layer in range(layers):
        for e in range(experts):
            p = np.full(len(cats), 0.1)
            p[(layer + e) % len(cats)] += 0.3 + 0.05 * e
            p /= p.sum()
            spec = round(float(p.max() - 1 / len(cats)) * 1.5, 3)
            top = cats[int(p.argmax())]
            rows.append(
                dict(layer=layer, expert=e, affinity=[round(float(v), 6) for v in p], spec=spec)
                | dict(top=top, total=100 + e, lift=1.5)
            )
    return {"categories": cats, "experts": rows, "layers": layers, "experts_per_layer": experts}


def decode(state: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """tier, heat, hit [rows, cols] from /experts's hex strings (EMAP byte: tier << 6 | heat)."""
    rows, cols = state["rows"], state["cols"]
    emap = np.frombuffer(bytes.fromhex(state["map"]), np.uint8).reshape(rows, cols)
    bits = np.unpackbits(np.frombuffer(bytes.fromhex(state["hits"]), np.uint8), bitorder="little")
    return emap >> 6, emap & 63, bits[: rows * cols].astype(bool).reshape(rows, cols)


# ---------------------------------------------------------------------------- one palette


def js_object(source: str, name: str) -> dict:
    """`export const NAME = { ... };` of a page module as a dict (string or number keys)."""
    body = re.search(rf"export const {name} = \{{(.*?)\}};", source, re.S)
    assert body, name
    pairs = re.findall(r'"?([\w ]+)"?\s*:\s*"(#[0-9A-Fa-f]{6})"', body.group(1))
    return {(int(k) if k.strip().isdigit() else k.strip()): v.lower() for k, v in pairs}


def test_the_page_and_the_notebooks_share_one_palette():
    from colibri.client import PERF_PARTS
    from colibri.widgets import plots

    source = (WEB / "palette.js").read_text()
    tiers = js_object(source, "TIER_COLORS")
    assert tiers == {t: c.lower() for t, c in plots.TIER_COLORS.items()}
    perf = js_object(source, "PERF_COLORS")
    assert perf == {p: c.lower() for p, c in plots.PERF_COLORS.items()}
    assert set(perf) == set(PERF_PARTS)
    depth = re.search(r"export const MIN_DEPTH = ([0-9.]+);", source)
    assert depth and float(depth.group(1)) == plots.MIN_DEPTH
    assert f'HIT_COLOR = "{plots.HIT_COLOR}"' in source


# ---------------------------------------------------------------------------- the page


@pytest.fixture(scope="module")
def gateway(checkpoints, tmp_path_factory):
    base = tmp_path_factory.mktemp("page")
    (base / "experts.json").write_text(json.dumps(atlas_for(2, 8)))
    args = ["--kv-slots", "2", "--ctx", "128", "--experts-json", str(base / "experts.json")]
    tiers = dict(DEVICE_GB="0.0001", RAM_GB="0.0002", UNIFIED="0")  # 4 device, 4 RAM, 8 disk
    gw = Gateway(checkpoints("qwen3_moe"), *args, log=base / "gateway.log", key=KEY, **tiers)
    yield gw
    gw.close()


@pytest.fixture
def screenshot(tmp_path_factory) -> Path:
    folder = os.environ.get("COLIBRI_ARTIFACTS")
    out = Path(folder) if folder else tmp_path_factory.getbasetemp() / "artifacts"
    out.mkdir(parents=True, exist_ok=True)
    return out / "page.png"


READ_MAPS = """() => [...document.querySelectorAll('svg.layer-map')].map(svg => ({
    layer: +svg.dataset.layer,
    texts: [...svg.querySelectorAll('text')].map(t => t.textContent),
    fills: [...svg.querySelectorAll('rect.cell')].map(r => r.getAttribute('fill')),
    dots: [...svg.querySelectorAll('circle.hit')].map(c => c.style.display !== 'none'),
}))"""


def experts(gw: Gateway) -> dict:
    r = httpx.get(gw.url + "/experts", headers=gw.headers, timeout=30)
    assert r.status_code == 200
    return r.json()


def wait_seq(page, seq: int) -> None:
    """Until the page has drawn the map of update `seq`."""
    page.wait_for_function(
        "s => document.getElementById('status').dataset.seq === String(s)", arg=seq
    )


def check_maps(page, state: dict) -> None:
    """One heat map per MoE layer with labelled axes, every cell in the notebooks' colour for
    its tier and heat (scale fitted to the hottest), routed ones dotted; tier counts as /experts."""
    from colibri.widgets import plots

    tier, heat, hit = decode(state)
    rows, cols = tier.shape
    assert set(np.unique(tier)) == {0, 1, 2}, tier  # every tier's colour is checked
    want = np.rint(plots.cell_rgb(tier, heat) * 255).astype(int)
    drawn = page.evaluate(READ_MAPS)
    assert [m["layer"] for m in drawn] == list(range(rows))
    for m in drawn:
        r = m["layer"]
        assert f"MoE layer {r}" in m["texts"] and "expert" in m["texts"]
        assert {str(c) for c in range(cols)} <= set(m["texts"])  # an expert number per column
        got = np.array([[int(v) for v in re.findall(r"\d+", f)] for f in m["fills"]])
        assert got.shape == (cols, 3)
        assert np.abs(got - want[r]).max() <= 1, (r, got, want[r])
        assert m["dots"] == hit[r].tolist(), r
    assert page.get_attribute("#heat-legend", "data-top") == str(max(int(heat.max()), 1))
    for t, name in TIER_NAMES.items():
        assert page.get_attribute(f"#tier-{name}", "data-count") == str(int((tier == t).sum()))
    assert page.get_attribute("#routed", "data-count") == str(int(hit.sum()))


@browser_only
def test_the_page(gateway, screenshot, record_property):
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.set_default_timeout(TIMEOUT_MS)
            page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)

            # The key: asked for, a wrong one refused, the right one let in.
            page.goto(gateway.url + "/")
            page.wait_for_selector("#key:not([hidden])")
            page.fill("#keyval", "sk-wrong")
            page.click("#key button")
            page.wait_for_function(
                "document.getElementById('key-msg').textContent.includes('refused')"
            )
            assert page.is_hidden("#app")
            page.fill("#keyval", KEY)
            page.click("#key button")
            page.wait_for_selector("#app:not([hidden])")
            page.wait_for_function("document.getElementById('status').dataset.seq !== undefined")

            # A chat request from the page's own box: the frame shows, the maps update.
            before = experts(gateway)["seq"]
            page.fill("#prompt", "The quick brown fox")
            page.fill("#max-tokens", "8")
            page.click("#send")
            page.wait_for_function("document.getElementById('reply').dataset.state === 'done'")
            page.wait_for_selector("#request[data-requests='1']")
            assert re.fullmatch(r"[\d.]+%", page.inner_text("#request [data-field=hit_pct]"))
            assert int(page.inner_text("#request [data-field=emitted]")) > 0
            assert re.fullmatch(r"[\d.]+%", page.inner_text("#hit-pct"))
            state = experts(gateway)
            assert state["seq"] != before and state["rows"] == 2 and state["cols"] == 8
            wait_seq(page, state["seq"])
            check_maps(page, state)

            # Another client's chat request: the page follows it (maps, counts, turns).
            body = {"messages": [{"role": "user", "content": "Der schnelle braune Fuchs"}]}
            reply = gateway.post("/v1/chat/completions", {**body, "max_tokens": 6})
            assert reply.status_code == 200
            state = experts(gateway)
            wait_seq(page, state["seq"])
            check_maps(page, state)
            turns = httpx.get(gateway.url + "/profile", headers=gateway.headers).json()["turns"]
            page.wait_for_function(
                "n => document.querySelectorAll('#perf .perf-bar').length === n",
                arg=min(len(turns), 40),
            )
            assert {"tok/s", "seconds"} <= set(
                page.locator("#rate text, #perf text").all_text_contents()
            )

            # Tooltips name layer, expert, tier and heat.
            tier, heat, _ = decode(state)
            page.hover("svg.layer-map[data-layer='1'] rect.cell[data-e='3']")
            tip = page.inner_text("#tooltip")
            assert "MoE layer 1 · expert 3" in tip and f"tier: {TIER_NAMES[int(tier[1, 3])]}" in tip
            assert f"heat {int(heat[1, 3])} of" in tip and "atlas: top" in tip

            # The atlas: 2 MoE layers x 8 experts, axes labelled.
            assert page.get_attribute("#atlas-map", "data-layers") == "2"
            assert page.locator("#atlas-map rect.atlas-cell").count() == 16
            atlas_text = page.locator("#atlas-map text").all_text_contents()
            assert "MoE layer" in atlas_text and "expert" in atlas_text

            page.screenshot(path=str(screenshot), full_page=True)

            # The key lasts the tab: a reload draws the maps without asking.
            page.reload()
            page.wait_for_selector("svg.layer-map")
            wait_seq(page, state["seq"])
            assert page.is_hidden("#key")
        finally:
            browser.close()
    record_property("screenshot", str(screenshot))
    print(f"page screenshot: {screenshot}")
    assert screenshot.stat().st_size > 10_000
    assert errors == []
