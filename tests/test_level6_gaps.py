"""Level 6: the protocol gaps real clients found (issue 50), one test each.

What it is: `text_offset` in characters for an echoed non-ASCII prompt and its output alike;
tool calls with `tool_choice` "required" or a named function, streamed or not, and
`parallel_tool_calls: false`; `max_tokens: 0` with `echo` (scoring a prompt); vLLM's
`GET /tokenizer_info`; an `/openapi.json` that says what the server validates; the
`Authorization` scheme in any case.

What it is not: the rest of the server's contract (test_level6.py, test_level6_errors.py, and
schemathesis in test_level6_clients.py).
"""

from __future__ import annotations

import json

import httpx
import pytest
from level6_helpers import ENGINE, NAME, serve, sse_events

pytestmark = pytest.mark.level6

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Verona", "Mantua"]}}, "required": ["city"],
    "additionalProperties": False}}}]  # fmt: skip
ASK = [{"role": "user", "content": "weather?"}]


def chunks(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    return [json.loads(e) for e in sse_events(r.text)[:-1]]


def test_text_offset_counts_characters_in_the_echo_and_the_output_alike(server):
    """The prompt "é€ab" is 7 byte tokens. Offsets index the returned text: a token that is part of a character
    starts where the characters before it end (was: the prompt counted in tokens, the output in characters)."""
    body = {"prompt": "é€ab", "echo": True, "logprobs": 1, "max_tokens": 6, "temperature": 0}
    c = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    offsets = c["logprobs"]["text_offset"]
    assert offsets[:7] == [0, 0, 1, 1, 1, 2, 3] and offsets[7] == 4
    assert offsets == sorted(offsets) and offsets[-1] < len(c["text"])
    streamed = [o for ch in chunks(httpx.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=60))
                for o in (ch["choices"][0]["logprobs"] or {}).get("text_offset", [])]  # fmt: skip
    assert streamed == offsets


def test_tool_choice_required_makes_parsed_tool_calls_streamed_or_not(server):
    """tool_choice "required" with parallel_tool_calls false: exactly one call, parsed, finish_reason "tool_calls", at
    temperature 0 too (was: an array that never closed, raw in content); streamed as tool_call deltas (was a 400)."""
    body = {"messages": ASK, "tools": WEATHER, "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 200, "temperature": 0}  # fmt: skip
    c = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None, c
    (call,) = c["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in ("Verona", "Mantua")
    got = chunks(httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60))
    deltas = [ch["choices"][0] for ch in got]
    assert deltas[0]["delta"] == {"role": "assistant", "content": None}  # a tool call has no content (was "")
    assert deltas[-1]["finish_reason"] == "tool_calls"
    calls = [t for d in deltas for t in d["delta"].get("tool_calls", [])]
    assert [(t["index"], t["function"]["name"], t["function"]["arguments"]) for t in calls] == \
        [(0, "get_weather", call["function"]["arguments"])]  # fmt: skip
    # parallel calls allowed: a list, every one parsed (seeded, so it closes within max_tokens)
    many = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                      json={**body, "parallel_tool_calls": True, "temperature": 1, "seed": 0, "max_tokens": 300}).json()["choices"][0]  # fmt: skip
    assert many["finish_reason"] == "tool_calls" and len(many["message"]["tool_calls"]) >= 1


def test_a_named_function_streams_its_arguments(server):
    body = {"messages": ASK, "tools": WEATHER, "max_tokens": 60, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}  # fmt: skip
    whole = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    got = chunks(httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60))
    calls = [t for ch in got for t in ch["choices"][0]["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert all(t["index"] == 0 and "id" not in t for t in calls[1:])
    args = whole["message"]["tool_calls"][0]["function"]["arguments"]
    assert "".join(t["function"]["arguments"] for t in calls) == args
    assert got[-1]["choices"][0]["finish_reason"] == whole["finish_reason"] == "stop"


def test_max_tokens_0_with_echo_scores_the_prompt(server, llm):
    """OpenAI's legacy scoring: the prompt, its logprobs, no generated token (was a 400); streamed alike."""
    from level6_serving import SamplingParams

    want = llm.generate(["ROMEO:\n"], SamplingParams(max_tokens=1, prompt_logprobs=2), progress=False)[0]
    body = {"prompt": "ROMEO:\n", "echo": True, "logprobs": 2, "max_tokens": 0}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    c = r["choices"][0]
    assert c["text"] == "ROMEO:\n" and c["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 0
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(want.prompt_token_ids) and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(
        [d[t].logprob for d, t in zip(want.prompt_logprobs[1:], want.prompt_token_ids[1:])], abs=1e-9)  # fmt: skip
    got = chunks(httpx.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=60))
    assert "".join(ch["choices"][0]["text"] for ch in got) == "ROMEO:\n"
    assert [t for ch in got for t in (ch["choices"][0]["logprobs"] or {}).get("tokens", [])] == lp["tokens"]
    bad = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 0}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"  # without echo: nothing to return


def test_tokenizer_info_is_vllms(server):
    info = httpx.get(server.url + "/tokenizer_info", timeout=30).json()
    tok = server.engine.tokenizer
    assert info["tokenizer_class"] == type(tok).__name__ and "vocab_file" not in info
    assert info["eos_token"] == tok.eos_token and info.get("chat_template") == tok.chat_template
    assert "/tokenizer_info" in httpx.get(server.url + "/openapi.json", timeout=30).json()["paths"]


def test_openapi_refuses_what_the_server_refuses(server):
    """The four bodies schemathesis' positive data sent and the server refused are outside the document."""
    import jsonschema

    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
    vocab = server.engine.model_config.vocab_size

    def valid(name: str, body: dict) -> bool:
        return jsonschema.Draft202012Validator({**doc["components"]["schemas"][name],
                                                "components": doc["components"]}).is_valid(body)  # fmt: skip

    cases = [("DetokenizeRequest", "/detokenize", {"tokens": [vocab]}), ("TokenizeRequest", "/tokenize", {}),
             ("ChatCompletionRequest", "/v1/chat/completions", {"messages": ASK, "function_call": {}}),
             ("CompletionRequest", "/v1/completions", {"prompt": ""}),
             # and what a deeper run found (1,000 bodies an operation)
             ("ChatCompletionRequest", "/v1/chat/completions", {"messages": []}),
             ("ChatCompletionRequest", "/v1/chat/completions", {"messages": ASK, "tools": [{"type": "function"}]}),
             ("CompletionRequest", "/v1/completions", {"prompt": "x", "structured_outputs": {"regexp": "a"}}),
             ("CompletionRequest", "/v1/completions", {"prompt": "x", "structured_outputs": {}}),
             ("TokenizeRequest", "/tokenize", {"messages": []})]  # fmt: skip
    for name, path, body in cases:
        assert httpx.post(server.url + path, json=body, timeout=30).status_code == 400, body
        assert not valid(name, body), (name, body)
    for name, body in (("DetokenizeRequest", {"tokens": [vocab - 1]}), ("TokenizeRequest", {"prompt": "x"}),
                       ("ChatCompletionRequest", {"messages": ASK, "function_call": "auto"}),
                       ("CompletionRequest", {"prompt": "x"})):  # fmt: skip
        assert valid(name, body), (name, body)


def test_openapi_lists_each_refusal_no_schema_can_state(ckpt):
    """Each of protocol.REFUSALS: a body the document admits, refused with its own code, which the operation's
    400 lists in x-refusals (what lets schemathesis' positive-data check run with nothing left out)."""
    import jsonschema

    from level6_serving.protocol import REFUSALS

    # A pool of 8 blocks (128 tokens: a token's K and V are 2 layers x 2 heads x 16 dims x 2 x 8 bytes = 1 KiB)
    # under a 512-token context, and a queue of 8 sequences.
    with serve(ckpt, {**ENGINE, "kv_cache_memory": 8 * 16 * 1024}, max_num_waiting=8) as s:
        doc = httpx.get(s.url + "/openapi.json", timeout=30).json()
        chars = s.engine.max_prompt_chars
        cases = [
            ("/v1/completions", {"prompt": "ROMEO:\n", "max_tokens": 511}, "context_length_exceeded"),
            ("/v1/completions", {"prompt": ["x", "y" * (chars // 2)], "max_tokens": 1}, "context_length_exceeded"),
            ("/v1/completions", {"prompt": "ROMEO:\n", "max_tokens": 300}, "exceeds_kv_cache"),
            ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 3}, "too_many_sequences"),
            ("/v1/completions", {"prompt": "x", "guided_grammar": "not a grammar"}, "invalid_constraint"),
            ("/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, "conflicting_constraints"),
            ("/v1/completions", {"prompt": "x", "min_tokens": 5, "max_tokens": 2}, "min_tokens_over_max_tokens"),
            ("/v1/completions", {"prompt": "x", "best_of": 1, "n": 2}, "best_of_not_n"),
            ("/v1/chat/completions", {"messages": ASK, "tools": WEATHER,
                                      "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "unknown_tool"),
            ("/tokenize", {"messages": [{"role": "user", "content": "x" * (chars + 1)}]}, "context_length_exceeded"),
        ]  # fmt: skip
        assert {code for *_, code in cases} == set(REFUSALS)
        for path, body, code in cases:
            op = doc["paths"][path]["post"]
            schema = {**op["requestBody"]["content"]["application/json"]["schema"], "components": doc["components"]}
            assert jsonschema.Draft202012Validator(schema).is_valid(body), (path, body)
            r = httpx.post(s.url + path, json=body, timeout=60)
            assert (r.status_code, r.json()["error"]["code"]) == (400, code), (path, body, r.text)
            assert code in op["responses"]["400"]["x-refusals"], (path, code)
        # schemathesis' coverage phase: a json_schema that is not an object was a 500
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "response_format": {
            "type": "json_schema", "json_schema": [None, None]}}, timeout=60)  # fmt: skip
        assert (r.status_code, r.json()["error"]["param"]) == (400, "response_format.json_schema.schema")
        # A hole in the document has code null: not listed, so the fuzzing test would report it.
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": "5"}, timeout=60)
        assert (r.status_code, r.json()["error"]["code"]) == (400, None)


def test_the_authorization_scheme_is_case_insensitive(ckpt):
    with serve(ckpt, ENGINE, api_key="sesame") as s:
        ask = lambda auth: httpx.post(s.url + "/tokenize", json={"model": NAME, "prompt": "x"},  # noqa: E731
                                      headers={"Authorization": auth}, timeout=30).status_code  # fmt: skip
        assert [ask(a) for a in ("Bearer sesame", "bearer sesame", "BEARER sesame")] == [200, 200, 200]
        assert [ask(a) for a in ("bearer Sesame", "Basic sesame", "sesame", "bearersesame")] == [401] * 4
