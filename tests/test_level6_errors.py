"""Level 6: bad input and failures. Every bad request gets its status and OpenAI's error body,
what the spec and vLLM's clients send is accepted, and a failure stays where it happened.

What it is: the level-6 test server (`server` in conftest.py, a thread of this process, so a
test can make the engine fail) and raw HTTP. It checks that

  - every bad input gets its status and OpenAI's error body naming the field, and the server
    stays healthy; the `openai` client reads these errors;
  - what OpenAI's schema allows (null for an optional field, 101.0 for an integer), vLLM's
    extra fields and stream options, and the fields accepted and ignored (documented) are a 200;
    a tiny temperature is clamped, not a NaN that fails the batch;
  - a request bigger than the whole queue is a 400, a full queue a 503, even when empty;
  - an exception inside one request is a 500 for that request only; an engine that cannot
    recover stops its loop and fails everything instead of spinning.

What it is not: hostile input (100 MB bodies, 5 MB prompts) or dead ranks: those are in
test_level6_limits.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from level6_helpers import ENGINE, NAME, failing_add_request, offline, sse_events

from level6_serving import AsyncLLMEngine, SamplingParams
from level6_serving.async_engine import EngineDeadError, EngineStepError
from level6_serving.protocol import APIError
from level6_serving.serving import OpenAIServing

pytestmark = pytest.mark.level6


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
    ("/v1/completions", '{"prompt": "x", "prompt_logprobs": 99}', 400, "prompt_logprobs"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1}', 400,
     "prompt_logprobs"),  # vLLM's field, honoured on /v1/completions only
    ("/v1/completions", '{"prompt": "x", "frobnicate": 1}', 400, "frobnicate"),
    ("/v1/completions", '{"prompt": "x", "temperature": Infinity}', 400, "temperature"),
    ("/v1/completions", '{"prompt": "x", "temperature": 1e308}', 400, "temperature"),  # inf in float32
    ("/v1/completions", '{"prompt": "x", "top_p": NaN}', 400, "top_p"),
    ("/v1/completions", '{"prompt": "x", "presence_penalty": -Infinity}', 400, "presence_penalty"),
    ("/v1/completions", '{"prompt": "x", "repetition_penalty": 1e-40}', 400, "repetition_penalty"),  # overflows
    ("/v1/completions", '{"prompt": "x", "seed": 1180591620717411303424}', 400, "seed"),  # 2**70
    ("/v1/completions", '{"prompt": "x", "max_tokens": 101.5}', 400, "max_tokens"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": true}', 400, "max_tokens"),
    ("/v1/completions", '{"prompt": "x", "use_beam_search": true, "n": 11}', 400, "n"),  # n is the beam width
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "use_beam_search": true, '
     '"stream": true}', 400, "stream"),  # fmt: skip
    ("/v1/completions", '{"prompt": "x", "use_beam_search": true, "length_penalty": NaN}', 400, "length_penalty"),
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


def test_a_tiny_temperature_is_clamped_not_a_nan_that_fails_the_batch(server, llm, slow_steps):
    """1e-38 would make logits / t overflow to inf and the draw NaN, failing every request in the
    batch; it is clamped to 0.01 (as vLLM does), sharper than any near-tie here: greedy's text.
    The steps are slowed, so the neighbour (30 steps, 0.6 s at least) is running when it comes."""
    want = offline(llm, "ROMEO:\n", max_tokens=8, temperature=0).outputs[0].text
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": "KENT:\n", "max_tokens": 30, "stream": True}) as other:  # fmt: skip
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "ROMEO:\n", "max_tokens": 8,
                                                             "temperature": 1e-38, "seed": 3}, timeout=60)  # fmt: skip
        data = sse_events(other.read().decode())
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
        chunks = [json.loads(d) for d in sse_events(r.read().decode())[:-1]]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 8 and chunks[-1]["choices"] == []  # the usage chunk last
    assert all(c["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] for c in chunks)


def test_the_queue_is_bounded_even_when_nothing_waits():
    fresh = {"count": 0}  # what the engine thread counts once the commands queued so far have run

    async def num_waiting_now():
        return fresh["count"]

    engine = SimpleNamespace(is_running=True, dead=None, num_waiting=0, num_waiting_now=num_waiting_now)
    serving = OpenAIServing(engine, [NAME], max_num_waiting=4, max_n=8)
    admit = lambda n: asyncio.run(serving.admit(n))  # noqa: E731
    serving.check_size(4, 1)
    admit(4)  # fits the empty queue alone: admitted
    for n, prompts, param in ((5, 1, "n"), (1, 5, "prompt"), (2, 3, "prompt")):
        with pytest.raises(APIError) as e:  # could never fit: 400, not "retry later"
            serving.check_size(n, prompts)
        assert (e.value.status, e.value.param) == (400, param)
        assert e.value.code == "too_many_sequences"  # a rule no JSON schema states: its own code
    engine.num_waiting = fresh["count"] = 1
    admit(3)
    with pytest.raises(APIError) as e:
        admit(4)
    assert e.value.status == 503 and e.value.headers == {"Retry-After": "1"}
    # The count after the last step still holds a request whose abort is queued (its client went away,
    # or one of its prompts was refused): counted again before refusing, it is not "overloaded".
    engine.num_waiting, fresh["count"] = 3, 0
    admit(4)


def test_the_openai_client_reads_our_errors(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=NAME, prompt="x", max_tokens=0)
    assert e.value.param == "max_tokens" and "max_tokens" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        server.client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found"


def test_an_exception_inside_one_request_is_a_500_for_it_only(server, monkeypatch, slow_steps):
    engine = server.engine.engine  # its steps slowed: the neighbour (40 steps, 0.8 s at least) runs beside
    monkeypatch.setattr(engine, "add_request", failing_add_request(engine))
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": "KENT:\n", "max_tokens": 40, "temperature": 0, "stream": True}) as other:  # fmt: skip
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 13})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error" and "boom" in r.text
        data = sse_events(other.read().decode())
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
