"""The live dashboard in a real browser: Debian's chromium, driven by Playwright.

What it is: the built-in tiny Shakespeare model served by the level-6 server (its steps
slowed to STEP_DELAY_S, as a bigger model's would be, so that a frame or two falls inside
each burst), and the page loaded from it: the burst button's eight shared-prefix requests
must show shared blocks in the grid, then cached ones; a prompt typed and sent from the page
must stream its answer into the page while the grid shows its blocks; the simulator's page
(`python -m benchmarks.watch --simulate`) must show a simulated A100 serving ShareGPT. No
page may log a console error. The screenshots it takes are the ones in docs/dashboard.md:

    LADDER_SCREENSHOTS=docs/img python -m pytest tests/test_dashboard_browser.py    # refresh them

(without that variable they go to the test's temporary folder).

What it is not: a test of how the page looks (a person looks at the screenshots), or one that
downloads a browser: `.ci/run` installs Debian's chromium; without /usr/bin/chromium (or the
playwright package) this file is skipped, saying why.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from test_dashboard import watch

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
        self.page = browser.new_page(viewport={"width": 1280, "height": 1020})
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.goto(url + "/dashboard")
        if live:
            self.page.wait_for_selector("#status.live", timeout=30_000)

    def pool(self) -> dict:
        return self.page.eval_on_selector("#pool", "c => Object.fromEntries(Object.entries(c.dataset).map(([k, v]) => [k, Number(v)]))")

    def wait_pool(self, condition: str, timeout: float = 60_000) -> dict:
        self.page.wait_for_function(f"(d => {condition})(document.getElementById('pool').dataset)", timeout=timeout)
        return self.pool()

    def close(self) -> list[str]:
        self.page.close()  # before the server goes: a stream cut under the page is logged as an error
        return self.errors


@pytest.fixture(scope="module")
def served():
    from level6_helpers import serve

    from ladder.models import default_model

    model = default_model()
    with serve(model, dict(max_model_len=256, kv_cache_memory=8 << 20, seed=0)) as s:
        engine = s.engine.engine  # a slower step, as a bigger model's: the page sees every stage of a burst
        step = engine.step
        engine.step = lambda: (time.sleep(STEP_DELAY_S), step())[1]
        yield s


def test_the_page_draws_a_shared_prefix_burst_and_streams_a_prompt(browser, served, shots):
    page = Page(browser, served.url)
    p = page.page
    assert p.text_content("#model") == "tiny"
    first = page.pool()
    assert first["used"] == 0  # nothing runs yet
    p.click("#burst")
    busy = page.wait_pool("Number(d.shared) > 0 && Number(d.used) > 0")  # the seven found the first one's blocks
    p.screenshot(path=str(shots / "dashboard_burst.png"))
    assert busy["seq"] > first["seq"]
    p.wait_for_function("document.getElementById('burst-status').textContent.startsWith('8 of 8 done')",
                        timeout=60_000)  # fmt: skip
    assert "failed" not in p.text_content("#burst-status")
    after = page.wait_pool("Number(d.used) === 0 && Number(d.cached) > 0")  # done: the prefix stays cached
    assert after["cached"] >= busy["shared"]

    p.fill("#prompt", "ROMEO:\n")
    p.fill("#max-tokens", "200")
    p.click("#send")
    p.wait_for_function("document.getElementById('answer').textContent.length > 20", timeout=60_000)
    page.wait_pool("Number(d.used) > 0")  # the grid shows the prompt's blocks while its answer streams
    streaming = p.text_content("#answer")
    p.screenshot(path=str(shots / "dashboard_prompt.png"))
    p.wait_for_function("!document.getElementById('send').disabled", timeout=60_000)  # the stream ended
    answer = p.text_content("#answer")
    assert answer.startswith(streaming) and len(answer) > len(streaming) and "[error" not in answer
    page.wait_pool("Number(d.used) === 0")  # and gives them back when it ends
    assert page.close() == []  # no console error


def test_the_page_watches_the_simulator(browser, shots):
    proc, url = watch(["--simulate", "--workload", "sharegpt", "--requests", "400", "--rate", "3", "--speed", "10",
                       "--wait", "60"])  # fmt: skip
    try:
        page = Page(browser, url)
        assert "simulator" in page.page.text_content("#engine")
        page.wait_pool("Number(d.used) > 400")  # a few dozen ShareGPT requests fill an A100's pool
        page.page.wait_for_timeout(1500)  # a few frames of timeline
        page.page.screenshot(path=str(shots / "dashboard_simulator.png"))
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
    for name in ("dashboard_burst.png", "dashboard_prompt.png", "dashboard_simulator.png"):
        assert f"img/{name}" in text and (docs / "img" / name).stat().st_size > 10_000
