"""Level 6: the OpenAI-compatible server, tested as users meet it.

What it is: a real uvicorn on a free localhost port (a background thread of this process,
so a test can reach into the engine), the official `openai` client, and httpx for raw
HTTP. The model is a small random-weight float64 checkpoint: equal texts then mean equal
tokens, not luck at a near-tie. It checks that

  - completions and chat, streamed and not, equal offline `LLM.generate` / `LLM.chat` at
    temperature 0; `n`, `seed`, `stop`, `logprobs` (streamed too, with each token's own bytes)
    and `echo` behave as offline; usage adds up;
  - a stream is framed exactly as OpenAI frames it (raw bytes checked);
  - 100 concurrent streaming clients get 0 errors, each the text of the same request run
    alone, and the Prometheus counters add up afterwards (KV usage back to idle);
  - a client that disconnects is aborted (the abort counter says so) and frees its blocks
    within a few seconds, the others are unaffected;
  - every bad input gets its status and OpenAI's error body, and the server stays healthy;
    a request bigger than the whole queue is a 400, a full queue a 503, even when empty;
    an exception inside one request is a 500 for that request only; an engine that cannot
    recover stops its loop and fails everything instead of spinning;
  - the concatenated stream deltas equal the one-shot decode of random byte outputs;
  - the command line (`python -m level6_serving`, a real process): a bad flag is one line,
    `--api-key` gives 401 (health and metrics open), a full queue gives 503 + Retry-After,
    SIGTERM lets the request in flight finish, aborts the one past the drain timeout, exit 0.

What it is not: a speed test (`python -m benchmarks.serving` measures; nothing here can
fail because of a number, except the generous deadlines for freeing a disconnected
client's blocks).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from level6_serving import LLM, AsyncLLMEngine, SamplingParams
from level6_serving.api_server import ServerThread, build_app
from level6_serving.async_engine import EngineDeadError, EngineStepError
from level6_serving.metrics import parse, value
from level6_serving.process import ServerProcess
from level6_serving.protocol import APIError
from level6_serving.serving import OpenAIServing, token_bytes

pytestmark = pytest.mark.level6

ENGINE = dict(dtype="float64", max_model_len=512, seed=0, kv_cache_memory=16 << 20)
NAME = "tiny"


@pytest.fixture(scope="module")
def ckpt(checkpoint_factory):
    return checkpoint_factory("llama", tokenizer=True)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), **ENGINE)


@pytest.fixture(scope="module")
def server(ckpt):
    engine = AsyncLLMEngine.from_engine_args(str(ckpt), **ENGINE)
    srv = ServerThread(build_app(engine, [NAME]))
    with srv as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        yield SimpleNamespace(url=url, engine=engine, client=client)
    assert not srv.thread.is_alive(), "the server thread outlived its test module"


def offline(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw), progress=False)[0]


def metrics(url: str) -> dict[str, float]:
    return parse(httpx.get(url + "/metrics").text)


def aborted(samples: dict[str, float]) -> float:
    """Requests the engine finished with finish_reason "abort", so far."""
    return sum(v for k, v in samples.items()
               if k.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in k)  # fmt: skip


@pytest.fixture
def slow_steps(server, monkeypatch):
    """Every engine step takes 10 ms more: a request of 150 tokens then runs for 1.5 s at
    least, so its client surely leaves before it ends, however fast the machine."""
    engine = server.engine.engine
    step = engine.step

    def slow_step():
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)


def events(body: str) -> list[str]:
    """Raw SSE body -> the data of each event; checks the framing on the way."""
    assert body.endswith("\n\n"), "every event ends with a blank line"
    chunks = body[:-2].split("\n\n")
    assert all(c.startswith("data: ") and "\n" not in c for c in chunks), chunks
    return [c[len("data: ") :] for c in chunks]


# --- completions and chat equal offline generate --------------------------------------------------
@pytest.mark.parametrize("prompt", ["ROMEO:\n", [5, 77, 3, 200, 42]], ids=["text", "token-ids"])
def test_completion_streamed_equals_unstreamed_equals_offline(server, llm, prompt):
    want = offline(llm, prompt, max_tokens=24, temperature=0)
    one = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0)
    chunks = list(server.client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))  # fmt: skip
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert one.choices[0].text == streamed == want.outputs[0].text
    assert one.choices[0].finish_reason == want.outputs[0].finish_reason == "length"
    content, last = [c for c in chunks if c.choices], chunks[-1]
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + ["length"]
    assert last.choices == [] and last.usage is not None
    for u in (one.usage, last.usage):
        assert (u.prompt_tokens, u.completion_tokens) == (len(want.prompt_token_ids), 24)
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_chat_streamed_equals_unstreamed_equals_offline_chat(server, llm):
    messages = [{"role": "system", "content": "Speak verse."}, {"role": "user", "content": "Who art thou?"}]
    want = llm.chat(messages, SamplingParams(max_tokens=20, temperature=0))[0]
    one = server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0)
    chunks = list(server.client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=20,
                                                        temperature=0, stream=True))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant" and not chunks[0].choices[0].delta.content
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert one.choices[0].message.content == streamed == want.outputs[0].text
    assert one.usage.prompt_tokens == len(want.prompt_token_ids) and one.usage.completion_tokens == 20
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_is_framed_as_openai_frames_it(server, path):
    body = {"model": NAME, "max_tokens": 12, "temperature": 0, "stream": True, "n": 2,
            "stream_options": {"include_usage": True}}  # fmt: skip
    body.update({"prompt": "JULIET:\n"} if "chat" not in path else {"messages": [{"role": "user", "content": "Hi"}]})
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read()
    assert raw.isascii()  # JSON escapes: no generated U+2028 can pass for a line break
    data = events(raw.decode())
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    usage = chunks.pop()
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 2 * 12
    assert all(c["usage"] is None and c["id"] == usage["id"] for c in chunks)
    obj = "chat.completion.chunk" if "chat" in path else "text_completion"
    assert {c["object"] for c in chunks} == {obj}
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        if "chat" in path:
            assert mine[0]["delta"] == {"role": "assistant", "content": ""}  # the role chunk first
            assert all("role" not in ch["delta"] for ch in mine[1:])
        assert [ch["finish_reason"] for ch in mine] == [None] * (len(mine) - 1) + ["length"]


# --- n, seed, stop, logprobs, echo, several prompts ----------------------------------------------
def test_n_and_seed_sample_as_offline(server, llm):
    kw = dict(n=3, temperature=1.0, seed=1234, max_tokens=12)
    want = [o.text for o in offline(llm, "HAMLET:\n", **kw).outputs]
    one = server.client.completions.create(model=NAME, prompt="HAMLET:\n", **kw)
    streamed = ["", "", ""]
    for c in server.client.completions.create(model=NAME, prompt="HAMLET:\n", stream=True, **kw):
        streamed[c.choices[0].index] += c.choices[0].text
    assert [c.text for c in one.choices] == streamed == want
    assert len(set(want)) > 1, "three seeded samples should differ (else this test proves little)"


def test_stop_as_offline(server, llm):
    free = offline(llm, "ROMEO:\n", max_tokens=40, temperature=0).outputs[0].text
    stop = free[10:12]
    want = offline(llm, "ROMEO:\n", max_tokens=40, temperature=0, stop=[stop]).outputs[0]
    got = server.client.completions.create(model=NAME, prompt="ROMEO:\n", max_tokens=40, temperature=0, stop=stop)
    streamed = "".join(c.choices[0].text for c in server.client.completions.create(
        model=NAME, prompt="ROMEO:\n", max_tokens=40, temperature=0, stop=[stop], stream=True))  # fmt: skip
    assert got.choices[0].text == streamed == want.text and len(want.text) < len(free)
    assert got.choices[0].finish_reason == "stop" and got.choices[0].model_extra["stop_reason"] == stop


def test_logprobs_as_offline(server, llm):
    want = offline(llm, "ROMEO:\n", max_tokens=8, temperature=0, logprobs=3).outputs[0]
    got = server.client.completions.create(model=NAME, prompt="ROMEO:\n", max_tokens=8, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    chosen = [entry[t] for t, entry in zip(want.token_ids, want.logprobs)]
    assert lp.token_logprobs == pytest.approx([c.logprob for c in chosen], abs=1e-9)
    assert lp.tokens == [c.decoded_token for c in chosen]
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    chat = server.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 for c in content)
    for c in content:  # greedy: the chosen token is the most likely one
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert (c.token, c.logprob) == (c.top_logprobs[0].token, c.top_logprobs[0].logprob)


def test_streamed_logprobs_equal_the_unstreamed_and_offline_ones(server, llm):
    kw = dict(model=NAME, prompt="ROMEO:\n", max_tokens=12, temperature=0, logprobs=3)
    want = offline(llm, "ROMEO:\n", max_tokens=12, temperature=0, logprobs=3).outputs[0]
    one = server.client.completions.create(**kw).choices[0].logprobs
    got = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in server.client.completions.create(stream=True, **kw):
        for key in got:
            got[key] += getattr(chunk.choices[0].logprobs, key) if chunk.choices[0].logprobs else []
    chosen = [entry[t] for t, entry in zip(want.token_ids, want.logprobs)]
    assert got["tokens"] == one.tokens == [c.decoded_token for c in chosen]
    assert got["token_logprobs"] == pytest.approx(one.token_logprobs, abs=1e-9)
    assert got["token_logprobs"] == pytest.approx([c.logprob for c in chosen], abs=1e-9)
    assert got["text_offset"] == one.text_offset  # counted from the choice's start, across chunks
    assert [list(t) for t in got["top_logprobs"]] == [list(t) for t in one.top_logprobs]
    assert [list(t.values()) for t in got["top_logprobs"]] == [
        pytest.approx(list(t.values()), abs=1e-9) for t in one.top_logprobs]  # fmt: skip

    # chat, at temperature 1 from "€": random bytes, some of them one byte of a character
    messages = [{"role": "user", "content": "€"}]
    kw = dict(model=NAME, messages=messages, max_tokens=24, temperature=1.0, seed=3, logprobs=True, top_logprobs=2)
    want = llm.chat(messages, SamplingParams(max_tokens=24, temperature=1.0, seed=3, logprobs=2))[0].outputs[0]
    one = server.client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [c for chunk in server.client.chat.completions.create(stream=True, **kw)
                if chunk.choices and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]  # fmt: skip
    chosen = [entry[t] for t, entry in zip(want.token_ids, want.logprobs)]
    assert [c.token for c in streamed] == [c.token for c in one] == [c.decoded_token for c in chosen]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in one], abs=1e-9)
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in chosen], abs=1e-9)
    assert [[t.token for t in c.top_logprobs] for c in streamed] == [[t.token for t in c.top_logprobs] for c in one]
    # the vocabulary's ids 0..255 are the byte values: each token's own bytes, not U+FFFD's
    own = [[t] if t < 256 else list(c.decoded_token.encode()) for t, c in zip(want.token_ids, chosen)]
    assert [c.bytes for c in streamed] == [c.bytes for c in one] == own
    assert any("\ufffd" in c.token for c in one), "no partial character: this proves little about bytes"


def test_token_bytes_are_the_tokens_own(llm):
    tok = llm.get_tokenizer()
    ids = tok("€A")["input_ids"]
    assert b"".join(token_bytes(tok, t, tok.decode([t])) for t in ids) == "€A".encode()
    sentencepiece = SimpleNamespace(convert_ids_to_tokens=lambda t: {7: "<0xE2>", 8: "▁the"}[t])
    assert token_bytes(sentencepiece, 7, "\ufffd") == b"\xe2"  # the byte fallback
    assert token_bytes(sentencepiece, 8, " the") == b" the"


def test_echo_and_several_prompts(server, llm):
    prompts = ["ROMEO:\n", "JULIET:\n"]
    got = server.client.completions.create(model=NAME, prompt=prompts, n=2, max_tokens=6, temperature=0, echo=True)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    for c in got.choices:
        p = prompts[c.index // 2]
        assert c.text == p + offline(llm, p, max_tokens=6, temperature=0).outputs[0].text
    assert got.usage.completion_tokens == 4 * 6


# --- many clients at once ------------------------------------------------------------------------
def test_100_concurrent_streams_equal_their_solo_runs_and_counters_add_up(server, llm):
    cases = [(f"{'ABCDEFGHIJ'[i % 10]}{i}: speak\n", 8 + (i % 5) * 4) for i in range(20)]
    requests = [cases[i % 20] for i in range(100)]
    alone = {c: offline(llm, c[0], max_tokens=c[1], temperature=0).outputs[0].text for c in cases}
    before = metrics(server.url)

    async def one(client, prompt, max_tokens):
        text, usage = "", None
        stream = await client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})  # fmt: skip
        async for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
            usage = chunk.usage or usage
        return text, usage.completion_tokens

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, p, m) for p, m in requests), return_exceptions=True)

    results = asyncio.run(run())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} of 100 streams failed, e.g. {errors[0]!r}"
    assert [text for text, _ in results] == [alone[c] for c in requests]
    after = metrics(server.url)
    generated = value(after, "vllm:generation_tokens_total") - value(before, "vllm:generation_tokens_total")
    assert generated == sum(n for _, n in results) == sum(m for _, m in requests)
    assert value(after, "vllm:num_requests_running") == 0 and value(after, "vllm:num_requests_waiting") == 0
    assert value(after, "vllm:kv_cache_usage_perc") == 0.0  # idle: every block back (cached ones are free)
    assert value(after, "vllm:request_success_total") - value(before, "vllm:request_success_total") == 100


# --- disconnects ---------------------------------------------------------------------------------
def test_disconnected_clients_are_aborted_and_free_their_blocks(server, llm, slow_steps):
    """Three clients with short prompts stay; three with ~300-token prompts (19 blocks each)
    leave after their first chunk. Within a few seconds only the stayers' blocks may be in
    use, and the three that left were aborted (not finished: the steps are slowed down)."""
    names = ("KENT", "LEAR", "EDGAR", "REGAN", "GONERIL", "FOOL")
    prompts = [f"{n}:\n" if i % 2 == 0 else f"{n}: " + "the king is mad, " * 18 for i, n in enumerate(names)]
    num_blocks, block = server.engine.engine.num_blocks, server.engine.engine.config.block_size
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
    body = {"model": NAME, "prompt": "KENT:\n", "max_tokens": 480, "temperature": 0}  # 4.8 s at least
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


# --- bad input -----------------------------------------------------------------------------------
BAD = [  # (path, raw body, status, the param the error names)
    ("/v1/completions", "{not json", 400, None),
    ("/v1/completions", '["a", "list"]', 400, None),
    ("/v1/completions", '{"max_tokens": 5}', 400, "prompt"),
    ("/v1/completions", '{"prompt": 5}', 400, "prompt"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": "5"}', 400, "max_tokens"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": -3}', 400, "max_tokens"),
    ("/v1/completions", '{"prompt": "x", "temperature": -0.5}', 400, "temperature"),
    ("/v1/completions", '{"prompt": "x", "top_p": 0}', 400, "top_p"),
    ("/v1/completions", '{"prompt": "x", "stream": "yes"}', 400, "stream"),
    ("/v1/completions", '{"prompt": "x", "n": 100000}', 400, "n"),
    ("/v1/completions", '{"prompt": "x", "n": 0}', 400, "n"),
    ("/v1/completions", '{"prompt": "x", "stop": [""]}', 400, "stop"),
    ("/v1/completions", '{"prompt": "x", "logprobs": 99}', 400, "logprobs"),
    ("/v1/completions", '{"prompt": "x", "echo": true, "logprobs": 1}', 400, "echo"),
    ("/v1/completions", '{"prompt": "x", "frobnicate": 1}', 400, "frobnicate"),
    ("/v1/completions", '{"prompt": "x", "temperature": Infinity}', 400, "temperature"),
    ("/v1/completions", '{"prompt": "x", "temperature": 1e308}', 400, "temperature"),  # inf in float32
    ("/v1/completions", '{"prompt": "x", "top_p": NaN}', 400, "top_p"),
    ("/v1/completions", '{"prompt": "x", "presence_penalty": -Infinity}', 400, "presence_penalty"),
    ("/v1/completions", '{"prompt": "x", "repetition_penalty": 1e-40}', 400, "repetition_penalty"),  # overflows
    ("/v1/completions", '{"prompt": "x", "seed": 1180591620717411303424}', 400, "seed"),  # 2**70
    ("/v1/completions", '{"prompt": "x", "max_tokens": 101.5}', 400, "max_tokens"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": true}', 400, "max_tokens"),
    ("/v1/completions", '{"prompt": "x", "use_beam_search": true}', 400, "use_beam_search"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
     400, "tools"),
    ("/v1/chat/completions", '{"messages": [{"role": "assistant", "tool_calls": [{"id": "1"}]}]}', 400,
     "messages.0.tool_calls"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "modalities": ["audio"]}', 400,
     "modalities"),
    ("/v1/completions", '{"prompt": "x", "logit_bias": {"5": 10}}', 400, "logit_bias"),
    ("/v1/completions", '{"prompt": "x", "stream_options": {"include_usage": true}}', 400, "stream_options"),
    ("/v1/completions", '{"prompt": ""}', 400, "prompt"),
    ("/v1/completions", '{"prompt": [1, 99999]}', 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": "x" * 600}), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": "x" * 500, "max_tokens": 100}), 400, "max_tokens"),
    ("/v1/completions", '{"prompt": "x", "model": "gpt-4o"}', 404, "model"),
    ("/v1/completions", json.dumps({"prompt": ["x"] * 1025}), 400, "prompt"),  # more than --max-num-waiting
    ("/v1/completions", json.dumps({"prompt": ["x"] * 5, "n": 250}), 400, "prompt"),
    ("/v1/chat/completions", '{"messages": []}', 400, "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "wizard", "content": "x"}]}', 400, "messages.0.role"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', 400, "top_logprobs"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}', 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x" * 600}]}), 400, "messages"),
    ("/detokenize", '{"tokens": [-1]}', 400, "tokens"),
    ("/v1/nothing", "{}", 404, None),
]  # fmt: skip


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}:{b[:40]}" for i, (_, b, _, _) in enumerate(BAD)])
def test_bad_input_gets_its_status_and_an_openai_error(server, path, body, status, param):
    r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_message_names_the_field_without_pydantic_noise(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "seed": 2**70})
    assert r.json()["error"]["message"] == "seed=1180591620717411303424 must be an integer in [-2**63, 2**63) (or None)"
    r = httpx.post(server.url + "/v1/completions", content='{"prompt": "x", "temperature": 1e308}')
    assert r.json()["error"]["message"].startswith("temperature: must be a finite number, within float32's range")


def test_the_spec_s_nullable_and_numeric_forms_and_vllm_s_extras_are_accepted(server, llm):
    """What OpenAI's schema allows (null for any optional field, 101.0 for an integer) and what
    benchmark clients send (vLLM's fields, stream_options they know) is a 200, not a 400."""
    want = offline(llm, "ROMEO:\n", max_tokens=6, temperature=0).outputs[0].text
    body = {"prompt": "ROMEO:\n", "max_tokens": 6.0, "temperature": 0, "stream": None, "n": None, "echo": None,
            "best_of": None, "logprobs": None, "seed": None, "stop": None, "suffix": None, "user": "u1",
            "presence_penalty": None, "frequency_penalty": None, "logit_bias": None, "top_p": None,
            "ignore_eos": None, "min_tokens": None, "top_k": None, "repetition_penalty": None, "priority": 0,
            "store": False, "metadata": {"k": "v"}, "service_tier": "auto"}  # fmt: skip
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
    chat = {"messages": [{"role": "user", "content": "Hi", "name": None},
                         {"role": "assistant", "content": None, "refusal": "I cannot", "tool_calls": None},
                         {"role": "user", "content": [{"type": "text", "text": "Again"}]}],
            "max_completion_tokens": 4.0, "stream": None, "logprobs": None, "top_logprobs": None, "tools": None,
            "tool_choice": None, "parallel_tool_calls": None, "response_format": {"type": "text"},
            "modalities": ["text"], "reasoning_effort": "low", "prediction": None, "audio": None}  # fmt: skip
    r = httpx.post(server.url + "/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["refusal"] is None  # OpenAI's schema requires the key


def test_a_tiny_temperature_is_clamped_not_a_nan_that_fails_the_batch(server, llm):
    """1e-38 would make logits / t overflow to inf and the draw NaN, failing every request in the
    batch; it is clamped to 0.01 (as vLLM does), sharper than any near-tie here: greedy's text."""
    want = offline(llm, "ROMEO:\n", max_tokens=8, temperature=0).outputs[0].text
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": "KENT:\n", "max_tokens": 30, "stream": True}) as other:  # fmt: skip
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "ROMEO:\n", "max_tokens": 8,
                                                             "temperature": 1e-38, "seed": 3}, timeout=60)  # fmt: skip
        data = events(other.read().decode())
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
    assert json.loads(data[-2])["choices"][0]["finish_reason"] == "length"  # the neighbour was not failed


def test_every_ignored_field_is_accepted_and_documented():
    """protocol.IGNORED (the fields accepted with no effect, with why) names real request fields,
    and docs/level6_serving.md's fields table lists every one of them."""
    from level6_serving.protocol import IGNORED, ChatCompletionRequest, CompletionRequest

    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    assert set(IGNORED) <= fields, set(IGNORED) - fields
    doc = (Path(__file__).resolve().parent.parent / "docs" / "level6_serving.md").read_text()
    ignored_row = next(line for line in doc.splitlines() if line.startswith("| accepted and ignored"))
    assert all(f"`{name}`" in ignored_row for name in IGNORED), [n for n in IGNORED if f"`{n}`" not in ignored_row]


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server):
    body = {
        "prompt": "ROMEO:\n",
        "max_tokens": 8,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"continuous_usage_stats": True, "include_usage": True, "include_obfuscation": True},
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        chunks = [json.loads(d) for d in events(r.read().decode())[:-1]]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 8 and chunks[-1]["choices"] == []  # the usage chunk last
    assert all(c["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] for c in chunks)


def test_the_queue_is_bounded_even_when_nothing_waits():
    engine = SimpleNamespace(is_running=True, dead=None, num_waiting=0)
    serving = OpenAIServing(engine, [NAME], max_num_waiting=4, max_n=8)
    serving.check_size(4, 1)
    serving.admit(4)  # fits the empty queue alone: admitted
    for n, prompts, param in ((5, 1, "n"), (1, 5, "prompt"), (2, 3, "prompt")):
        with pytest.raises(APIError) as e:  # could never fit: 400, not "retry later"
            serving.check_size(n, prompts)
        assert (e.value.status, e.value.param) == (400, param)
    engine.num_waiting = 1
    serving.admit(3)
    with pytest.raises(APIError) as e:
        serving.admit(4)
    assert e.value.status == 503 and e.value.headers == {"Retry-After": "1"}


def test_the_openai_client_reads_our_errors(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=NAME, prompt="x", max_tokens=0)
    assert e.value.param == "max_tokens" and "max_tokens" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        server.client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found"


def test_an_exception_inside_one_request_is_a_500_for_it_only(server, monkeypatch):
    engine = server.engine.engine
    add = engine.add_request

    def add_or_fail(request_id, prompt, params=None, priority=0, **kw):
        if params.max_tokens == 13:
            raise RuntimeError("boom in add_request")
        return add(request_id, prompt, params, priority, **kw)

    monkeypatch.setattr(engine, "add_request", add_or_fail)
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": "KENT:\n", "max_tokens": 40, "temperature": 0, "stream": True}) as other:  # fmt: skip
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 13})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error" and "boom" in r.text
        data = events(other.read().decode())
    assert data[-1] == "[DONE]" and json.loads(data[-2])["choices"][0]["finish_reason"] == "length"

    step, armed = engine.step, [True]

    def step_fails_once():
        if armed[0] and engine.has_unfinished_requests():
            armed[0] = False
            raise RuntimeError("boom in step")
        return step()

    monkeypatch.setattr(engine, "step", step_fails_once)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5}, timeout=60)
    assert r.status_code == 500 and "boom in step" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200  # recovered: every block came back
    ok = server.client.completions.create(model=NAME, prompt="x", max_tokens=5)
    assert ok.choices[0].finish_reason == "length"


def test_an_engine_that_cannot_recover_stops_its_loop_and_fails_everything(ckpt, monkeypatch):
    """step() raises, and so does the flush in the recovery: the engine is dead. Its loop must
    end (not step, fail and recover forever) and answer every stream and later request."""
    calls = []

    def step_always_fails():
        calls.append(1)
        raise RuntimeError("boom, always")

    async def run():
        engine = AsyncLLMEngine.from_engine_args(str(ckpt), **ENGINE)
        monkeypatch.setattr(engine.engine, "step", step_always_fails)
        engine.start()
        try:
            stream = await engine.add_request("r", "KENT:\n", SamplingParams(max_tokens=5))
            with pytest.raises(EngineStepError):
                await asyncio.wait_for(stream.get(), 30)
            await asyncio.to_thread(engine._thread.join, 30)
            assert not engine._thread.is_alive() and engine.dead is not None and not engine.is_running
            with pytest.raises(EngineDeadError):
                await engine.add_request("s", "KENT:\n", SamplingParams(max_tokens=5))
        finally:
            await engine.shutdown()

    asyncio.run(run())
    assert len(calls) == 2  # the failed step and the failed flush, then nothing more


# --- streams never split a character ---------------------------------------------------------------
@settings(max_examples=12)
@given(seed=st.integers(0, 2**31 - 1), max_tokens=st.integers(1, 40), prompt=st.sampled_from(["€", "Ω:\n", "x"]))
def test_stream_deltas_concatenate_to_the_one_shot_decode(server, llm, seed, max_tokens, prompt):
    """Random weights at temperature 1 emit random bytes: invalid UTF-8, and multi-byte
    characters whose bytes arrive in different steps."""
    want = offline(llm, prompt, max_tokens=max_tokens, temperature=1.0, seed=seed).outputs[0]
    one_shot = llm.get_tokenizer().decode(want.token_ids, skip_special_tokens=True)
    deltas = [c.choices[0].text for c in server.client.completions.create(
        model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=1.0, seed=seed, stream=True)]  # fmt: skip
    assert "".join(deltas) == one_shot


def test_random_bytes_do_include_multibyte_characters(llm):
    """The property above means something only if such outputs occur: find one at fixed seeds."""
    texts = [offline(llm, "€", max_tokens=40, temperature=1.0, seed=s).outputs[0].text for s in range(8)]
    assert any(ord(ch) > 0x7F and ch != "\ufffd" for t in texts for ch in t)
    assert any("\ufffd" in t for t in texts)  # and bytes that never became a character


# --- the other routes -------------------------------------------------------------------------------
def test_models_tokenize_detokenize_version_health(server, llm):
    models = server.client.models.list()
    assert [m.id for m in models.data] == [NAME]
    tok = httpx.post(server.url + "/tokenize", json={"prompt": "ROMEO"}).json()
    assert tok["tokens"] == llm.get_tokenizer()("ROMEO")["input_ids"] and tok["count"] == len(tok["tokens"])
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"] == llm.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": "ROMEO"}
    assert httpx.get(server.url + "/version").json()["version"]
    assert httpx.get(server.url + "/health").status_code == 200
    text = httpx.get(server.url + "/metrics").text
    for name, kind in [("vllm:num_requests_running", "gauge"), ("vllm:kv_cache_usage_perc", "gauge"),
                       ("vllm:prompt_tokens_total", "counter"), ("vllm:prefix_cache_hits_total", "counter"),
                       ("vllm:spec_decode_num_drafts_total", "counter"),
                       ("vllm:time_to_first_token_seconds", "histogram"),
                       ("vllm:e2e_request_latency_seconds", "histogram")]:  # fmt: skip
        assert f"# TYPE {name} {kind}" in text


# --- the command line: a real process ----------------------------------------------------------------
@pytest.mark.parametrize("args,flag", [
    (["--port", "70000"], "--port"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size"),
    (["--pipeline-parallel-size", "0"], "--pipeline-parallel-size"),
    (["--speculative-config", "{oops"], "--speculative-config"),
    (["--speculative-config", '{"num_speculative_tokens": 0, "method": "ngram"}'], "--speculative-config"),
    (["--model", "no/such/model"], "--model"),
    (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
    (["--max-num-waiting", "0"], "--max-num-waiting"),
])  # fmt: skip
def test_a_bad_flag_is_one_line_that_names_it(args, flag, capsys):
    from level6_serving.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and flag in err[0], err


def test_parallel_sizes_are_refused_in_one_line_by_an_engine_without_them(monkeypatch, capsys):
    """Serving a one-device engine (base.py switched to level 4's), TP/PP > 1 is a clear error."""
    import level4_speculative
    import level6_serving.base
    from level6_serving.__main__ import main

    monkeypatch.setattr(level6_serving.base, "LLMEngine", level4_speculative.LLMEngine)
    for flag in ("--tensor-parallel-size", "--pipeline-parallel-size"):
        with pytest.raises(SystemExit) as e:
            main([flag, "2"])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and flag in err[0] and "level4_speculative" in err[0], err


def test_tensor_parallel_server_gives_the_offline_text(ckpt, llm):
    """--tensor-parallel-size 2: two ranks (gloo) behind the same HTTP API, the same greedy tokens."""
    flags = ["--model", str(ckpt), "--tensor-parallel-size", "2", "--dtype", "float64", "--max-model-len", "512",
             "--kv-cache-memory", "16MiB", "--disable-uvicorn-access-log"]  # fmt: skip
    with ServerProcess(flags) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
        stream = client.completions.create(
            model=str(ckpt), prompt="ROMEO:\n", max_tokens=24, temperature=0, stream=True
        )
        text = "".join(c.choices[0].text for c in stream)
        assert "level5_multigpu" in server.tail()
        assert "ladder:comm_calls_total" in httpx.get(server.url + "/metrics").text  # the ranks' messages
    assert text == offline(llm, "ROMEO:\n", max_tokens=24, temperature=0).outputs[0].text
    assert server.returncode == 0


def test_server_process_api_key_backpressure_and_sigterm_drain(checkpoint_factory, tmp_path):
    model = checkpoint_factory("llama", tokenizer=True, max_position_embeddings=2048)
    flags = ["--model", str(model), "--api-key", "sk-test", "--dtype", "float32", "--max-num-seqs", "2",
             "--max-num-waiting", "1", "--drain-timeout", "1.5", "--kv-cache-memory", "64MiB",
             "--disable-uvicorn-access-log"]  # fmt: skip
    with ServerProcess(flags, log=tmp_path / "server.log") as server:
        asyncio.run(drive_process(server, str(model)))  # ends with SIGTERM
        assert server.proc.wait(timeout=30) == 0, server.tail()
        assert "drained (1 requests aborted at the deadline)" in server.tail()


async def drive_process(server: ServerProcess, model: str) -> None:
    url, key = server.url, {"Authorization": "Bearer sk-test"}
    body = lambda n: {"prompt": "KENT:\n", "max_tokens": n, "ignore_eos": True, "stream": True}  # noqa: E731

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        # 401 without the key or with a wrong one; /health and /metrics stay open
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = await client.post("/v1/completions", json=body(5), headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert (await client.get("/v1/models")).status_code == 401
        assert (await client.get("/health")).status_code == 200 and (await client.get("/metrics")).status_code == 200
        assert (await client.get("/v1/models", headers=key)).json()["data"][0]["id"] == model

        async def stream(n: int, first: asyncio.Event | None = None) -> tuple[list, str]:
            texts, events_ = [], []
            async with client.stream("POST", "/v1/completions", json=body(n), headers=key) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events_.append(line[6:])
                        if first is not None:
                            first.set()
            texts = [json.loads(e)["choices"][0] for e in events_[:-1]]
            return texts, events_[-1]

        async def waiting_is(n: int) -> None:
            while value(parse((await client.get("/metrics")).text), "vllm:num_requests_waiting") != n:
                await asyncio.sleep(0.02)

        # both seats taken, one waiting: the next one is refused with 503 + Retry-After. (One at a
        # time: a request counts as waiting until it is scheduled, so two at once would be one too many.)
        a_first, b_first = asyncio.Event(), asyncio.Event()
        long_a = asyncio.create_task(stream(1900, a_first))
        await asyncio.wait_for(a_first.wait(), 30)
        long_b = asyncio.create_task(stream(1900, b_first))
        await asyncio.wait_for(b_first.wait(), 30)
        queued = asyncio.create_task(stream(5))
        await asyncio.wait_for(waiting_is(1), 30)
        r = await client.post("/v1/completions", json=body(5), headers=key)
        assert r.status_code == 503 and "Retry-After" in r.headers and r.json()["error"]["message"]
        queued.cancel()
        long_b.cancel()
        await asyncio.gather(queued, long_b, return_exceptions=True)
        await asyncio.wait_for(waiting_is(0), 30)  # the queued one is aborted when its client leaves

        # SIGTERM while a short request is in flight: it finishes; the long one is aborted at the deadline
        c_first = asyncio.Event()
        short = asyncio.create_task(stream(60, c_first))
        await asyncio.wait_for(c_first.wait(), 30)
        server.signal(signal.SIGTERM)
        (short_chunks, short_end), (long_chunks, long_end) = await asyncio.wait_for(asyncio.gather(short, long_a), 30)
        assert short_end == long_end == "[DONE]"
        assert short_chunks[-1]["finish_reason"] == "length" and long_chunks[-1]["finish_reason"] == "abort"
        with pytest.raises(httpx.TransportError):  # not accepting any more
            await client.post("/v1/completions", json=body(5), headers=key)


# --- the demo and the benchmark client ------------------------------------------------------------------
def test_demo_runs_and_leaves_nothing_behind(ckpt, tmp_path, capsys):
    from level6_serving import demo

    plot = tmp_path / "streams.png"
    res = demo.main(["--model", str(ckpt), "--clients", "4", "--max-tokens", "12", "--plot", str(plot)])
    out = capsys.readouterr().out
    assert res["exit_code"] == 0 and "exit status 0" in out
    assert res["tokens"] > 0 and res["freed_seconds"] < 1.0 and res["kv_after_abort"] == 0.0
    assert res["generation_tokens_counted"] >= res["tokens"]
    assert plot.stat().st_size > 10_000


def test_benchmark_client_against_a_running_server(server, tmp_path):
    from benchmarks import serving

    out = tmp_path / "bench.json"
    data = serving.main(["--base-url", server.url, "--model", NAME, "--workload", "uniform", "--quick",
                         "--num-prompts", "6", "--request-rate", "50", "--goodput", "ttft:60000", "tpot:60000",
                         "--out", str(out)])  # fmt: skip
    run = json.loads(out.read_text())["run"]
    assert run == json.loads(json.dumps(data["run"]))
    assert (run["completed"], run["failed"], run["output_tokens"]) == (6, 0, 6 * 16)  # exact lengths
    assert run["goodput"] == pytest.approx(run["request_throughput"])  # generous SLOs: every request is good
    for key in ("median_ttft_ms", "p99_itl_ms", "mean_tpot_ms", "p90_e2el_ms"):
        assert run[key] > 0


@pytest.mark.parametrize("args,flag", [
    (["--request-rate", "0"], "--request-rate"),
    (["--goodput", "ttft"], "--goodput"),
    (["--configs", "cache,warp"], "--configs"),
    (["--base-url", "localhost:8000"], "--base-url"),
    (["--percentiles", "50,100"], "--percentiles"),
    (["--workload", "chat"], "--workload"),
    (["--model", "no/such/model"], "--model"),
])  # fmt: skip
def test_benchmark_refuses_a_bad_flag_in_one_line(args, flag, capsys):
    from benchmarks import serving

    with pytest.raises(SystemExit) as e:
        serving.main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and flag in err[0], err
