"""Level 6: the OpenAI-compatible server, tested as users meet it: what it answers.

What it is: a real uvicorn on a free localhost port (a background thread of this process,
so a test can reach into the engine; `server` in conftest.py), the official `openai`
client, and httpx for raw HTTP. The model is a small random-weight float64 checkpoint:
equal texts then mean equal tokens, not luck at a near-tie. It checks that

  - completions and chat, streamed and not, equal offline `LLM.generate` / `LLM.chat` at
    temperature 0; `n`, `seed`, `stop`, `logprobs` (streamed too, with each token's own bytes)
    and `echo` behave as offline; usage adds up;
  - a stream is framed exactly as OpenAI frames it (raw bytes checked);
  - 100 concurrent streaming clients get 0 errors, each the text of the same request run
    alone, and the Prometheus counters add up afterwards (KV usage back to idle);
  - the concatenated stream deltas equal the one-shot decode of random byte outputs;
  - the other routes (models, tokenize, detokenize, version, health, metrics) answer.

The rest of level 6's tests, by topic: test_level6_disconnects.py (clients that leave are
aborted and free their blocks), test_level6_errors.py (bad input, the spec's other forms,
failures inside the server), test_level6_cli.py (`python -m level6_serving` as a real
process, the demo, the benchmark client), test_level6_limits.py (hostile input, dead ranks),
test_level6_clients.py (guidellm, the SDK's nulls, a schema fuzzer). labs/lab6.toml runs
some of the tests here by name.

What it is not: a speed test (`python -m benchmarks.serving` measures; nothing here can
fail because of a number).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from level6_helpers import NAME, metrics, offline, sse_events

from level6_serving import SamplingParams
from level6_serving.metrics import value
from level6_serving.serving import token_bytes

pytestmark = pytest.mark.level6


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
    data = sse_events(raw.decode())
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


def test_echo_with_logprobs_gives_the_prompt_its_logprobs(server, llm):
    """OpenAI's echo + logprobs, and vLLM's prompt_logprobs: the echoed tokens open the logprobs (the first
    null), their values the offline engine's prompt logprobs; streamed, the chunks add up to the answer."""
    prompt = "ROMEO:\nBut soft"
    want = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, logprobs=2, prompt_logprobs=2),
                        progress=False)[0]  # fmt: skip
    P = len(want.prompt_token_ids)
    got = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                           logprobs=2)  # fmt: skip
    c = got.choices[0]
    assert c.text == prompt + want.outputs[0].text
    lp = c.logprobs
    assert len(lp.tokens) == P + 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:P] == [d[t].logprob for d, t in zip(want.prompt_logprobs[1:], want.prompt_token_ids[1:])]
    assert lp.token_logprobs[P:] == [d[t].logprob for d, t in zip(want.outputs[0].logprobs, want.outputs[0].token_ids)]
    assert "".join(lp.tokens) == c.text and lp.text_offset[P] == len(prompt)
    text, tokens = "", []
    for chunk in server.client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                                  logprobs=2, stream=True):  # fmt: skip
        text += chunk.choices[0].text
        tokens += chunk.choices[0].logprobs.tokens if chunk.choices[0].logprobs else []
    assert text == c.text and tokens == lp.tokens
    vllm_style = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=0,
                                                  extra_body={"prompt_logprobs": 1})  # fmt: skip
    plp = vllm_style.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == P
    assert all(d[str(t)]["logprob"] == want.prompt_logprobs[i][t].logprob
               for i, (d, t) in enumerate(zip(plp, want.prompt_token_ids)) if d)  # fmt: skip


# --- structured outputs --------------------------------------------------------------------------
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Verona", "Mantua"]}}, "required": ["city"],
    "additionalProperties": False}}}]  # fmt: skip


def test_response_format_and_vllms_guided_fields_constrain_the_output(server):
    """OpenAI's response_format (json_schema, json_object) through the openai client, and vLLM's guided_* in the
    body (the seeds' form); a schema the engine cannot compile is a 400 naming response_format."""
    import jsonschema

    chat = lambda **kw: server.client.chat.completions.create(  # noqa: E731
        model=NAME, messages=[{"role": "user", "content": "Who art thou?"}], temperature=0, **{"max_tokens": 80, **kw})
    got = chat(response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert got.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(got.choices[0].message.content), PERSON)
    obj = chat(response_format={"type": "json_object"}, max_tokens=200)
    assert obj.choices[0].finish_reason != "stop" or isinstance(json.loads(obj.choices[0].message.content), dict)
    for body, ok in ((("guided_choice", ["yes", "no"])), lambda t: t in ("yes", "no")), \
                    ((("guided_regex", r"[0-9]{2}-[a-z]{3}")), lambda t: len(t) == 6 and t[2] == "-"), \
                    ((("guided_json", PERSON)), lambda t: jsonschema.validate(json.loads(t), PERSON) is None):  # fmt: skip
        text = server.client.completions.create(model=NAME, prompt="x", max_tokens=60, temperature=0,
                                                extra_body=dict([body])).choices[0].text  # fmt: skip
        assert ok(text), (body[0], text)
    with pytest.raises(openai.BadRequestError) as bad:
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert bad.value.body["param"] == "response_format" and "nonsense" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError) as two:
        chat(response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"})
    assert two.value.body["param"] == "guided_regex"


def test_tool_choice_makes_a_constrained_tool_call(server):
    """A named function: its arguments follow its parameters' schema; "required": a list of calls (streamed
    tool calls: tests/test_level6_gaps.py)."""
    got = server.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "weather?"}],
                                                max_tokens=60, temperature=0, tools=WEATHER,
                                                tool_choice={"type": "function", "function": {"name": "get_weather"}})  # fmt: skip
    call = got.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Verona", "Mantua")
    assert got.choices[0].message.content is None and got.choices[0].finish_reason == "stop"
    many = server.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "weather?"}],
                                                 max_tokens=400, temperature=0, tools=WEATHER, tool_choice="required")  # fmt: skip
    c = many.choices[0]
    assert c.finish_reason == "length" or (c.finish_reason == "tool_calls" and c.message.tool_calls
                                           and all(t.function.name == "get_weather" for t in c.message.tool_calls))  # fmt: skip


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


# --- --stream-interval: fewer events, the same text --------------------------------------------------
def test_a_stream_interval_wakes_the_reader_for_first_text_every_n_tokens_a_finish_and_an_error():
    """The channel alone, fed by hand (no engine), at an interval of 4: after each put, whether the reader
    was woken, and what it read then (per choice: index, text, tokens, finish reason)."""
    from level6_serving.async_engine import AsyncLLMEngine, RequestStream

    def delta(*choices, finished=False):  # one step's DELTA output; a choice: (index, text, tokens[, finish])
        outs = [SimpleNamespace(index=c[0], text=c[1], token_ids=[7] * c[2], logprobs=None, cumulative_logprob=None,
                                finish_reason=c[3] if len(c) > 3 else None, stop_reason=None) for c in choices]  # fmt: skip
        return SimpleNamespace(outputs=outs, finished=finished, metrics=None)

    def play(deltas) -> list:
        async def go():
            s, seen = RequestStream("r", [1], print, stream_interval=4), []
            for d in deltas:
                s.put(d)
                got = s._ready.is_set() and await s.get()
                seen.append(got and [(c.index, c.text, len(c.token_ids), c.finish_reason) for c in got.outputs])
            return seen

        return asyncio.run(go())

    # One choice, a character a token: the first at once, then every 4th, and the end.
    text = play([delta((0, ch, 1), finished=i == 9) for i, ch in enumerate("abcdefghij")])
    assert [got and got[0][1] for got in text] == ["a", False, False, False, "bcde", False, False, False, "fghi", "j"]
    # Text held back (a stop string's possible start, half a UTF-8 character): the first *visible* text goes out
    # at once, with the tokens before it; not a token that shows nothing. Then 4 tokens, not 4 characters.
    assert play([delta((0, "", 1)), delta((0, "", 1)), delta((0, "Wh", 1)), *(delta((0, w, 1)) for w in ["at ", "is ",
                 "it", "?"])]) == [False, False, [(0, "Wh", 3, None)], False, False, False, [(0, "at is it?", 4, None)]]  # fmt: skip
    # Two choices: each one's first text at once; a choice that finishes at once.
    assert play([delta((0, "a", 1), (1, "", 1)), delta((0, "b", 1), (1, "T", 1)), delta((0, "c", 1), (1, "h", 1)),
                 delta((0, "d", 1, "stop"), (1, "a", 1))]) == [
        [(0, "a", 1, None), (1, "", 1, None)], [(0, "b", 1, None), (1, "T", 1, None)], False,
        [(0, "cd", 2, "stop"), (1, "ha", 2, None)]]  # fmt: skip

    async def fail():  # an error wakes the reader at once, after what was pending: no computed token is lost
        s = RequestStream("e", [1], print, stream_interval=4)
        s.put(delta((0, "x", 1)))
        assert (await s.get()).outputs[0].text == "x"
        s.put(delta((0, "y", 1)))
        s.put(RuntimeError("the engine failed"))
        assert s._ready.is_set(), "an error must wake the reader at once"
        assert (await s.get()).outputs[0].text == "y"
        assert s._ready.is_set(), "the error is still to be read"
        with pytest.raises(RuntimeError, match="the engine failed"):
            await s.get()

    asyncio.run(fail())
    with pytest.raises(ValueError, match="stream_interval"):  # refused before a model loads (none is there)
        AsyncLLMEngine.from_engine_args("no/such/model", stream_interval=0)


def test_a_stream_interval_sends_fewer_events_of_the_same_tokens(server, monkeypatch):
    """Through HTTP. A reader that falls behind gets bigger deltas whatever the interval (so the first
    event may hold more than one token here; the test above pins that down): what holds for any reader is
    at most 1 + ceil(22 / 5) events, none but the first and the last under 5 tokens. Steps slowed by 10 ms
    keep the reader ahead, so without the interval most events would hold one token and this would fail."""
    kw = dict(model=NAME, prompt="ROMEO:\n", max_tokens=23, temperature=0, logprobs=1)
    whole = server.client.completions.create(**kw).choices[0]
    monkeypatch.setattr(server.engine, "stream_interval", 5)  # what --stream-interval 5 sets
    engine, step = server.engine.engine, server.engine.engine.step
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(0.01), step())[1])
    client = server.client.with_options(timeout=30, max_retries=0)  # 23 tokens take about 0.3 s: a stuck stream fails
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    sizes = [len(c.logprobs.tokens) for c in chunks]
    assert "".join(c.text for c in chunks) == whole.text and sum(sizes) == 23
    assert all(n >= 5 for n in sizes[1:-1]) and len(chunks) <= 1 + math.ceil(22 / 5), sizes
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]


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
