"""Level 6: clients that leave. A client that disconnects, streaming or not, is aborted, and
its blocks are free within a few seconds; the clients that stay are unaffected.

What it is: the level-6 test server (`server` in conftest.py, a thread of this process) with
every engine step slowed down by 20 ms (`slow_steps`), so a client surely leaves before its request ends;
the Prometheus counters say what was aborted, and the KV usage which blocks are still held.

What it is not: a speed test. The deadlines for freeing a disconnected client's blocks (5 s)
are generous; the aborts themselves take a step or two.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from level6_helpers import NAME, metrics, offline

from level6_serving.metrics import aborted, value

pytestmark = pytest.mark.level6


# --- disconnects ---------------------------------------------------------------------------------
def test_disconnected_clients_are_aborted_and_free_their_blocks(server, llm, slow_steps):
    """Three clients with short prompts stay; three with ~300-token prompts (19 blocks each)
    leave after their first chunk. Within a few seconds only the stayers' blocks may be in
    use, and the three that left were aborted (not finished: the steps are slowed down)."""
    names = ("KENT", "LEAR", "EDGAR", "REGAN", "GONERIL", "FOOL")
    prompts = [f"{n}:\n" if i % 2 == 0 else f"{n}: " + "the king is mad, " * 18 for i, n in enumerate(names)]
    num_blocks, block = server.engine.engine.num_blocks, server.engine.engine.config.cache.block_size
    stayers_max = 3 * -(-(len("GONERIL:\n") + 150) // block)  # the most blocks three stayers can hold
    aborted_before = aborted(metrics(server.url))

    async def stream(client, prompt, leave: asyncio.Event | None, started: asyncio.Event):
        body = {"model": NAME, "prompt": prompt, "max_tokens": 150, "temperature": 0, "stream": True}
        text = ""
        async with client.stream("POST", server.url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
                    started.set()
                    if leave is not None:
                        await leave.wait()
                        return None  # leaving the block closes the connection mid-answer
        return text

    def used_blocks() -> tuple[float, float]:
        m = metrics(server.url)
        return value(m, "vllm:num_requests_running"), round(value(m, "vllm:kv_cache_usage_perc") * num_blocks)

    async def run():
        leave = asyncio.Event()
        async with httpx.AsyncClient(timeout=120) as client:
            started = [asyncio.Event() for _ in prompts]
            tasks = [asyncio.create_task(stream(client, p, leave if i % 2 else None, started[i]))
                     for i, p in enumerate(prompts)]  # fmt: skip
            await asyncio.gather(*(s.wait() for s in started))
            busy = used_blocks()
            t0 = time.perf_counter()
            leave.set()
            while (now := used_blocks()) and (now[0] > 3 or now[1] > stayers_max) and time.perf_counter() - t0 < 6:
                await asyncio.sleep(0.01)
            return await asyncio.gather(*tasks), time.perf_counter() - t0, busy, now

    texts, freed_after, busy, now = asyncio.run(run())
    assert busy[0] == 6 and busy[1] > 3 * 19, busy
    assert freed_after < 5.0 and now[0] <= 3 and now[1] <= stayers_max, (freed_after, now)
    for i, text in enumerate(texts):
        if i % 2 == 0:  # the ones that stayed are unaffected
            assert text == offline(llm, prompts[i], max_tokens=150, temperature=0).outputs[0].text
    assert used_blocks() == (0, 0)
    assert aborted(metrics(server.url)) - aborted_before == 3  # the three that left, and only they


def test_a_non_streaming_client_that_gives_up_aborts_its_request(server, slow_steps):
    body = {"model": NAME, "prompt": "KENT:\n", "max_tokens": 480, "temperature": 0}  # 9.6 s at least
    before = metrics(server.url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
    t0 = time.perf_counter()
    while value(metrics(server.url), "vllm:num_requests_running") and time.perf_counter() - t0 < 6:
        time.sleep(0.01)
    assert time.perf_counter() - t0 < 5.0
    after = metrics(server.url)
    assert value(after, "vllm:kv_cache_usage_perc") == 0.0
    assert aborted(after) - aborted(before) == 1
    generated = value(after, "vllm:generation_tokens_total") - value(before, "vllm:generation_tokens_total")
    assert generated < 480  # stopped early, not finished
