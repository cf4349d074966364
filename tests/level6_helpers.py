"""What the level-6 test files share: the server they start, and the helpers more than one of them uses.

What it is: the engine settings of the standard test server (`ENGINE`, served as `NAME`),
`serve()` (a real uvicorn on a free localhost port, a background thread of this process, so
a test can reach into the engine), offline generation to compare with, the Prometheus
samples, a raw SSE body split into its events with OpenAI's framing checked, an
`add_request` that fails on purpose, and `wait_for` (poll until something happens, or fail). The fixtures built on them (`ckpt`, `llm`, `server`)
are in conftest.py; each test module that asks for `server` gets its own (about 0.4 s to
start and stop).

What it is not: a test file (pytest collects nothing here), or the place for a helper
only one file uses.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai

from level6_serving import AsyncLLMEngine, SamplingParams
from level6_serving.api_server import ServerThread, build_app
from level6_serving.metrics import parse

# float64: equal texts then mean equal tokens, not luck at a near-tie
ENGINE = dict(dtype="float64", max_model_len=512, seed=0, kv_cache_memory=16 << 20)
NAME = "tiny"  # the served model name
LONG_CONTEXT = 8192  # positions of `long_ckpt` (conftest.py): answers that outlast a held-up client


@contextlib.contextmanager
def serve(ckpt: Path, engine_args: dict, *, middleware: tuple[tuple[type, dict], ...] = (), timeout: float = 600,
          **app_kw) -> Iterator[SimpleNamespace]:  # fmt: skip
    """A uvicorn serving `ckpt` as NAME: yields its url, the AsyncLLMEngine and an `openai` client
    (`timeout`: its seconds per request; 600 is the SDK's default). `middleware` (class, kwargs)
    pairs are added last, so the first of them sees a request before anything else does."""
    engine = AsyncLLMEngine.from_engine_args(str(ckpt), **engine_args)
    app = build_app(engine, [NAME], **app_kw)
    for cls, kw in middleware:
        app.add_middleware(cls, **kw)
    srv = ServerThread(app)
    with srv as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=timeout)
        yield SimpleNamespace(url=url, engine=engine, client=client)
        client.close()
    assert not srv.thread.is_alive(), "the server thread outlived its test module"


def offline(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw), progress=False)[0]


def metrics(url: str) -> dict[str, float]:
    return parse(httpx.get(url + "/metrics").text)


def sse_events(body: str | bytes) -> list[str]:
    """Raw SSE body -> the data of each event; checks OpenAI's framing on the way."""
    if isinstance(body, bytes):
        body = body.decode()
    assert body.endswith("\n\n"), "every event ends with a blank line"
    chunks = body[:-2].split("\n\n")
    assert all(c.startswith("data: ") and "\n" not in c for c in chunks), chunks
    return [c[len("data: ") :] for c in chunks]


def failing_add_request(engine):
    """`engine.add_request`, except that a request with max_tokens=13 raises RuntimeError("boom in
    add_request"): an exception inside one request, for a test to monkeypatch in."""
    add = engine.add_request

    def add_or_fail(request_id, prompt, params=None, priority=0, **kw):
        if params.max_tokens == 13:
            raise RuntimeError("boom in add_request")
        return add(request_id, prompt, params, priority, **kw)

    return add_or_fail


def wait_for(predicate, timeout: float, what: str):
    """Poll `predicate` until it is true, or fail. The last poll starts at the deadline or just after
    it: a poll slowed down by a busy machine (an HTTP request) still gets its answer looked at."""
    deadline = time.monotonic() + timeout
    while True:
        last = time.monotonic() >= deadline
        value = predicate()
        if value:
            return value
        if last:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.02)
