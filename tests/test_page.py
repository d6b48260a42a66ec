"""The gateway's page in a real headless browser (system Chromium driven by Playwright): it asks
for the key, then draws every expert of the map in its tier's colour, outlines the routed ones,
and logs no error. Skipped where no Chromium is installed (`make test` installs it as root)."""

from __future__ import annotations

import shutil

import httpx
import pytest
from gateway_util import Gateway

KEY = "sk-page-test"
CELL = 10  # the page's cell size in canvas pixels
HUE = [(158, 158, 158), (30, 136, 229), (251, 140, 0)]  # disk, RAM, device
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH")


def cell_rgb(byte: int) -> tuple[int, int, int]:
    """The colour the page gives an EMAP byte (its `draw`)."""
    tier, heat = min(byte >> 6, 2), byte & 63
    k = 0.35 + 0.65 * min(heat, 24) / 24
    return tuple(round(255 - (255 - v) * k) for v in HUE[tier])


@pytest.fixture(scope="module")
def gateway(checkpoints, tmp_path_factory):
    log = tmp_path_factory.mktemp("page") / "gateway.log"
    gw = Gateway(checkpoints("qwen3_moe"), "--kv-slots", "2", "--ctx", "128", log=log, key=KEY)
    yield gw
    gw.close()


def test_the_expert_map_page(gateway):
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on(
                "console",
                lambda m: (
                    errors.append(m.text) if m.type == "error" and "401" not in m.text else None
                ),
            )
            page.goto(gateway.url + "/")
            page.wait_for_function("document.getElementById('meta').textContent.includes('key')")
            page.fill("#keyval", KEY)
            page.click("#key button")
            body = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
            assert gateway.post("/v1/completions", body).status_code == 200
            state = httpx.get(gateway.url + "/experts", headers=gateway.headers).json()
            page.wait_for_function(
                f"document.getElementById('meta').textContent.includes('update {state['seq']}')"
            )
            pixels = page.evaluate(
                """() => {
                    const c = document.getElementById('map'), x = c.getContext('2d');
                    return {w: c.width, h: c.height,
                            rgba: Array.from(x.getImageData(0, 0, c.width, c.height).data)};
                }"""
            )
        finally:
            browser.close()
    rows, cols = state["rows"], state["cols"]
    assert (pixels["w"], pixels["h"]) == (cols * CELL, rows * CELL)
    data = pixels["rgba"]

    def rgb(x: int, y: int) -> tuple[int, int, int]:
        i = 4 * (y * pixels["w"] + x)
        return tuple(data[i : i + 3])

    for r in range(rows):
        for c in range(cols):
            want = cell_rgb(state["map_grid"][r][c])
            assert rgb(c * CELL + 4, r * CELL + 4) == want, (r, c)  # the cell's inside
            edge = rgb(c * CELL, r * CELL + 4)  # the left edge: the outline when routed
            assert (edge == (229, 57, 53)) == bool(state["hits_grid"][r][c]), (r, c, edge)
    assert errors == []
