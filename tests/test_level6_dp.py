"""Data parallelism at level 6 (level6_serving/router.py): replicas behind one endpoint, and the router.

What it is:
  - the policies on recorded workloads, with no server: round-robin takes the live replicas in
    turn; least-loaded the one with the fewest requests in flight; prefix-aware sends prompts that
    share their first chunks to the replica that was sent them, balances prompts that share
    nothing, and gives up a match when its holder is BALANCE_SLACK requests busier than the least
    loaded; the chunk hashes chain (two prompts share hash i exactly when they share chunks 0..i);
  - /metrics merged: each replica's series labelled, and their sum (a share's mean);
  - the relay's HTTP client (level6_serving/http_client.py) against a raw server writing awkward pieces;
  - `python -m level6_serving --data-parallel-size 2`: every request's greedy output equals the
    offline engine's (DP=1), and both replicas served some;
  - a replica killed mid-stream: that stream ends with an error event and [DONE], the replica leaves
    rotation, /health stays 200 and every later request is answered by the live one;
  - a replica killed between requests: no request gets a 502 (a refused connection is sent to the
    live replica; a router that polls its replicas' processes never sends it there); a replica
    killed while it runs a whole answer, and while a stream waits there with only its headers
    sent: the live replica answers both.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from level6_helpers import ENGINE, LONG_CONTEXT, NAME, offline, sse_events, wait_for

from level6_serving import router as router_module
from level6_serving.api_server import ServerThread
from level6_serving.metrics import aborted, parse, value
from level6_serving.process import ServerProcess
from level6_serving.router import CHUNK_CHARS, Replica, Router, build_router_app, chunk_hashes, merge_metrics

pytestmark = pytest.mark.level6


def replicas(n: int) -> list[Replica]:
    return [Replica(i, f"http://replica{i}") for i in range(n)]


def test_round_robin_takes_the_live_replicas_in_turn():
    rs = replicas(3)
    r = Router(rs, "round-robin")
    assert [r.choose("x").index for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    rs[1].alive = False
    assert {r.choose("x").index for _ in range(4)} == {0, 2}
    for x in rs:
        x.alive = False
    with pytest.raises(LookupError):
        r.choose("x")


def test_least_loaded_takes_the_fewest_in_flight():
    rs = replicas(3)
    r = Router(rs, "least-loaded")
    rs[0].in_flight, rs[1].in_flight, rs[2].in_flight = 4, 1, 2
    assert r.choose("x").index == 1
    rs[1].in_flight = 2
    rs[2].sent = 5  # a tie in flight: the one sent fewer
    assert r.choose("x").index == 1


def test_prefix_aware_keeps_a_prefix_on_one_replica_and_balances_the_rest(monkeypatch):
    rs = replicas(2)
    r = Router(rs, "prefix-aware")
    system_a, system_b = "A" * (4 * CHUNK_CHARS), "B" * (4 * CHUNK_CHARS)

    def send(text):
        rep = r.choose(text)
        rep.in_flight += 1
        rep.sent += 1
        return rep.index

    first = send(system_a + "question 1")
    assert [send(system_a + f"question {i}") for i in range(2, 6)] == [first] * 4  # the cache is there
    other = send(system_b + "question 1")
    assert other != first  # nothing to reuse: the least loaded
    assert send(system_b + "question 2") == other
    rs[first].in_flight = 100  # the prefix's holder is far busier: balance wins over the match
    assert send(system_a + "question 9") == other
    assert send("short") == min(rs, key=lambda x: (x.in_flight, x.sent)).index  # under a chunk: least loaded
    monkeypatch.setattr(router_module, "MAX_CHUNKS_PER_REPLICA", 3)
    Router.remember(rs[0], chunk_hashes("C" * (10 * CHUNK_CHARS)))
    assert len(rs[0].chunks) == 3  # bounded: the least recently sent are forgotten


def test_the_prompt_read_for_routing():
    from level6_serving.router import prompt_text

    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({"prompt": ["first", "second"]}) == "first"
    assert prompt_text({"prompt": [5, 6, 7]}) == "5,6,7"  # token ids
    assert prompt_text({"prompt": [[5, 6], [7]]}) == "5,6"
    assert prompt_text({"messages": [{"role": "user", "content": "hi"}]}) == "user:hi\n"
    assert prompt_text({"prompt": 3}) == "" and prompt_text({}) == ""  # the replica refuses it in its own words


def test_chunk_hashes_chain():
    a, b = "x" * CHUNK_CHARS * 3, "x" * CHUNK_CHARS * 2 + "y" * CHUNK_CHARS
    ha, hb = chunk_hashes(a), chunk_hashes(b)
    assert len(ha) == 3 and ha[:2] == hb[:2] and ha[2] != hb[2]
    assert chunk_hashes("z" + a)[0] != ha[0] and chunk_hashes(a[: CHUNK_CHARS - 1]) == []
    other_start = "w" * CHUNK_CHARS + "x" * CHUNK_CHARS  # chunk 1 equals a's chunk 1, chunk 0 does not
    assert chunk_hashes(other_start)[1] != ha[1]  # a name covers everything before it


def test_the_router_flags_are_never_abbreviated(capsys):
    from level6_serving.__main__ import parse_args, replica_argv

    with pytest.raises(SystemExit):
        parse_args(["--data", "2"])  # else the replicas would get it as a data-parallel size of their own
    assert replica_argv(["--data-parallel-size", "2", "--router=round-robin", "--port", "9", "--seed", "1"]) == [
        "--seed", "1"]  # fmt: skip


def test_the_relay_client_dechunks_what_arrives_and_notices_a_server_that_leaves():
    """`level6_serving.http_client.post` (the router's call to a replica, the serving benchmark's client)
    against a raw server that writes a chunked stream in awkward pieces: a chunk split across writes,
    two chunks in one write. The body comes out whole and in order, the request went out as written;
    a server that closes mid-chunk is an IncompleteReadError, never a shorter body."""
    import asyncio

    from level6_serving.http_client import post

    events = [b"data: one\n\n", b"data: two, a longer event\n\n", b"data: [DONE]\n\n"]
    wire = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n")  # fmt: skip
    head = wire.index(b"\r\n\r\n") + 4
    cuts = [head + 3, head + 9, head + 40, len(wire)]  # mid size line, mid chunk, two chunks, the rest

    async def exchange(upto: int):
        seen = {}

        async def serve(reader, writer):
            seen["head"] = await reader.readuntil(b"\r\n\r\n")
            seen["body"] = await reader.readexactly(2)
            start = 0
            for cut in [c for c in cuts if c < upto] + [upto]:
                writer.write(wire[start:cut])
                await writer.drain()
                await asyncio.sleep(0.01)
                start = cut
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            answer = post(f"http://127.0.0.1:{port}/v1/completions", b"{}", {"Authorization": "Bearer k"})
            status, headers = await anext(answer), await anext(answer)
            return status, headers, b"".join([piece async for piece in answer]), seen
        finally:
            server.close()

    status, headers, body, seen = asyncio.run(exchange(len(wire)))
    assert status == 200 and headers["content-type"] == "text/event-stream" and body == b"".join(events)
    assert seen["head"].startswith(b"POST /v1/completions HTTP/1.1\r\n") and b"Authorization: Bearer k\r\n" in seen["head"]
    assert b"Content-Length: 2\r\n" in seen["head"] and seen["body"] == b"{}"
    with pytest.raises(asyncio.IncompleteReadError):
        asyncio.run(exchange(head + 30))  # the server leaves in the middle of the second chunk


def test_metrics_are_labelled_per_replica_and_summed():
    def replica(tokens, kv):  # what a replica's /metrics says, two families with their headers
        return (f'# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total{{model_name="m"}} {tokens}\n'
                f'# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{model_name="m"}} {kv}')  # fmt: skip

    one, two = replica(3.0, 0.5), replica(4.0, 0.25)
    samples = parse("\n".join(merge_metrics([one, None, two])))
    assert samples['vllm:generation_tokens_total{replica="0",model_name="m"}'] == 3.0
    assert samples['vllm:generation_tokens_total{replica="2",model_name="m"}'] == 4.0
    assert samples['vllm:generation_tokens_total{replica="all",model_name="m"}'] == 7.0
    assert samples['vllm:kv_cache_usage_perc{replica="all",model_name="m"}'] == 0.375  # a share: the mean
    merged = "\n".join(merge_metrics([one, two]))
    assert merged.count("# TYPE vllm:generation_tokens_total") == 1
    from prometheus_client.parser import text_string_to_metric_families

    names = [f.name for f in text_string_to_metric_families(merged + "\n")]
    assert len(names) == len(set(names)), names  # each family's lines in one group


def engine_flags(ckpt, max_model_len: int = ENGINE["max_model_len"]) -> list[str]:
    return ["--model", str(ckpt), "--served-model-name", NAME, "--dtype", ENGINE["dtype"], "--max-model-len",
            str(max_model_len), "--kv-cache-memory", str(ENGINE["kv_cache_memory"]), "--seed", "0"]  # fmt: skip


PROMPTS = ["ROMEO:", "JULIET:\nO", "First Citizen:", "HAMLET: to be", "KING:", "QUEEN:\nMy lord", "a", "bb"]


@contextlib.contextmanager
def two_replicas(ckpt, max_model_len: int, more: list[str] = ()):
    """Two `python -m level6_serving` processes loading at the same time (as --data-parallel-size does)."""
    reps = [ServerProcess([*engine_flags(ckpt, max_model_len), *more]) for _ in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(ServerProcess.start, reps))
        yield reps
    finally:
        for r in reps:
            r.stop(timeout=30)


def refuses(url: str) -> bool:
    """Whether nothing listens at url's port any more (a connection refused, not accepted and then dropped)."""
    try:
        httpx.get(url + "/health", timeout=1)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False


def test_a_killed_replica_fails_its_stream_cleanly_and_leaves_rotation(long_ckpt):
    """The abandoned and the killed answers (8,000 tokens: long_ckpt) are still running when the client
    leaves or the replica dies (400 tokens once ended first in CI, and there was no error event to find)."""
    with two_replicas(long_ckpt, LONG_CONTEXT) as (r0, r1):
        app = build_router_app([r0.url, r1.url], "round-robin")
        with ServerThread(app) as url:
            reps = app.state.replicas
            warm = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "a", "max_tokens": 2}, timeout=60)
            assert warm.status_code == 200  # replica 0; the next one goes to replica 1
            long = {"model": NAME, "prompt": "ROMEO:", "max_tokens": LONG_CONTEXT - 192, "stream": True,
                    "ignore_eos": True}  # fmt: skip
            with httpx.stream("POST", url + "/v1/completions", json=long, timeout=60) as stream:
                next(line for line in stream.iter_lines() if line.startswith("data: "))  # then the client leaves
            wait_for(lambda: reps[1].in_flight == 0, 4,  # well before the answer could end by itself
                     "the abandoned stream giving its place back")  # fmt: skip
            wait_for(lambda: aborted(parse(httpx.get(r1.url + "/metrics").text)) == 1, 10,
                     "replica 1 aborting the abandoned request")  # the router hung up on it too  # fmt: skip
            whole = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "b", "max_tokens": 2}, timeout=60)
            assert whole.status_code == 200 and whole.json()["choices"]  # replica 0, read whole, sent on
            events = []
            with httpx.stream("POST", url + "/v1/completions", json=long, timeout=60) as stream:
                for line in stream.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line[len("data: "):])
                    if len(events) == 3:
                        os.killpg(r1.proc.pid, signal.SIGKILL)  # replica 1 dies mid-answer
            assert events[-1] == "[DONE]"
            err = json.loads(events[-2])["error"]
            assert err["code"] == "replica_failed"
            assert httpx.get(url + "/health").status_code == 200
            # the killed replica's port closes only once its processes are gone; a connection made before that is
            # accepted and then dropped, not refused (a busy machine: lab 6c's planted bug, which still sends
            # replica 1 requests, once got a 502 here instead of a refusal the router retries)
            wait_for(lambda: refuses(r1.url), 30, "the killed replica's port refusing connections")
            after = [httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": p, "max_tokens": 3},
                                timeout=60) for p in PROMPTS[:4]]  # fmt: skip
            assert [a.status_code for a in after] == [200] * 4  # all to the live replica
            samples = parse(httpx.get(url + "/metrics").text)
            assert value(samples, "ladder:dp_replicas_alive") == 1
            assert value(samples, 'ladder:dp_requests_total{replica="1",outcome="failed"}') == 1
            assert value(samples, 'ladder:dp_requests_total{replica="0",outcome="ok"}') == 6
            assert reps[0].in_flight == reps[1].in_flight == 0  # every request gave its place back


def test_requests_whose_replica_dies_before_answering_are_answered_by_another(long_ckpt):
    """A whole (not streamed) answer is read before it is sent on, and a stream that has sent only its headers has
    shown the client nothing: when the replica's process dies then, the dead replica can no longer run the request
    and the router (its parent, which sees the exit) sends it to the live replica. Replica 1 runs one request at a
    time (--max-num-seqs 1): a long whole answer runs there, a stream waits behind it, and then replica 1 dies.
    Both get the live replica's answer: a 200 and a whole stream, not a 502 and an error event (guidellm with a
    replica killed found both)."""
    with two_replicas(long_ckpt, LONG_CONTEXT, ["--max-num-seqs", "1"]) as (r0, r1):
        app = build_router_app([r0.url, r1.url], "round-robin", processes=[r0.proc, r1.proc])
        with ServerThread(app) as url:
            post = lambda body: httpx.post(url + "/v1/completions", json=body, timeout=300)  # noqa: E731
            assert post({"model": NAME, "prompt": "a", "max_tokens": 2}).status_code == 200  # replica 0
            long = {"model": NAME, "prompt": "ROMEO:", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
            stream = {"model": NAME, "prompt": "JULIET:", "max_tokens": 8, "temperature": 0, "stream": True,
                      "stream_options": {"include_usage": True}}  # fmt: skip
            counts = lambda: parse(httpx.get(r1.url + "/metrics").text)  # noqa: E731
            with ThreadPoolExecutor(2) as pool:
                whole = pool.submit(post, long)  # replica 1
                wait_for(lambda: value(counts(), 'vllm:num_requests_running{model_name="tiny"}') == 1, 60,
                         "replica 1 running the long request")  # fmt: skip
                assert post({"model": NAME, "prompt": "b", "max_tokens": 2}).status_code == 200  # replica 0
                streamed = pool.submit(lambda: httpx.post(url + "/v1/completions", json=stream, timeout=300))
                wait_for(lambda: value(counts(), 'vllm:num_requests_waiting{model_name="tiny"}') == 1, 60,
                         "the stream waiting behind it on replica 1")  # fmt: skip
                os.killpg(r1.proc.pid, signal.SIGKILL)
                whole, streamed = whole.result(), streamed.result()
            assert whole.status_code == 200, whole.text
            assert whole.json()["usage"]["completion_tokens"] == 1000
            events = sse_events(streamed.text)
            assert events[-1] == "[DONE]" and not [e for e in events if '"error"' in e], events
            assert json.loads(events[-2])["usage"]["completion_tokens"] == 8  # the whole answer, from replica 0
            samples = parse(httpx.get(url + "/metrics").text)
            assert value(samples, 'ladder:dp_requests_total{replica="1",outcome="retried"}') == 2
            assert value(samples, 'ladder:dp_requests_total{replica="0",outcome="ok"}') == 4
            assert value(samples, "ladder:dp_replicas_alive") == 1
            # and the routes any replica answers, the API's document among them
            assert httpx.get(url + "/tokenizer_info").json()["eos_token"]
            assert "/v1/completions" in httpx.get(url + "/openapi.json").json()["paths"]


# After the killed replica on purpose: lab 6c's "served" check stops at its first failing test, and a
# router that keeps a dead replica in rotation fails only that one (this one would pass, slowly, first).
def test_two_replicas_give_the_offline_engines_answers(ckpt, llm):
    with ServerProcess([*engine_flags(ckpt), "--data-parallel-size", "2", "--router", "round-robin"]) as s:
        def ask(prompt):
            body = {"model": NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text  # a router that raises answers 500
            return r.json()["choices"][0]["text"]

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(ask, PROMPTS))
        samples = parse(httpx.get(s.url + "/metrics").text)
        assert httpx.get(s.url + "/health").status_code == 200
    want = [offline(llm, p, max_tokens=12, temperature=0, ignore_eos=True).outputs[0].text for p in PROMPTS]
    assert got == want
    served = {r: value(samples, f'ladder:dp_requests_total{{replica="{r}",outcome="ok"}}') for r in ("0", "1")}
    assert served == {"0": 4.0, "1": 4.0}  # round-robin: half each
    assert sum(v for k, v in samples.items() if k.startswith('vllm:generation_tokens_total{replica="all"')) == 12 * 8


def test_a_replica_killed_between_requests_costs_no_request_a_502(ckpt):
    """Replica 1 is SIGKILLed and reaped (its port closed for sure) before any request is sent. A router
    that has not noticed yet (no process to poll: its /health checks take a second or more to give up)
    sends it the second request, finds the connection refused, and sends that request to replica 0; a
    router that polls the replicas' processes takes replica 1 out of rotation before it sends anything.
    The replica that lives is stopped with SIGTERM: its exit is clean, with no nanobind leak report."""

    def ask(url: str) -> list[int]:
        return [httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": p, "max_tokens": 2},
                           timeout=60).status_code for p in PROMPTS[:4]]  # fmt: skip

    with two_replicas(ckpt, ENGINE["max_model_len"]) as (r0, r1):
        with ServerThread(build_router_app([r0.url, r1.url], "round-robin")) as url:
            os.killpg(r1.proc.pid, signal.SIGKILL)
            r1.proc.wait(timeout=30)
            assert ask(url) == [200] * 4  # the second was refused by replica 1, then answered by replica 0
            samples = parse(httpx.get(url + "/metrics").text)
            assert value(samples, 'ladder:dp_requests_total{replica="0",outcome="ok"}') == 4
            assert value(samples, "ladder:dp_replicas_alive") == 1
        watching = build_router_app([r0.url, r1.url], "round-robin", processes=[r0.proc, r1.proc])
        with ServerThread(watching) as url:
            assert ask(url) == [200] * 4 and httpx.get(url + "/v1/models").status_code == 200
            assert not watching.state.replicas[1].alive
            samples = parse(httpx.get(url + "/metrics").text)
            assert not [k for k in samples if k.startswith("ladder:dp_requests_total") and 'replica="1"' in k]
    assert r0.returncode == 0 and "nanobind" not in r0.tail(20_000), r0.tail()
