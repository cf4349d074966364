"""Level 6, disaggregated: a prefill server (kv_producer), a decode server (kv_consumer) and the proxy
(level6_serving/disagg.py), all threads of this process, talking HTTP and TCP on loopback. Through
the proxy the openai client's greedy answers are the offline engine's; a prefill side that is gone
costs only a recompute; a decode side that is gone is a clear error, and leaves the rotation.
"""

from __future__ import annotations

import socket
import threading

import httpx
import pytest
from level6_helpers import ENGINE, NAME, serve

from level6_serving.api_server import ServerThread
from level6_serving.disagg import build_disagg_app, check_models

pytestmark = pytest.mark.level6

PROMPTS = ["ROMEO: what light through yonder window", "JULIET: O Romeo, Romeo, wherefore art thou"]


def tcp(role: str) -> dict:
    return {"kv_connector": "TCPConnector", "kv_role": role, "kv_port": 0}


@pytest.fixture(scope="module")
def pair(ckpt):
    with serve(ckpt, {**ENGINE, "kv_transfer_config": tcp("kv_producer")}) as p, \
            serve(ckpt, {**ENGINE, "kv_transfer_config": tcp("kv_consumer")}) as d:  # fmt: skip
        yield p, d
        p.engine.engine.connector.close()


def closed_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def received(decode) -> int:
    return decode.engine.engine.kv_connector_stats()["transfers_received"]


def test_through_the_proxy_the_answers_are_the_offline_engines(pair, llm):
    import openai

    from level0_naive import SamplingParams

    prefill, decode = pair
    app = build_disagg_app([prefill.url], [decode.url])
    with ServerThread(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)
        before = received(decode)
        for prompt in PROMPTS:
            want = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0), progress=False)[0]
            got = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
            assert got.choices[0].text == want.outputs[0].text
            streamed = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True)
            assert "".join(c.choices[0].text for c in streamed if c.choices) == want.outputs[0].text
        messages = [{"role": "user", "content": PROMPTS[0]}]
        chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
        want = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0))[0]
        assert chat.choices[0].message.content == want.outputs[0].text
        assert received(decode) - before == 2 * len(PROMPTS) + 1  # every request's KV came over
        assert decode.engine.engine.kv_connector_stats()["transfers_missing"] == 0
        assert app.state.outcomes["disaggregated"] == 2 * len(PROMPTS) + 1
        assert 'ladder:disagg_requests_total{outcome="disaggregated"} 5' in httpx.get(url + "/metrics").text
        client.close()


def test_a_prefill_side_that_is_gone_costs_a_recompute_not_an_error(pair, llm):
    from level0_naive import SamplingParams

    _, decode = pair
    app = build_disagg_app([closed_url()], [decode.url])
    with ServerThread(app) as url:
        body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0}
        got = httpx.post(url + "/v1/completions", json=body, timeout=120)
        want = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=6, temperature=0), progress=False)[0]
        assert got.status_code == 200 and got.json()["choices"][0]["text"] == want.outputs[0].text
        assert app.state.outcomes == {"prefill_failed": 1}
        assert app.state.pools["prefill"].live() == []


def test_a_decode_side_that_is_gone_is_skipped_or_a_clear_error(pair):
    """A refused connection: the next decode instance answers. One that breaks off its answer: a 502
    naming it, it leaves the rotation, and the request is not sent anywhere else (it may have run)."""
    prefill, decode = pair
    breaker = socket.create_server(("127.0.0.1", 0))
    broke = []

    def break_off():  # answers a head and half a body, then hangs up
        conn, _ = breaker.accept()
        conn.recv(1 << 16)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"id\"")
        broke.append(True)  # (before it hangs up: the proxy's 502 cannot come first)
        conn.close()

    threading.Thread(target=break_off, daemon=True).start()
    broken_url = f"http://127.0.0.1:{breaker.getsockname()[1]}"
    app = build_disagg_app([prefill.url], [closed_url(), broken_url, decode.url])
    with ServerThread(app) as url:
        body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
        first = httpx.post(url + "/v1/completions", json=body, timeout=120)  # refused -> the breaker
        assert first.status_code == 502 and broken_url in first.json()["error"]["message"] and broke
        pools = app.state.pools["decode"]
        assert pools.live() == [decode.url]
        after = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert after.status_code == 200 and after.json()["choices"][0]["text"]
        assert app.state.outcomes["decode_failed"] == 1 and app.state.outcomes["disaggregated"] == 1
        pools.mark_dead(decode.url, "the test says so")
        none = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert none.status_code == 503 and none.json()["error"]["code"] == "no_decode_instance"
        assert httpx.get(url + "/health").status_code == 503
    breaker.close()


def test_the_proxy_refuses_to_start_over_instances_serving_different_models(pair, ckpt):
    prefill, decode = pair
    check_models([prefill.url], [decode.url])  # the same model: no word
    with ServerThread(other_app(ckpt)) as url:
        with pytest.raises(SystemExit, match=f"{prefill.url} serves \\['{NAME}'\\], {url} serves \\['other'\\]"):
            check_models([prefill.url], [url])


def other_app(ckpt):
    """A server of the same checkpoint under another name."""
    from level6_serving.api_server import build_app
    from level6_serving.async_engine import AsyncLLMEngine

    return build_app(AsyncLLMEngine.from_engine_args(str(ckpt), **ENGINE), ["other"])
