"""The live dashboard: the engine's block pool, queues and steps, streamed to a browser page.

What it is: three pieces between the engine thread and a page (`static/dashboard.html`):

    engine thread                          event loop                         browser
    ─────────────                          ──────────                         ───────
    step() ─> DashboardFeed(record, snap)  DashboardHub                       GET /dashboard
              a row per step (batch,       latest frame, one pending          GET /dashboard/events
              prefill/decode tokens,  ──>  frame per client (a slow      ──>  (server-sent events:
              time, drafts); a frame       client skips frames, never          one JSON frame each)
              a few times a second         queues them)

- `DashboardFeed` is a step observer (level2_continuous/observers.py). Every step it keeps
  a small row (bounded: MAX_STEPS between two frames); at most `hz` times a second, and only
  while someone watches, it asks the engine for a KV snapshot and turns it into a *frame*:
  the pool as two arrays (each block's state and owner), the shared blocks with their
  reference counts, a big pool's blocks counted in runs (the page's cells: `pool_cells`),
  the cached-but-free blocks in eviction order, the queues with each request's progress
  (at most MAX_REQUESTS listed), the step rows since the last frame, and the times to first
  token of the requests that finished since (the engine's TTFT histogram grows when a request
  finishes). A frame is bounded in size whatever the engine's load: MAX_BLOCKS blocks,
  MAX_REQUESTS requests, MAX_STEPS rows.
- `block_states(snapshot)` is the picture's one idea: a block is free, cached (free, but
  still holding a named prefix a later request may reuse), used by one request, or shared
  by several (level 3's prefix hits, level 4's forked samples).
- `pool_cells(state, size)` is the picture of a big pool: a square a block reads well for a few
  hundred blocks, but the CPU server's default pool (10,922 blocks) would be a field of 4-pixel
  squares in which a burst is a sliver of the first row. So a frame of a pool of more than
  MAX_CELLS blocks also counts it in at most MAX_CELLS cells, each a run of `cell_size`
  consecutive blocks, by state; where the blocks do not fit the page at a readable size, it
  draws the cells, filled by those shares, and zooms into one cell's blocks on a click (it has
  every block's state and owner for that: the frame still carries them all).
- `DashboardHub` lives on the event loop: the feed hands it each frame with
  `call_soon_threadsafe`, it keeps the latest, and each SSE client (at most MAX_CLIENTS)
  gets the newest frame when it is ready to read, each frame once. `add_routes` puts the page,
  its script, its style sheet, `/dashboard/info` and `/dashboard/events` on a FastAPI app: the
  level-6 server's (`build_app(..., dashboard_on=True)`) or a small one of its own for an
  offline run or the simulator (`dashboard_app`, used by `python -m benchmarks.watch`).
- At most `hz` frames a second, the last step of a burst included: an idle engine makes no
  more steps, so the server's open streams ask it for a frame after IDLE_REFRESH_S of quiet
  (an offline run asks once it ends).

With no page open the feed builds nothing and keeps nothing: the engine's step costs a
counter read.

What it is not: a metrics store (Prometheus and Grafana are: examples/grafana/), or a way to
change the engine (a frame is a copy; nothing is read back).

Reference: vLLM's Grafana dashboards over its `vllm:` metrics (examples/online_serving/
prometheus_grafana); the SGLang radix-cache visualisers, which redraw the idea from a model
of it, where this page draws the real engine's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from importlib import resources

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from level0_naive.kv_cache import kv_bytes_per_token
from level1_paged.block_table import blocks_in_budget
from level2_continuous.observers import KVSnapshot, snapshot

HZ = 5.0  # frames a second at most
MAX_STEPS = 512  # step rows kept between two frames (a frame carries at most this many)
MAX_REQUESTS = 256  # requests listed in a frame (running first); the rest are counted
MAX_BLOCKS = 16384  # blocks drawn (the grid of a bigger pool shows its first MAX_BLOCKS)
MAX_CELLS = 512  # a pool of more blocks is drawn as runs of blocks, at most this many (pool_cells)
MAX_CLIENTS = 16  # open event streams; one more is answered 503
IDLE_REFRESH_S = 1.0  # no frame for this long: ask the engine for one (an abort while idle makes no step)
HEARTBEAT_S = 15.0  # an SSE comment line keeps proxies from closing a quiet stream

FREE, CACHED, USED, SHARED = 0, 1, 2, 3  # a block's state in a frame
PAGES = {  # what /dashboard serves, from the package (no build step)
    "/dashboard": ("dashboard.html", "text/html; charset=utf-8"),
    "/dashboard/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}


def block_states(snap: KVSnapshot) -> tuple[list[int], list[int]]:
    """Per physical block, its state and its owner, as the grid draws them:

        state   SHARED  held by more than one request (reference count > 1)
                USED    held by exactly one
                CACHED  held by none, but still naming a prefix (in snap.cached_free)
                FREE    held by none, holding nothing anyone can find
        owner   the index in snap.requests of the first request whose table holds the block
                (its colour on the page); -1 for a block nobody holds
    """
    owner = [-1] * snap.num_blocks  # [num_blocks]
    for i, req in enumerate(snap.requests):
        for b in req.block_ids:
            if owner[b] < 0:
                owner[b] = i
    cached = set(snap.cached_free)
    state = [SHARED if refs > 1 else USED if refs == 1 else CACHED if b in cached else FREE
             for b, refs in enumerate(snap.ref_counts)]  # fmt: skip
    return state, owner


def cell_size(num_blocks: int) -> int:
    """Blocks per cell of the page's grid: 1 (a cell is a block) for a pool of up to MAX_CELLS blocks;
    above, the fewest that make at most MAX_CELLS cells (10,922 blocks: 22 a cell, 497 cells)."""
    return max(1, math.ceil(num_blocks / MAX_CELLS))


def pool_cells(state: list[int], size: int) -> list[list[int]]:
    """The grid of a big pool: for each run of `size` consecutive blocks (the last run may be shorter),
    how many of its blocks are in each state, indexed by state (cells[i][SHARED]: cell i's shared blocks):

        block   0  1  2  3 | 4  5  6  7 | 8  9          size 4
        state   S  S  U  F | C  C  F  F | F  F          (SHARED, USED, FREE, CACHED)
        cell    [1,0,1,2]    [2,2,0,0]    [2,0,0,0]     [free, cached, used, shared]

    Each cell's counts add up to its blocks, and all of them to len(state): nothing is drawn twice or lost."""
    runs = (state[first : first + size] for first in range(0, len(state), size))
    return [[run.count(s) for s in (FREE, CACHED, USED, SHARED)] for run in runs]  # [num_cells, 4]


def build_frame(snap: KVSnapshot, steps: list, now: float, seq: int, ttft: tuple[float, int] = (0.0, 0)) -> dict:
    """One frame: the snapshot, the step rows since the last frame, and the new first tokens."""
    state, owner = block_states(snap)
    shown = min(snap.num_blocks, MAX_BLOCKS)
    size = cell_size(shown)
    listed = snap.requests[:MAX_REQUESTS]
    return {
        "seq": seq,
        "time": now,
        "pool": {
            "num_blocks": snap.num_blocks,
            "block_size": snap.block_size,
            "num_free": snap.num_free_blocks,
            "shown": shown,
            "state": state[:shown],  # [shown] FREE / CACHED / USED / SHARED
            "owner": [o if o < MAX_REQUESTS else -2 for o in owner[:shown]],  # -2: a request not listed
            "shared": [[b, r] for b, r in enumerate(snap.ref_counts[:shown]) if r > 1],  # [block, refs]
            "cached_lru": list(snap.cached_free[:MAX_BLOCKS]),  # evicted first, first
            "cell_size": size,  # blocks per cell of the grid (1: one cell a block, and no cells sent)
            "cells": pool_cells(state[:shown], size) if size > 1 else [],  # [cells, 4] counts by state
        },
        "running": sum(r.status == "running" for r in snap.requests),
        "waiting": sum(r.status != "running" for r in snap.requests),
        # [id, sample index, status, prompt, output, computed tokens, preemptions, blocks, max_tokens]
        "requests": [[r.request_id, r.index, r.status, r.num_prompt_tokens, r.num_output_tokens,
                      r.num_computed_tokens, r.num_preemptions, len(r.block_ids), r.max_tokens]
                     for r in listed],  # fmt: skip
        "requests_more": len(snap.requests) - len(listed),
        # [time, batch, prefill tokens, decode tokens, step seconds, preempted, generated, drafted, accepted]
        "steps": steps,
        "ttft": {"sum": ttft[0], "count": ttft[1]},
    }


class DashboardFeed:
    """The engine-thread side: a step observer that makes frames (see the module docstring).

    `hz`: frames a second at most (None: one every step, for tests); `clock`: the wall clock that
    paces the frames (not the engine's, which a simulator moves by its own rules); `step_seconds`:
    how long a step took (a simulator gives its modelled time)."""

    def __init__(self, hz: float | None = HZ, clock: Callable[[], float] = time.monotonic,
                 step_seconds: Callable[[object], float] | None = None):  # fmt: skip
        self.interval = 0.0 if not hz else 1.0 / hz
        self.clock = clock
        self.step_seconds = step_seconds or (lambda record: record.step_seconds)
        self.engine = None
        self.latest: dict | None = None
        self.seq = 0
        self._last_frame = -math.inf
        self._steps: deque[list] = deque(maxlen=MAX_STEPS)
        self._subscribers: list[Callable[[dict], None]] = []
        self._generated = self._drafted = self._accepted = 0  # the engine's counters at the last step
        self._ttft = (0.0, 0)  # the engine's TTFT histogram (sum, count) at the last frame
        self._unwatched = False  # steps went by with nobody watching

    # --- wiring ------------------------------------------------------------------------------
    def attach(self, engine) -> DashboardFeed:
        """Observe `engine` (before it runs, or between steps on its own thread)."""
        self.engine = engine
        self._generated, self._drafted, self._accepted = self._counters()
        self._ttft = self._ttft_now()
        engine.observers.append(self)
        return self

    def subscribe(self, deliver: Callable[[dict], None]) -> None:
        """`deliver(frame)` is called on the engine thread for each frame (the hub hops to its loop)."""
        self._subscribers.append(deliver)

    @property
    def watched(self) -> bool:
        """Frames are made only while someone takes them (a hub with clients, a test)."""
        return any(getattr(s, "watched", True) for s in self._subscribers)

    # --- the observer ------------------------------------------------------------------------
    def wants_snapshot(self, record) -> bool:
        return self.watched and self.clock() - self._last_frame >= self.interval

    def __call__(self, record, snap: KVSnapshot | None) -> None:
        generated, drafted, accepted = self._counters()
        if not self.watched:  # nobody looks: keep nothing, so the first frame a page gets is not stale
            self._generated, self._drafted, self._accepted = generated, drafted, accepted
            self._unwatched = True
            return
        if self._unwatched:  # a page has just opened: the TTFTs it sees start now
            self._steps.clear()
            self._ttft, self._unwatched = self._ttft_now(), False
        # the step's batch is the requests it ran (record.running counts those left after it)
        self._steps.append([record.time, len(record.request_ids), record.num_prefill_tokens,
                            record.num_batched_tokens - record.num_prefill_tokens, self.step_seconds(record),
                            record.preempted, generated - self._generated, drafted - self._drafted,
                            accepted - self._accepted])  # fmt: skip
        self._generated, self._drafted, self._accepted = generated, drafted, accepted
        if snap is not None:
            self._publish(snap, record.time)

    def capture(self, engine=None) -> dict:
        """A frame now, between steps, on the engine's thread (an idle engine makes no step: an
        abort or a finished request would otherwise stay on the page)."""
        engine = engine or self.engine
        sched = engine.scheduler
        return self._publish(snapshot(engine.kv, list(sched.running), list(sched.waiting)), engine.clock())

    def _publish(self, snap: KVSnapshot, now: float) -> dict:
        ttft = self._ttft_now()
        new = (ttft[0] - self._ttft[0], ttft[1] - self._ttft[1])
        self.seq += 1
        frame = build_frame(snap, list(self._steps), now, self.seq, new)
        self._steps.clear()
        self._ttft, self._last_frame, self.latest = ttft, self.clock(), frame
        for deliver in self._subscribers:
            deliver(frame)
        return frame

    def _counters(self) -> tuple[int, int, int]:
        e = self.engine
        if e is None:
            return 0, 0, 0
        spec = getattr(e, "spec_stats", None)
        return (e.stats.generated_tokens, spec.num_draft_tokens if spec else 0,
                spec.num_accepted_tokens if spec else 0)  # fmt: skip

    def _ttft_now(self) -> tuple[float, int]:
        return (0.0, 0) if self.engine is None else (self.engine.stats.ttft.sum, self.engine.stats.ttft.count)


class DashboardHub:
    """The event-loop side: the latest frame, and one pending frame per open event stream."""

    def __init__(self, feed: DashboardFeed, info: dict, refresh: Callable[[], Awaitable] | None = None,
                 closing: Callable[[], bool] = lambda: False):  # fmt: skip
        self.feed, self.info, self.refresh, self.closing = feed, info, refresh, closing
        self.latest: dict | None = None
        self._clients: set[asyncio.Queue] = set()  # one per open stream, added by the stream itself
        self._loop: asyncio.AbstractEventLoop | None = None
        self._encoded: tuple[int, bytes] | None = None  # (seq, the latest frame as an SSE event)
        self.watched = False  # read by the feed on the engine thread: a plain bool, set on the loop
        feed.subscribe(self)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def __call__(self, frame: dict) -> None:  # on the engine thread
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._put, frame)
            except RuntimeError:  # the loop is closed: nobody is watching any more
                pass

    def _put(self, frame: dict) -> None:
        self.latest = frame
        for q in self._clients:
            if q.full():
                q.get_nowait()  # a slow reader skips to the newest frame
            q.put_nowait(frame)

    def encode(self, frame: dict) -> bytes:
        """The frame as one SSE event, encoded once however many clients read it."""
        if self._encoded is None or self._encoded[0] != frame["seq"]:
            self._encoded = (frame["seq"], b"data: " + json.dumps(frame, separators=(",", ":")).encode() + b"\n\n")
        return self._encoded[1]

    async def events(self, request: Request) -> Response:
        if len(self._clients) >= MAX_CLIENTS:
            return JSONResponse({"error": {"message": f"at most {MAX_CLIENTS} dashboards at once", "type": "busy",
                                           "param": None, "code": None}}, status_code=503)  # fmt: skip

        async def stream():
            q: asyncio.Queue = asyncio.Queue(maxsize=1)
            self._clients.add(q)  # here, not before: a body that is never iterated holds no slot
            self.watched, sent = True, 0
            try:
                if self.latest is not None:
                    sent = self.latest["seq"]
                    yield self.encode(self.latest)
                quiet = 0.0
                while not self.closing():
                    try:
                        frame = await asyncio.wait_for(q.get(), timeout=0.5)  # short: a drain is noticed soon
                    except asyncio.TimeoutError:
                        quiet += 0.5
                        if self.refresh is not None and quiet >= IDLE_REFRESH_S and q.empty():
                            await self._refresh()
                        if quiet >= HEARTBEAT_S:
                            quiet = 0.0
                            yield b": keep-alive\n\n"
                        continue
                    quiet = 0.0
                    if frame["seq"] > sent:  # the latest, sent first, may also be waiting in q
                        sent = frame["seq"]
                        yield self.encode(frame)
            finally:
                self._clients.discard(q)
                self.watched = bool(self._clients)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip

    async def _refresh(self) -> None:
        """Ask the idle engine for a frame (it makes no steps, so no frames, while idle)."""
        try:
            await self.refresh()
        except Exception:  # noqa: BLE001 - a dead or stopped engine: the page keeps its last frame
            return


def page(name: str) -> bytes:
    return resources.files("level6_serving").joinpath("static", name).read_bytes()


def add_routes(app: FastAPI, hub: DashboardHub, needs_key: bool = False) -> None:
    """The page, its script and style (open: they hold no data), `/dashboard/info` and the event stream.
    `needs_key`: the page is told (data-auth="1") to ask for the API key before it asks for anything."""
    for path, (name, media_type) in PAGES.items():
        body = page(name)
        if needs_key and name.endswith(".html"):
            body = body.replace(b'data-auth="0"', b'data-auth="1"')
        app.add_api_route(path, lambda body=body, media_type=media_type: Response(body, media_type=media_type),
                          methods=["GET"], include_in_schema=False)  # fmt: skip
    app.add_api_route("/dashboard/info", lambda: hub.info, methods=["GET"], include_in_schema=False)
    app.add_api_route("/dashboard/events", hub.events, methods=["GET"], include_in_schema=False)


def kv_format_info(engine) -> dict:
    """The cache's format and the blocks it buys: `kv_cache_dtype` ("fp8", "int8", or the model's dtype's name)
    and how many blocks the same memory would hold in the model's dtype (a head's slot is head_bytes in the
    cache, head_dim x the element's size in the model's dtype; docs/quantization.md)."""
    model_dtype = str(getattr(engine, "dtype", "")).removeprefix("torch.")
    name = getattr(engine.config.cache, "kv_cache_dtype", "auto")
    if name == "auto" or not hasattr(engine, "model_config"):  # (the simulator's engines model no format)
        return {"kv_cache_dtype": model_dtype or name, "model_dtype": model_dtype, "blocks_in_model_dtype": engine.num_blocks}
    cfg, bs = engine.model_config, engine.config.cache.block_size
    here = kv_bytes_per_token(cfg, engine.dtype, head_bytes=engine.config.cache.kv_head_bytes(cfg.head_dim))
    plain = engine.bytes_per_token - here + kv_bytes_per_token(cfg, engine.dtype)  # (a draft's cache stays as it is)
    budget = getattr(engine, "kv_budget", None)
    if budget is not None and blocks_in_budget(budget, bs, engine.bytes_per_token) == engine.num_blocks:
        blocks = blocks_in_budget(budget, bs, plain)  # what the engine would have made of the same bytes
    else:  # (level 5's ranks size their own pools: the ratio of the slots, rounded down)
        blocks = engine.num_blocks * here // plain
    return {"kv_cache_dtype": name, "model_dtype": model_dtype, "blocks_in_model_dtype": blocks}


def engine_info(engine, model_name: str, mode: str, completions: bool, hz: float | None = HZ) -> dict:
    """What the page's header says, read once from the engine's configuration."""
    c = engine.config
    return {
        "model": model_name,
        "mode": mode,  # server | offline | simulator
        "engine": type(engine).__name__,
        "completions": completions,  # the prompt box and the burst button need /v1/completions
        "num_blocks": engine.num_blocks,
        "block_size": c.cache.block_size,
        **kv_format_info(engine),
        "max_num_seqs": c.scheduler.max_num_seqs,
        "prefix_caching": bool(getattr(c.cache, "enable_prefix_caching", False)),
        "speculative": getattr(engine, "speculative_config", None) is not None,
        "hz": hz,
    }


def dashboard_app(engine, model_name: str, mode: str, hz: float | None = HZ,
                  step_seconds: Callable[[object], float] | None = None) -> tuple[FastAPI, DashboardFeed]:  # fmt: skip
    """A server with the dashboard alone, for an engine run on this thread (an offline run, the
    simulator): no completions, and no refresh (the engine is not ours to call between steps)."""
    feed = DashboardFeed(hz, step_seconds=step_seconds).attach(engine)
    hub = DashboardHub(feed, engine_info(engine, model_name, mode, completions=False, hz=hz))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        hub.start(asyncio.get_running_loop())
        yield

    app = FastAPI(title=f"inference-ladder dashboard ({mode})", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)  # fmt: skip
    add_routes(app, hub)
    app.state.hub = hub
    return app, feed
