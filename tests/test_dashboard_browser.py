"""The live dashboard in a real browser: Debian's chromium, driven by Playwright.

What it is: the built-in tiny Shakespeare model served by the level-6 server (its steps
slowed to STEP_DELAY_S, as a bigger model's would be, so that a frame or two falls inside
each burst), and the page loaded from it, at the server's default pool (10,922 blocks on a
CPU: too many to draw one by one, so the grid draws runs of blocks) and at an 85-block pool
(a square a block): the burst button's eight shared-prefix requests must show in the grid
at a glance (coloured squares, not a sliver), a hover must read a square, a click must zoom
into a run's blocks and Escape or the button come back out, a shared block must carry its
reference count; then the prefix must stay cached; a prompt typed and sent from the page
must stream its answer into the page while the grid shows its blocks; the simulator's page
(`python -m benchmarks.watch --simulate`) must show a simulated A100 serving ShareGPT. No
page may log a console error. While the test looks at a burst the engine is held between
two steps (`Gate`), so that what the page shows cannot change under it: no sleeps, no races.
The screenshots it takes are the ones in docs/dashboard.md:

    LADDER_SCREENSHOTS=docs/img python -m pytest tests/test_dashboard_browser.py    # refresh them

(without that variable they go to the test's temporary folder).

What it is not: a test of how the page looks (a person looks at the screenshots), or one that
downloads a browser: `.ci/run` installs Debian's chromium; without /usr/bin/chromium (or the
playwright package) this file is skipped, saying why.
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest
from test_dashboard import watch

from level6_serving import dashboard

pytestmark = pytest.mark.level6

CHROMIUM = "/usr/bin/chromium"
# The flags this machine's closed network needs: no background requests, no first-run work.
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
        "--disable-background-networking", "--disable-component-update"]  # fmt: skip
STEP_DELAY_S = 0.03  # added to each engine step: a burst lasts seconds, not a fraction of one
playwright = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
if not Path(CHROMIUM).exists():
    pytest.skip(f"no {CHROMIUM}: .ci/run installs Debian's chromium package", allow_module_level=True)


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    where = os.environ.get("LADDER_SCREENSHOTS")
    return Path(where) if where else tmp_path_factory.mktemp("screenshots")


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


class Page:
    """A page that records every console error and uncaught exception."""

    def __init__(self, browser, url: str, live: bool = True):
        self.errors: list[str] = []
        self.page = browser.new_page(viewport={"width": 1280, "height": 1080})  # a default pool's page, all of it
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.goto(url + "/dashboard")
        if live:
            self.page.wait_for_selector("#status.live", timeout=30_000)

    def pool(self) -> dict:
        """The grid's data-* attributes (dashboard.js, drawPool): numbers as numbers, the view's name as text."""
        return self.page.eval_on_selector("#pool", "c => Object.fromEntries(Object.entries(c.dataset).map(([k, v]) => "
                                                   "[k, isNaN(Number(v)) ? v : Number(v)]))")  # fmt: skip

    def wait_pool(self, condition: str, timeout: float = 60_000) -> dict:
        self.page.wait_for_function(f"(d => {condition})(document.getElementById('pool').dataset)", timeout=timeout)
        return self.pool()

    def screenshot(self, path: Path) -> None:
        self.page.evaluate("window.scrollTo(0, 0)")  # a click lower down (the burst button) scrolled the page
        self.page.screenshot(path=str(path))

    def burst(self) -> dict:
        """Press the burst button; return the grid once its requests share blocks, a frame after the first
        that shows it (by then all eight have joined: they are sent together once the first has a token)."""
        self.page.click("#burst")
        seen = self.wait_pool("Number(d.shared) > 0 && Number(d.used) > 0")  # the seven found the first one's blocks
        return self.wait_pool(f"Number(d.shared) > 0 && Number(d.seq) > {seen['seq']}")

    def close(self) -> list[str]:
        self.page.close()  # before the server goes: a stream cut under the page is logged as an error
        return self.errors


class Gate:
    """Wrapped around an engine's step: slows each step by STEP_DELAY_S and, while closed, holds the
    engine between two steps, so that its state, and the page's last frame, stand still."""

    def __init__(self, engine):
        self.opened, self.waiting, self.step = threading.Event(), threading.Event(), engine.step
        self.feed = next(o for o in engine.observers if isinstance(o, dashboard.DashboardFeed))
        self.opened.set()
        engine.step = self

    def __call__(self):
        if not self.opened.is_set():
            self.waiting.set()  # the step before has ended: nothing moves until open()
            self.opened.wait()
            self.waiting.clear()
        time.sleep(STEP_DELAY_S)
        return self.step()

    def close(self, page: Page) -> dict:
        """Hold the engine (it is busy: a burst runs), then wait for the page to draw the last frame it made."""
        self.opened.clear()
        assert self.waiting.wait(30), "the engine made no step"
        return page.wait_pool(f"Number(d.seq) >= {self.feed.latest['seq']}")  # frames made from now on: the same

    def open(self) -> None:
        self.opened.set()


@pytest.fixture(scope="module")
def model():
    from ladder.models import default_model

    return default_model()


def served_with(model, engine_args: dict):
    from level6_helpers import serve

    with serve(model, engine_args) as s:
        s.gate = Gate(s.engine.engine)
        try:
            yield s
        finally:
            s.gate.open()


@pytest.fixture(scope="module")
def served(model):
    """`python -m level6_serving --max-model-len 256 --kv-cache-memory 8MiB`: 85 blocks, a square each."""
    yield from served_with(model, dict(max_model_len=256, kv_cache_memory=8 << 20, seed=0))


@pytest.fixture(scope="module")
def served_default(model):
    """`python -m level6_serving`: the default pool (1 GiB of KV on a CPU: 10,922 blocks of 16 tokens)."""
    yield from served_with(model, dict(seed=0))


def coloured_pixels(page) -> int:
    """How many of the pool's pixels show something: neither the free grey nor the empty canvas."""
    return page.eval_on_selector("#pool", """c => {
        const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
        let n = 0;
        for (let i = 0; i < d.length; i += 4) {
            if (d[i + 3] && !(d[i] === 230 && d[i + 1] === 230 && d[i + 2] === 230)) n++;  // #e6e6e6: free
        }
        return n;
    }""")  # fmt: skip


def square(pool: dict, i: int) -> dict:
    """The middle of square i of the drawing, in the canvas's own pixels (CSS px)."""
    return {"x": (i % pool["cols"] + 0.5) * pool["cell"], "y": (i // pool["cols"] + 0.5) * pool["cell"]}


def shared_block(engine) -> int:
    """A block the held engine's requests share (the burst's prefix)."""
    refs: dict[int, int] = {}
    for r in engine.scheduler.running:
        for b in engine.kv.block_table(r):
            refs[b] = refs.get(b, 0) + 1
    return min(b for b, n in refs.items() if n > 1)


def test_the_default_pool_is_drawn_in_runs_a_burst_shows_and_a_click_zooms_in(browser, served_default, shots):
    """10,922 blocks: too many to draw one by one (4-pixel squares, a burst a sliver of the first row),
    so a square is a run of cell_size blocks, filled by their shares; a click shows one run's blocks."""
    s, engine = served_default, served_default.engine.engine
    page = Page(browser, s.url)
    p = page.page
    first = page.wait_pool("d.view")  # the first frame is drawn
    per = dashboard.cell_size(engine.num_blocks)
    assert engine.num_blocks > 512 and per > 1
    assert first["view"] == "cells" and first["per"] == per and first["occupied"] == 0 and coloured_pixels(p) == 0
    assert p.is_visible("#cells-legend") and p.is_hidden("#blocks-legend")
    page.burst()
    try:
        busy = s.gate.close(page)
        # at a glance: the burst's blocks fill squares by their share (the old grid drew each as a 2-pixel dot)
        assert busy["occupied"] >= busy["used"] / per
        assert coloured_pixels(p) >= (busy["cell"] - 2) ** 2 * busy["used"] / per
        page.screenshot(shots / "dashboard_burst.png")

        b = shared_block(engine)
        i, lo, hi = b // per, b // per * per, b // per * per + per - 1
        p.hover("#pool", position=square(busy, i))
        tip = p.text_content("#tip")
        m = re.fullmatch(rf"blocks {lo}–{hi}: (\d+) held by one request, (\d+) shared \(by up to (\d+)\), "
                         r"(\d+) cached, (\d+) free · click to see them", tip)  # fmt: skip
        assert m, tip
        held, shared, most, cached, free = map(int, m.groups())
        assert held + shared + cached + free == per and shared >= 1 and most >= 2

        p.click("#pool", position=square(busy, i))  # one square per block, numbers on the shared ones
        zoomed = page.wait_pool("d.view === 'zoom' && Number(d.refs) > 0")
        assert zoomed["refs"] == shared and zoomed["occupied"] == held + shared
        assert p.is_visible("#zoombar")
        assert f"blocks {lo}–{hi} of {engine.num_blocks}" in p.text_content("#zoom-range")
        p.hover("#pool", position=square(zoomed, b - lo))
        assert re.fullmatch(rf"block {b}: shared by \d+ requests \(first: request \S+\)", p.text_content("#tip"))
        page.screenshot(shots / "dashboard_zoom.png")
        p.keyboard.press("Escape")
        page.wait_pool("d.view === 'cells'")
        p.click("#pool", position=square(busy, i))
        page.wait_pool("d.view === 'zoom'")
        p.click("#zoomout")
        page.wait_pool("d.view === 'cells'")
    finally:
        s.gate.open()
    p.wait_for_function("document.getElementById('burst-status').textContent.startsWith('8 of 8 done')",
                        timeout=60_000)  # fmt: skip
    assert "failed" not in p.text_content("#burst-status")
    page.wait_pool("Number(d.used) === 0 && Number(d.cached) > 0 && Number(d.occupied) === 0")  # the prefix: cached

    p.fill("#prompt", "ROMEO:\n")
    p.fill("#max-tokens", "200")
    p.click("#send")
    p.wait_for_function("document.getElementById('answer').textContent.length > 20", timeout=60_000)
    page.wait_pool("Number(d.used) > 0 && Number(d.occupied) > 0")  # the prompt's blocks, while it streams
    streaming = p.text_content("#answer")
    page.screenshot(shots / "dashboard_prompt.png")
    p.wait_for_function("!document.getElementById('send').disabled", timeout=60_000)  # the stream ended
    answer = p.text_content("#answer")
    assert answer.startswith(streaming) and len(answer) > len(streaming) and "[error" not in answer
    page.wait_pool("Number(d.used) === 0")  # and gives them back when it ends
    assert page.close() == []  # no console error


def test_a_small_pool_draws_a_block_a_square_with_its_reference_counts(browser, served, shots):
    """85 blocks: a square each, in its request's colour; a shared block carries how many hold it."""
    s, engine = served, served.engine.engine
    page = Page(browser, s.url)
    p = page.page
    assert p.text_content("#model") == "tiny"
    first = page.wait_pool("d.view")  # the first frame is drawn
    assert first["used"] == 0 and first["per"] == 1  # nothing runs yet; no runs of blocks
    assert first["view"] == "blocks" and p.is_hidden("#cells-legend")
    busy = page.burst()
    assert busy["seq"] > first["seq"] and busy["refs"] == busy["shared"]  # a number on every shared block
    try:
        held = s.gate.close(page)
        b = shared_block(engine)
        p.hover("#pool", position=square(held, b))
        assert re.fullmatch(rf"block {b}: shared by \d+ requests \(first: request \S+\)", p.text_content("#tip"))
        p.click("#pool", position=square(held, b))  # a block is not a run: nothing to zoom into
        assert page.pool()["view"] == "blocks" and p.is_hidden("#zoombar")
        page.screenshot(shots / "dashboard_small_pool.png")
    finally:
        s.gate.open()
    p.wait_for_function("document.getElementById('burst-status').textContent.startsWith('8 of 8 done')",
                        timeout=60_000)  # fmt: skip
    assert "failed" not in p.text_content("#burst-status")
    after = page.wait_pool("Number(d.used) === 0 && Number(d.cached) > 0")  # done: the prefix stays cached
    assert after["cached"] >= busy["shared"]
    assert page.close() == []  # no console error


def test_the_header_says_an_8_bit_cache_and_the_blocks_it_buys(browser, model):
    """`--kv-cache-dtype int8`, the same 8 MiB: the header names the format beside the blocks and says how many
    the memory would hold in the model's dtype (the server's /dashboard/info)."""
    import httpx

    server = served_with(model, dict(max_model_len=256, kv_cache_memory=8 << 20, kv_cache_dtype="int8", seed=0))
    s = next(server)
    try:
        info = httpx.get(s.url + "/dashboard/info").json()
        page = Page(browser, s.url)
        text = page.page.text_content("#engine")
        want = (f"{info['num_blocks']} blocks of 16 tokens · KV in int8 ({info['blocks_in_model_dtype']} blocks in "
                f"{info['model_dtype']})")  # fmt: skip
        assert want in text and info["num_blocks"] > info["blocks_in_model_dtype"] > 0, text
        assert page.close() == []
    finally:
        server.close()  # the server stops


def test_the_page_watches_the_simulator(browser, shots):
    proc, url = watch(["--simulate", "--workload", "sharegpt", "--requests", "400", "--rate", "3", "--speed", "10",
                       "--wait", "60"])  # fmt: skip
    try:
        page = Page(browser, url)
        assert "simulator" in page.page.text_content("#engine")
        page.wait_pool("Number(d.used) > 400")  # a few dozen ShareGPT requests fill an A100's pool
        page.page.wait_for_timeout(1500)  # a few frames of timeline
        page.screenshot(shots / "dashboard_simulator.png")
        assert int(page.page.text_content("#nrunning")) > 10
        assert page.close() == []
    finally:
        proc.kill()
        proc.wait()


def test_behind_a_key_the_page_asks_for_it_then_streams(browser, ckpt):
    from level6_helpers import ENGINE, serve

    with serve(ckpt, ENGINE, api_key="sk-page") as s:
        page = Page(browser, s.url, live=False)
        p = page.page
        p.wait_for_selector("#keybox:not([hidden])", timeout=30_000)  # asked before any request is refused
        p.fill("#key", "sk-page")
        p.click("#keygo")
        p.wait_for_selector("#status.live", timeout=30_000)
        assert p.is_hidden("#keybox") and p.text_content("#model") == "tiny"
        assert page.close() == []  # no 401 logged on the way


def test_the_screenshots_in_the_docs_are_the_tests():
    """The images docs/dashboard.md shows are the ones this file writes, and they are committed."""
    docs = Path(__file__).resolve().parent.parent / "docs"
    text = (docs / "dashboard.md").read_text()
    for name in ("dashboard_burst.png", "dashboard_zoom.png", "dashboard_prompt.png", "dashboard_small_pool.png",
                 "dashboard_simulator.png"):
        assert f"img/{name}" in text and (docs / "img" / name).stat().st_size > 10_000
