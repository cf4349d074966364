"""The live dashboard (level6_serving/dashboard.py): its frames, its stream, its page.

What it is:
  - a property test: under random workloads (shared prefixes, a tight pool so preemption,
    aborts between steps), every frame the feed makes equals the engine's state at that
    moment, computed here from the engine itself: each request's status, progress and
    block count, each block's state, owner and reference count, the cached-free blocks in
    eviction order, the queue lengths; and the frames' step rows account for every step
    once (level 4's for every draft token and every accepted one);
  - a big pool's cells (`pool_cells`): each counts its run of blocks by state, and together they
    count the pool; the server's default pool (10,922 blocks) is sent in cells, 85 blocks are not;
  - the bounds: at most `hz` frames a second, nothing built while nobody watches, the
    last step of a burst always drawn, a frame's lists capped, a slow reader skips frames;
  - the server: the page, `/dashboard/info` and an event stream whose frames are the feed's
    own (JSON, one per event); `--no-dashboard` serves none of it; with an API key the page
    loads and asks for the key, and the data routes answer 401 without it;
  - `python -m benchmarks.watch` over an offline run and over the simulator;
  - the Grafana dashboard in examples/grafana: valid JSON, and every metric it names is one
    the server serves.
The browser test is in test_dashboard_browser.py.

What it is not: a speed test (`python -m benchmarks.dashboard_cost` measures what the feed costs).
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from level6_helpers import ENGINE, NAME, metrics, serve
from test_equivalence import kv_bytes

import level3_prefix
import level4_speculative
from level0_naive import SamplingParams
from level2_continuous.observers import KVSnapshot, RequestBlocks
from level6_serving import dashboard
from level6_serving.dashboard import (
    CACHED,
    FREE,
    SHARED,
    USED,
    DashboardFeed,
    DashboardHub,
    block_states,
    build_frame,
    engine_info,
)
from level6_serving.metrics import aborted

pytestmark = pytest.mark.level6
REPO = Path(__file__).resolve().parent.parent
BLOCK = 4


# --- the frames equal the engine's state -------------------------------------------------------------
def expected_blocks(engine) -> tuple[list[int], list[int], list[int], list[int]]:
    """From the engine itself, not from a snapshot: state, owner and refs per block, and the evictable blocks."""
    running = list(engine.scheduler.running)
    refs, owner = [0] * engine.num_blocks, [-1] * engine.num_blocks
    for i, r in enumerate(running):  # the running come first in a frame's list, so their indices are these
        for b in engine.kv.block_table(r):
            refs[b] += 1
            owner[b] = i if owner[b] < 0 else owner[b]
    evictable = [b.block_id for b in engine.kv.pool.free_queue if b.block_hash is not None]
    state = [SHARED if n > 1 else USED if n == 1 else CACHED if b in evictable else FREE for b, n in enumerate(refs)]
    return state, owner, refs, evictable


class Checker:
    """A subscriber that compares each frame, as it is made (between two steps), with the engine."""

    def __init__(self, engine):
        self.engine, self.frames = engine, []

    def __call__(self, frame: dict) -> None:
        e = self.engine
        running, waiting = list(e.scheduler.running), list(e.scheduler.waiting)
        assert (frame["running"], frame["waiting"]) == (len(running), len(waiting))
        want = [[r.request_id, r.index, "running", len(r.prompt_token_ids), len(r.output_token_ids),
                 r.num_computed_tokens, r.num_preemptions, len(e.kv.block_table(r)), r.params.max_tokens] for r in running]
        want += [[r.request_id, r.index, r.status.value, len(r.prompt_token_ids), len(r.output_token_ids),
                  r.num_computed_tokens, r.num_preemptions, 0, r.params.max_tokens] for r in waiting]  # fmt: skip
        assert frame["requests"] == want and frame["requests_more"] == 0
        state, owner, refs, evictable = expected_blocks(e)
        pool = frame["pool"]
        assert (pool["num_blocks"], pool["block_size"], pool["num_free"]) == (e.num_blocks, BLOCK, e.kv.num_free_blocks)
        assert pool["state"] == state and pool["owner"] == owner
        assert pool["shared"] == [[b, n] for b, n in enumerate(refs) if n > 1]
        assert pool["cached_lru"] == evictable  # in the order they will be evicted
        json.dumps(frame)  # what the stream sends: plain JSON
        self.frames.append(frame)


@pytest.fixture(scope="module")
def engines(checkpoint_factory):
    path = checkpoint_factory("llama")
    kw = dict(dtype="float64", block_size=BLOCK, kv_cache_memory=kv_bytes(path, 12 * BLOCK), max_num_seqs=4,
              max_num_batched_tokens=16, seed=0)  # fmt: skip
    made = {"level3": level3_prefix.LLMEngine(path, **kw),
            "level4": level4_speculative.LLMEngine(path, speculative_config={"method": "ngram",
                                                   "num_speculative_tokens": 2, "prompt_lookup_max": 2}, **kw)}  # fmt: skip
    for engine in made.values():
        feed = DashboardFeed(hz=None).attach(engine)  # a frame every step
        feed.subscribe(Checker(engine))
    return made


actions = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 2), st.integers(1, 14), st.integers(1, 12)),
    st.tuples(st.just("step"), st.integers(1, 6)),
    st.tuples(st.just("abort"), st.integers(0, 20)),
), min_size=1, max_size=12)  # fmt: skip


@pytest.mark.parametrize("level", ["level3", "level4"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=actions)
def test_every_frame_equals_the_engine_state_and_the_steps_add_up(engines, level, plan):
    engine = engines[level]
    feed, checker = engine.observers[-1], engine.observers[-1]._subscribers[0]
    frames_before, steps_before = len(checker.frames), len(engine.step_log)
    generated, spec = engine.stats.generated_tokens, getattr(engine, "spec_stats", None)
    drafts = lambda: (spec.num_draft_tokens, spec.num_accepted_tokens) if spec else (0, 0)  # noqa: E731
    drafted, accepted = drafts()
    prefixes = [[7, 3, 9, 1, 4, 4, 2, 8], [5] * 8, []]  # shared prefixes: blocks with refs > 1, cached blocks
    ids = itertools.count(len(engine.step_log) * 100)
    added = []
    for act in plan + [("step", 10**6)]:  # then run to the end
        if act[0] == "add":
            _, p, n, m = act
            rid = f"r{next(ids)}"
            engine.add_request(rid, prefixes[p] + [10 + len(added)] * n,
                               SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))  # fmt: skip
            added.append(rid)
        elif act[0] == "abort" and added:
            engine.abort_request(added[act[1] % len(added)])
            feed.capture(engine)  # an abort between steps: the frame an idle server's page asks for
        elif act[0] == "step":
            for _ in range(act[1]):
                if not engine.has_unfinished_requests():
                    break
                engine.step()
    new = checker.frames[frames_before:]
    rows = [row for f in new for row in f["steps"]]
    records = list(engine.step_log)[steps_before:]
    assert len(rows) == len(records)  # every step once, in a frame
    assert [r[1:4] for r in rows] == [[len(s.request_ids), s.num_prefill_tokens,
                                       s.num_batched_tokens - s.num_prefill_tokens] for s in records]  # fmt: skip
    assert sum(r[6] for r in rows) == engine.stats.generated_tokens - generated
    assert sum(r[7] for r in rows) == drafts()[0] - drafted
    assert sum(r[8] for r in rows) == drafts()[1] - accepted
    assert [f["seq"] for f in new] == list(range(new[0]["seq"], new[0]["seq"] + len(new))) if new else True
    if records:
        assert new[-1]["running"] == new[-1]["waiting"] == 0  # the idle engine's frame: nothing held
        assert USED not in new[-1]["pool"]["state"] and SHARED not in new[-1]["pool"]["state"]


def test_the_prefix_is_drawn_shared_then_cached(engines):
    """The classroom picture: a second request with the first one's 8-token prefix shares its two
    blocks (drawn shared, 2 holders); once both finish, those blocks stay cached (evictable)."""
    engine = engines["level3"]
    checker = engine.observers[-1]._subscribers[0]
    prefix = [11, 12, 13, 14, 15, 16, 17, 18]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request("first", prefix + [30] * 3, params)
    engine.step()  # its prompt's blocks are computed, and named
    engine.add_request("second", prefix + [31] * 3, params)
    engine.step()  # the second finds them
    frame = checker.frames[-1]
    shared = dict(map(tuple, frame["pool"]["shared"]))
    assert len(shared) == 2 and set(shared.values()) == {2}
    while engine.has_unfinished_requests():
        engine.step()
    cached = checker.frames[-1]["pool"]["cached_lru"]
    assert set(shared) <= set(cached)


# --- bounds -----------------------------------------------------------------------------------------
class FakeRecord:
    def __init__(self, running=1, waiting=0):
        self.time, self.running, self.waiting, self.request_ids = 0.0, running, waiting, ["q0"] * running
        self.num_prefill_tokens = self.num_batched_tokens = 1
        self.step_seconds, self.preempted = 0.001, 0


def tiny_snapshot(num_requests: int, num_blocks: int = 8) -> KVSnapshot:
    reqs = tuple(RequestBlocks(f"q{i}", 0, "waiting", ()) for i in range(num_requests))
    return KVSnapshot(num_blocks, BLOCK, num_blocks, reqs, (0,) * num_blocks, ())


def test_the_header_says_the_caches_dtype_and_the_blocks_it_buys(checkpoint_factory):
    """kv_cache_dtype="int8" (head_dim 16: 20 bytes a head against float32's 64): the page's info names the format
    and the blocks the same memory holds in the model's dtype, which a float32 cache of that memory has."""
    path = checkpoint_factory("llama")
    for tokens in (40 * BLOCK, 38 * BLOCK):  # 40 and 38 float32 blocks (int8's 121 x 20 / 64 = 37.8: not a ratio)
        budget = kv_bytes(path, tokens, dtype_bytes=4)
        plain, int8 = (level3_prefix.LLMEngine(path, dtype="float32", block_size=BLOCK, kv_cache_memory=budget,
                                               kv_cache_dtype=dt) for dt in ("auto", "int8"))  # fmt: skip
        a, b = (engine_info(e, "m", "offline", completions=False) for e in (plain, int8))
        assert (a["kv_cache_dtype"], a["model_dtype"], a["blocks_in_model_dtype"]) == ("float32", "float32", plain.num_blocks)
        assert (b["kv_cache_dtype"], b["model_dtype"]) == ("int8", "float32") and b["num_blocks"] > 3 * plain.num_blocks
        assert b["blocks_in_model_dtype"] == plain.num_blocks == tokens // BLOCK
        json.dumps(b)


def test_frames_come_at_most_hz_a_second_and_only_while_watched():
    now = [0.0]
    feed = DashboardFeed(hz=5, clock=lambda: now[0])
    assert not feed.wants_snapshot(FakeRecord())  # nobody watches: no snapshot, ever
    got = []
    feed.subscribe(got.append)
    wanted = []
    for _ in range(100):  # 100 steps over one second
        now[0] += 0.01
        want = feed.wants_snapshot(FakeRecord())
        wanted.append(want)
        feed(FakeRecord(), tiny_snapshot(1) if want else None)
    assert 5 <= sum(wanted) <= 6 and len(got) == sum(wanted)
    assert sum(len(f["steps"]) for f in got) + len(feed._steps) == 100  # every step's row, once
    assert not feed.wants_snapshot(FakeRecord(running=0, waiting=0))  # the cap holds for the last step too
    hub = DashboardHub(DashboardFeed(), {})
    assert not hub.watched  # a hub without clients does not ask for frames
    feed2 = DashboardFeed(hz=None)
    feed2.subscribe(hub)
    assert not feed2.watched and not feed2.wants_snapshot(FakeRecord())
    for _ in range(50):  # steps nobody watches leave nothing behind
        feed2(FakeRecord(), None)
    hub.watched = True  # a page opens
    feed2(FakeRecord(), tiny_snapshot(1))
    assert len(feed2.latest["steps"]) == 1  # its first frame has this step only, not fifty stale ones


def test_a_frame_is_bounded_whatever_the_load(monkeypatch):
    monkeypatch.setattr(dashboard, "MAX_REQUESTS", 3)
    monkeypatch.setattr(dashboard, "MAX_BLOCKS", 4)
    reqs = tuple(RequestBlocks(f"q{i}", 0, "running", (i,)) for i in range(6))
    snap = KVSnapshot(8, BLOCK, 2, reqs, (1,) * 6 + (0, 0), ())
    frame = build_frame(snap, [], 0.0, 1)
    assert len(frame["requests"]) == 3 and frame["requests_more"] == 3
    assert frame["pool"]["shown"] == 4 and len(frame["pool"]["state"]) == 4
    assert frame["pool"]["owner"] == [0, 1, 2, -2]  # block 3's holder is not listed
    assert frame["running"] == 6
    feed = DashboardFeed(hz=None)
    feed.subscribe(lambda f: None)
    for _ in range(dashboard.MAX_STEPS + 50):
        feed(FakeRecord(), None)
    assert len(feed._steps) == dashboard.MAX_STEPS  # rows between two frames are capped


def test_block_states_reads_shared_used_cached_and_free():
    reqs = (RequestBlocks("a", 0, "running", (0, 1)), RequestBlocks("b", 0, "running", (0, 2)),
            RequestBlocks("c", 0, "waiting", ()))  # fmt: skip
    snap = KVSnapshot(5, BLOCK, 2, reqs, (2, 1, 1, 0, 0), (4,))
    assert block_states(snap) == ([SHARED, USED, USED, FREE, CACHED], [0, 0, 1, -1, -1])


@settings(max_examples=200, deadline=None)
@given(state=st.lists(st.sampled_from([FREE, CACHED, USED, SHARED]), min_size=1, max_size=300), size=st.integers(1, 40))
def test_a_cell_counts_its_run_of_blocks_and_the_cells_count_the_pool(state, size):
    cells = dashboard.pool_cells(state, size)
    assert len(cells) == -(-len(state) // size)  # ceil: the last run may be shorter
    for i, counts in enumerate(cells):
        run = state[i * size : (i + 1) * size]
        assert counts == [run.count(s) for s in (FREE, CACHED, USED, SHARED)]  # indexed by state
        assert sum(counts) == len(run) == (size if i < len(cells) - 1 else len(state) - i * size)
    assert [sum(c[s] for c in cells) for s in (FREE, CACHED, USED, SHARED)] == [state.count(s) for s in range(4)]


def test_a_big_pool_is_sent_in_cells_of_consecutive_blocks_a_small_one_block_by_block():
    """The server's default pool on a CPU (10,922 blocks): 497 cells of 22 blocks, whose counts are its
    blocks'; a pool of MAX_CELLS blocks or fewer (85: the docs' small pool) is drawn a block a square."""
    assert [dashboard.cell_size(n) for n in (1, 85, 512, 513, 1024, 1025, 10922)] == [1, 1, 1, 2, 2, 3, 22]
    n, prefix = 10922, tuple(range(9))  # a burst: nine prefix blocks shared by five requests, two of their own each
    reqs = tuple(RequestBlocks(f"q{i}", 0, "running", prefix + (9 + 2 * i, 10 + 2 * i)) for i in range(5))
    refs = [0] * n
    for r in reqs:
        for b in r.block_ids:
            refs[b] += 1
    snap = KVSnapshot(n, BLOCK, n - 19, reqs, tuple(refs), (30, 31))  # two cached blocks, in cell 1
    pool = build_frame(snap, [], 0.0, 1)["pool"]
    assert pool["cell_size"] == 22 and len(pool["cells"]) == 497
    assert pool["cells"][0] == [22 - 19, 0, 10, 9]  # [free, cached, used, shared]: the whole burst in one cell
    assert pool["cells"][1] == [20, 2, 0, 0] and pool["cells"][-1] == [n - 496 * 22, 0, 0, 0]
    assert len(pool["state"]) == len(pool["owner"]) == n  # still every block: the page zooms into a cell's
    small = build_frame(KVSnapshot(85, BLOCK, 85 - 19, reqs, tuple(refs[:85]), ()), [], 0.0, 1)["pool"]
    assert small["cell_size"] == 1 and small["cells"] == []


def test_a_slow_reader_skips_to_the_newest_frame():
    async def scenario():
        import asyncio

        hub = DashboardHub(DashboardFeed(), {})
        hub.start(asyncio.get_running_loop())
        q = asyncio.Queue(maxsize=1)
        hub._clients.add(q)
        for seq in range(1, 6):  # five frames while the client reads none
            hub._put({"seq": seq})
        return q.qsize(), q.get_nowait()["seq"], hub.latest["seq"]

    import asyncio

    assert asyncio.run(scenario()) == (1, 5, 5)


# --- the server ---------------------------------------------------------------------------------------
def read_frames(url: str, n: int, headers: dict | None = None, timeout: float = 60.0) -> list[dict]:
    frames = []
    with httpx.stream("GET", url + "/dashboard/events", headers=headers, timeout=timeout) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        for line in s.iter_lines():
            if line.startswith("data: "):
                frames.append(json.loads(line[len("data: "):]))
                if len(frames) >= n:
                    break
    return frames


def test_the_server_streams_the_feeds_frames_while_it_serves(server):
    page = httpx.get(server.url + "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/dashboard/dashboard.js" in page.text
    for path in ("/dashboard/dashboard.js", "/dashboard/dashboard.css"):
        assert httpx.get(server.url + path).status_code == 200
    info = httpx.get(server.url + "/dashboard/info").json()
    assert info["model"] == NAME and info["mode"] == "server" and info["completions"] is True
    frames: list[dict] = []
    reader = threading.Thread(target=lambda: frames.extend(read_frames(server.url, 4)))
    reader.start()
    hub = server.engine.engine.observers[-1]._subscribers[0]
    deadline = time.monotonic() + 10
    while not hub.watched and time.monotonic() < deadline:  # the stream is open before the request
        time.sleep(0.01)
    out = server.client.completions.create(model=NAME, prompt="ROMEO:", max_tokens=200, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 200
    reader.join(60)
    assert len(frames) == 4
    assert all(a["seq"] < b["seq"] for a, b in zip(frames, frames[1:]))  # each frame once, in order
    busy = [f for f in frames if f["running"]]
    assert busy and all(f["requests"][0][0] == out.id for f in busy)  # the request, as the engine ran it
    assert any(sum(r[6] for r in f["steps"]) for f in frames)  # tokens were made between frames


def test_the_page_sees_an_aborted_requests_blocks_come_back(server, slow_steps):
    """A client that leaves mid-stream: its request is aborted between steps and, nothing else
    running, no step follows; the stream's idle refresh (IDLE_REFRESH_S) still shows the pool whole.
    The steps are slowed (400 tokens take 8 s at least), so the request is surely running when its client leaves."""
    frames: list[dict] = []
    done = threading.Event()

    def watch_until_whole():
        with httpx.stream("GET", server.url + "/dashboard/events", timeout=60) as s:
            for line in s.iter_lines():
                if line.startswith("data: "):
                    frames.append(json.loads(line[len("data: "):]))
                    f = frames[-1]
                    if len(frames) > 1 and f["running"] == 0 and f["pool"]["num_free"] == f["pool"]["num_blocks"]:
                        saw_running = any(g["running"] for g in frames)
                        if saw_running:
                            break
        done.set()

    reader = threading.Thread(target=watch_until_whole, daemon=True)
    reader.start()
    hub = server.engine.engine.observers[-1]._subscribers[0]
    deadline = time.monotonic() + 10
    while not hub.watched and time.monotonic() < deadline:  # the stream is open before the request
        time.sleep(0.01)
    aborted_before = aborted(metrics(server.url))
    body = {"model": NAME, "prompt": "ROMEO:", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:
                time.sleep(0.5)  # long enough for a frame of the running request
                break  # the client leaves: the server aborts the request
    reader.join(30)
    assert done.is_set() and any(f["running"] for f in frames)
    assert aborted(metrics(server.url)) - aborted_before == 1  # it was aborted, not finished
    assert frames[-1]["running"] == 0 and frames[-1]["pool"]["num_free"] == frames[-1]["pool"]["num_blocks"]


def test_no_dashboard_serves_none_of_it(ckpt):
    with serve(ckpt, ENGINE, dashboard_on=False) as s:
        for path in ("/dashboard", "/dashboard/info", "/dashboard/events", "/dashboard/dashboard.js"):
            assert httpx.get(s.url + path).status_code == 404
        assert not any(isinstance(o, DashboardFeed) for o in s.engine.engine.observers)


def test_behind_an_api_key_the_page_asks_for_it_and_the_data_needs_it(ckpt):
    with serve(ckpt, ENGINE, api_key="sk-dash") as s:
        page = httpx.get(s.url + "/dashboard")
        assert page.status_code == 200 and 'id="keybox"' in page.text  # the page asks for the key
        for path in ("/dashboard/info", "/dashboard/events"):
            r = httpx.get(s.url + path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(s.url + "/dashboard/info", headers={"Authorization": "Bearer sk-dash"}).status_code == 200
        assert read_frames(s.url, 1, headers={"Authorization": "Bearer sk-dash"}, timeout=30)


# --- offline and simulated runs ---------------------------------------------------------------------------
def watch(args: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.watch", "--port", "0", *args], cwd=REPO,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    line = proc.stderr.readline()
    m = re.search(r"(http://\S+)/dashboard", line)
    assert m, line
    return proc, m[1]


@pytest.mark.parametrize("args,mode", [
    (["--level", "3", "--workload", "shared-prefix", "--requests", "6", "--pace", "0.01"], "offline"),
    (["--simulate", "--workload", "sharegpt", "--requests", "12", "--rate", "4", "--speed", "20"], "simulator"),
])  # fmt: skip
def test_watch_shows_an_offline_run_and_the_simulator(args, mode):
    proc, url = watch([*args, "--wait", "60", "--no-hold"])
    try:
        assert httpx.get(url + "/dashboard/info").json()["mode"] == mode
        frames = read_frames(url, 3)  # the run starts once this page is connected
        assert all(f["pool"]["num_blocks"] == frames[0]["pool"]["num_blocks"] for f in frames)
        assert any(f["running"] for f in frames)
        assert proc.wait(120) == 0
        assert "requests finished" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


# --- Grafana --------------------------------------------------------------------------------------------
def test_the_grafana_dashboard_loads_and_names_only_served_metrics(server):
    board = json.loads((REPO / "examples" / "grafana" / "inference-ladder.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 8 and all(p.get("datasource") for p in board["panels"] if p.get("targets"))
    named = {m for e in exprs for m in re.findall(r"vllm:[a-z0-9_]+", e)}
    server.client.completions.create(model=NAME, prompt="ROMEO:", max_tokens=4)  # every series has a sample
    served = {line.split("{")[0].split(" ")[0] for line in httpx.get(server.url + "/metrics").text.splitlines()
              if line.startswith("vllm:")}  # fmt: skip
    assert named and named <= served, named - served
    scrape = (REPO / "examples" / "grafana" / "prometheus.yml").read_text()
    assert "metrics_path: /metrics" in scrape and "localhost:8000" in scrape
