"""Lab 6's own checks: the stream plumbing alone, without a model or a socket.

What it is: pytest tests that `python -m labs check 6` runs next to level 6's own tests
(which run a real uvicorn). Here `RequestStream`s (level 6's per-request channels) are fed
by hand, so the order of outputs is chosen by the test: `merge_streams` must pass them on
as they come, re-raise a stream's error, and abort every request when its reader stops
early; and an `EventStream` whose client is gone before the first byte (an ASGI call whose
`receive` says "http.disconnect" at once) must still abort its requests.

What it is not: a test of HTTP (level 6's tests are).

Reference: the ASGI spec's `http.disconnect`; Starlette's StreamingResponse.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from level6_serving.async_engine import RequestStream
from level6_serving.serving import EventStream, merge_streams


def output(tag: str, finished: bool = False):
    return SimpleNamespace(tag=tag, finished=finished)  # all a RequestStream reads of an output


def test_merge_streams():
    async def as_they_come():
        aborted: list[str] = []
        a, b = RequestStream("a", [1], aborted.append), RequestStream("b", [2], aborted.append)
        got = []

        async def read():
            async for i, out in merge_streams([a, b]):
                got.append((i, out.tag))

        reader = asyncio.create_task(read())
        for stream, item in [(b, output("b1")), (a, output("a1")), (b, output("b2", True)), (a, output("a2", True))]:
            stream.put(item)
            await asyncio.sleep(0.02)
        await asyncio.wait_for(reader, 5)
        return got, aborted

    got, aborted = asyncio.run(as_they_come())
    assert got == [(1, "b1"), (0, "a1"), (1, "b2"), (0, "a2")], f"outputs must pass as they come, got {got}"
    assert aborted == [], f"finished requests must not be aborted: {aborted}"

    async def an_error():
        a, b = RequestStream("a", [1], print), RequestStream("b", [2], print)
        a.put(ValueError("the engine failed on this one"))
        async for _ in merge_streams([a, b]):
            pass

    with pytest.raises(ValueError, match="the engine failed"):
        asyncio.run(asyncio.wait_for(an_error(), 5))

    async def the_reader_leaves():
        aborted: list[str] = []
        a, b = RequestStream("a", [1], aborted.append), RequestStream("b", [2], aborted.append)
        gen = merge_streams([a, b])
        a.put(output("a1"))
        first = await asyncio.wait_for(gen.__anext__(), 5)
        await gen.aclose()  # the client left after the first chunk
        for _ in range(50):
            if len(aborted) == 2:
                break
            await asyncio.sleep(0.01)
        return first, sorted(aborted)

    first, aborted = asyncio.run(the_reader_leaves())
    assert first[0] == 0 and first[1].tag == "a1"
    assert aborted == ["a", "b"], f"a reader that stops early must abort every request it merged; aborted {aborted}"


def test_a_client_gone_before_the_first_byte_aborts():
    async def never_starts():
        await asyncio.Event().wait()  # the engine has not produced anything yet
        yield "data: never\n\n"

    async def run():
        aborted: list[str] = []
        stream = RequestStream("x", [1], aborted.append)
        response = EventStream(never_starts(), [stream])
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "POST", "path": "/",
                 "headers": []}  # fmt: skip

        async def receive():
            return {"type": "http.disconnect"}  # the client is already gone

        async def send(message):
            pass

        await asyncio.wait_for(response(scope, receive, send), 5)
        return aborted

    assert asyncio.run(run()) == ["x"], "the request of a client gone before the first byte was not aborted"


@pytest.fixture(scope="module")
def server():
    """A real uvicorn on a free port (a thread of this process) over the built-in model."""
    from level6_serving import AsyncLLMEngine
    from level6_serving.api_server import ServerThread, build_app

    engine = AsyncLLMEngine.from_engine_args("tiny-shakespeare", max_model_len=1024, seed=0, kv_cache_memory=16 << 20)
    srv = ServerThread(build_app(engine, ["tiny"]))
    with srv as url:
        yield SimpleNamespace(url=url, engine=engine)


def aborts(server) -> int:
    return server.engine.engine.stats.finished.get("abort", 0)


def wait_for(condition, seconds: float) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_clients_that_leave_abort_their_requests(server):
    """Three streaming clients leave after their first chunk, one non-streaming client gives up after
    0.3 s; each asked for 900 tokens, far more than can be generated before they leave. Every one of
    the four requests must end as an abort, and every block come back. (Level 6's own tests also
    demand it within a second; on a shared machine a lab allows 20 s, and counts the aborts.)"""
    import httpx

    body = {"model": "tiny", "max_tokens": 900, "min_tokens": 900, "ignore_eos": True, "temperature": 0}
    before = aborts(server)
    for name in ("KENT", "LEAR", "EDGAR"):
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "prompt": f"{name}:\n", "stream": True},
                          timeout=60) as r:  # fmt: skip
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # leaving the block closes the connection mid-answer
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.url + "/v1/completions", json={**body, "prompt": "FOOL:\n"}, timeout=httpx.Timeout(30, read=0.3)
        )
    assert wait_for(lambda: aborts(server) - before == 4, 20), (
        f"{aborts(server) - before} of 4 requests whose clients left were aborted: a stream must abandon its request "
        "when its reader goes (mid-stream, and a non-streaming client that gives up)"
    )
    assert wait_for(lambda: server.engine.engine.kv.usage()[0] == 0, 20), "blocks are still in use after the aborts"
