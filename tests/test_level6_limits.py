"""Level 6 under hostile input and dead ranks: limits, faults, and connections that stay usable.

What it is: the server tested where a careless client or a dying worker would hurt it,
each as a user (or an operator's supervisor) meets it:

  - a worker rank killed by SIGKILL while the engine is idle: `/health` turns 503 within 2 s
    of the kill, every new request is a 503 with Retry-After naming the rank and its exit
    code, `/metrics` still answers; killed mid-stream: the stream ends with an error event
    and, with the default `--exit-on-engine-death`, the process exits 1 (a supervisor
    restarts it);
  - a 100 MB body (announced by Content-Length, or chunked) is a 413 in under a second,
    and the server's memory does not grow by the body;
  - `/health` answers in milliseconds while eight 5 MB prompts are parsed and refused, and
    while slow tokenizations run (they run on the front-end thread, not the event loop); the
    server (and a data-parallel router) freezes its startup heap before it serves, so a full
    garbage collection, which holds the GIL, walks only what came after;
  - a 500 leaves the kept-alive connection usable, and a connection reused after 6 idle
    seconds (past the 5 s at which uvicorn used to close it, racing the client) still works;
  - 405 keeps its Allow header and says invalid_request_error.

What it is not: a speed test. The latency bounds (2 s to notice a dead rank, 1 s for a
413) are ten times or more what they take here; each names the mechanism it guards.
/health's are two: its median under 50 ms, and no ping as slow as a blocked event loop
would make it (1.5 s; tokenizing one 5 MB prompt takes 3.7 s). Its p99, about 10-25 ms
here, is printed, not asserted: a busy 2-core machine stalls a healthy server's ping too
(0.17 and 0.43 s in one suite run beside another busy process, 0.8 s once in CI).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
import pytest
from level6_helpers import wait_for

from level6_serving import AsyncLLMEngine
from level6_serving.api_server import ServerThread, build_app
from level6_serving.metrics import parse, value
from level6_serving.process import ServerProcess

pytestmark = pytest.mark.level6

ENGINE = dict(dtype="float32", max_model_len=512, seed=0, kv_cache_memory=16 << 20)


@pytest.fixture(scope="module")
def ckpt(checkpoint_factory):
    return checkpoint_factory("llama", tokenizer=True)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def rank_pids(server_pid: int) -> list[int]:
    """The worker ranks the server spawned (multiprocessing's spawn runs them as `spawn_main`)."""
    children = subprocess.run(["pgrep", "-P", str(server_pid)], capture_output=True, text=True).stdout.split()
    out = []
    for pid in map(int, children):
        with open(f"/proc/{pid}/cmdline") as f:
            if "spawn_main" in f.read():
                out.append(pid)
    return out


def health(url: str):
    try:
        return httpx.get(url + "/health", timeout=5).status_code
    except httpx.TransportError:
        return None  # not listening (any more)


# --- a dead rank ---------------------------------------------------------------------------------
TP2 = ["--tensor-parallel-size", "2", "--max-model-len", "512", "--kv-cache-memory", "16MiB",
       "--disable-uvicorn-access-log"]  # fmt: skip


def test_a_rank_killed_while_idle_is_503_within_2_s_naming_it_and_metrics_still_served(ckpt):
    """Nothing runs: only the engine thread's idle health check can notice the dead rank."""
    with ServerProcess(["--model", str(ckpt), *TP2, "--no-exit-on-engine-death"]) as server:
        ok = httpx.post(
            server.url + "/v1/completions", json={"prompt": "KENT:\n", "max_tokens": 3, "ignore_eos": True}, timeout=60
        )
        assert ok.status_code == 200, ok.text
        (rank,) = rank_pids(server.proc.pid)
        os.kill(rank, signal.SIGKILL)
        t0 = time.monotonic()
        wait_for(lambda: health(server.url) == 503, 2.0, "/health 503")
        noticed = time.monotonic() - t0
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 503 and r.headers["Retry-After"] and err["code"] == "engine_dead", r.text
        assert "rank1" in err["message"] and "exit code -9" in err["message"], err
        metrics = httpx.get(server.url + "/metrics", timeout=30)
        assert metrics.status_code == 200
        assert value(parse(metrics.text), "vllm:generation_tokens_total") == 3  # what it did before it died
    assert server.returncode == 0, server.tail()  # SIGTERM still drains a dead engine and exits cleanly
    print(f"a rank killed while idle: /health 503 after {noticed:.2f} s")


def test_a_rank_killed_mid_stream_ends_the_stream_with_an_error_and_the_server_exits_1(long_ckpt):
    """An answer the kill surely interrupts: at TP=2, 400 tokens stream in about 4 s here, so a client held
    up that long would find the answer ended whole; 4,000 take ten times that or more."""
    flags = ["--model", str(long_ckpt), *TP2, "--max-model-len", "4096"]  # the last --max-model-len counts
    with ServerProcess(flags) as server:  # --exit-on-engine-death is the default
        (rank,) = rank_pids(server.proc.pid)
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={"prompt": "KENT:\n", "max_tokens": 4000, "ignore_eos": True, "stream": True}) as r:  # fmt: skip
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # it runs
            os.kill(rank, signal.SIGKILL)
            t0 = time.monotonic()
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]" and "error" in json.loads(rest[-2]), rest[-3:]  # the stream says so and ends
        code = server.proc.wait(timeout=60)
        assert code == 1, server.tail()
        assert "rank1" in server.tail() and "exiting with status 1" in server.tail()
    print(f"a rank killed mid-stream: the server exited 1 after {time.monotonic() - t0:.2f} s")


# --- body size and /health latency -------------------------------------------------------------------
@pytest.fixture(scope="module")
def process(ckpt):
    flags = ["--model", str(ckpt), "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "16MiB",
             "--disable-uvicorn-access-log"]  # fmt: skip
    with ServerProcess(flags) as server:
        yield server


def send_huge(url: str, chunked: bool, megabytes: int = 100) -> tuple[float, bytes, int]:
    """POST a `megabytes` body as fast as the server takes it, until it answers. Returns the
    seconds to the answer's first bytes, the whole answer, and the megabytes sent until then."""
    host, port = url.removeprefix("http://").split(":")
    framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % (megabytes << 20)
    chunk = b"x" * (1 << 20)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        t0 = time.perf_counter()
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n" + framing + b"\r\n\r\n"
        )
        s.setblocking(False)
        sent, answer, pending = 0, b"", b""
        while not answer and time.perf_counter() - t0 < 10:
            if not pending and sent < megabytes:
                pending, sent = (b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk), sent + 1
            try:
                pending = pending[s.send(pending) :] if pending else pending  # a partial send keeps the rest
            except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                time.sleep(0.005)  # the server reads no more (or is gone): wait for its answer
            try:
                answer = s.recv(4096)
            except BlockingIOError:
                pass
        seconds = time.perf_counter() - t0
        # The first recv may hold only the head (the body is a second TCP segment): read on until
        # the body that Content-Length announces is all here, or the server closes.
        s.setblocking(True)
        while answer:
            head, _, body = answer.partition(b"\r\n\r\n")
            length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
            if length and len(body) >= int(length.group(1)):
                break
            try:
                more = s.recv(4096)
            except (ConnectionResetError, TimeoutError):
                break  # the server closed the connection hard; what came is what the test sees
            if not more:
                break
            answer += more
        return seconds, answer, sent


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_100_MB_body_is_413_at_once_and_memory_stays_flat(process, chunked):
    before = rss_mib(process.proc.pid)
    seconds, answer, sent = send_huge(process.url, chunked)
    grew = rss_mib(process.proc.pid) - before
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"--max-request-body-bytes" in answer and b"invalid_request_error" in answer
    # Measured: 1 ms and 21 ms on an idle machine; 3 s leaves room for a loaded CI runner.
    assert seconds < 3.0 and grew < 50, (seconds, grew, sent)
    assert sent < 100  # the server answered long before the body was all sent
    assert health(process.url) == 200
    print(
        f"100 MB body ({'chunked' if chunked else 'Content-Length'}): 413 after {seconds * 1000:.0f} ms and "
        f"{sent} MB sent; server RSS {before:.0f} -> {before + grew:.0f} MiB"
    )


def health_latencies(url: str, stop: threading.Event, out: list) -> None:
    """Ping /health until `stop`; a failure ends the pinging and is put in `out` for the test to raise."""
    try:
        with httpx.Client(base_url=url, timeout=10) as client:
            while not stop.is_set():
                t0 = time.perf_counter()
                status = client.get("/health").status_code
                assert status == 200, f"/health said {status}"
                out.append(time.perf_counter() - t0)
                time.sleep(0.01)
    except Exception as e:  # noqa: BLE001 - re-raised by the test, not lost in the thread
        out.append(e)


def latencies_of(out: list) -> list[float]:
    for x in out:
        if isinstance(x, Exception):
            raise x
    return out


def p99(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[98]


def not_blocked(latencies: list[float]) -> bool:
    """/health answered in milliseconds as a rule (median under 50 ms), and never waited as long as
    a loop blocked by one big prompt would make it wait (1.5 s). Why not "p99 under 100 ms", which
    holds on a quiet machine: the module's docstring."""
    return statistics.median(latencies) < 0.05 and max(latencies) < 1.5


POLLER = """
import sys, threading, time, httpx
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
with httpx.Client(base_url=sys.argv[1], timeout=10) as client:
    print("ready", flush=True)
    while not done.is_set():
        t0 = time.perf_counter()
        assert client.get("/health").status_code == 200
        print(time.perf_counter() - t0, flush=True)
        time.sleep(0.01)
"""


@pytest.fixture
def serve_nothing(monkeypatch):
    """`main()` of `python -m level6_serving` in this process, up to the point it serves: `Server.run` records
    the collector's state and returns (the engine never starts); after, this process's heap is unfrozen and
    its torch threads and SIGTERM handler (the router ignores SIGTERM while its replicas stop) are restored,
    and the process-wide setup main() does for a real server (logging, the parent watch) is skipped."""
    import gc
    import logging

    import torch

    from level6_serving import process
    from level6_serving.api_server import Server

    seen, threads, sigterm = [], torch.get_num_threads(), signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)
    monkeypatch.setattr(process, "exit_with_parent", lambda: None)

    def run(self, sockets=()):
        seen.append((gc.get_freeze_count(), len(gc.get_objects())))  # frozen, still walked by a full collection
        for sock in sockets:
            sock.close()

    monkeypatch.setattr(Server, "run", run)
    try:
        yield seen
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads)
        signal.signal(signal.SIGTERM, sigterm)


def test_the_server_freezes_its_startup_heap_before_it_serves(ckpt, serve_nothing):
    """A full collection walks every object the collector tracks while holding the GIL: in a server, the event
    loop (/health, every stream) and the engine wait. `python -m level6_serving` collects once and freezes what
    is alive (the imports, the model, the engine) before it serves (api_server.freeze_startup_heap; the
    pause it removes is measured in docs/level6_serving.md)."""
    from level6_serving.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--model", str(ckpt), "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "16MiB",
              "--port", "0"])  # fmt: skip
    (frozen, walked), = serve_nothing
    assert e.value.code == 0 and frozen > 50_000 and walked < frozen / 100, (frozen, walked)


def test_the_data_parallel_router_freezes_its_heap_before_it_serves(serve_nothing, monkeypatch):
    """The router relays every replica's every token: its imports are frozen before it serves too (the replicas
    are not started here: their processes are the test above's)."""
    from level6_serving.__main__ import main
    from level6_serving.process import ServerProcess

    monkeypatch.setattr(ServerProcess, "start", lambda self: setattr(self, "url", "http://127.0.0.1:9") or self)
    monkeypatch.setattr(ServerProcess, "stop", lambda self, timeout=None: self._remove_scratch())
    main(["--data-parallel-size", "2", "--port", "0"])
    (frozen, walked), = serve_nothing
    assert frozen > 50_000 and walked < frozen / 100, (frozen, walked)


def test_health_answers_in_milliseconds_while_eight_5_MB_prompts_are_processed(process):
    """Eight 5 MB prompts: each body is read, parsed on the front-end thread (it is large),
    and refused by its length in characters, before any tokenizer sees it. /health is
    polled from a process of its own, so the test's own client does not slow the poller.
    (One ping took 0.8 s once, under CI's second worker; a full collection of the server's
    heap was one candidate, which the server now avoids: the tests above. Pings of 0.17 and
    0.43 s came later in a frozen server, in a suite run beside a busy process: the machine.)"""
    body = json.dumps({"prompt": "To be, or not to be: " * 250_000, "max_tokens": 4}).encode()
    assert len(body) > 5_000_000

    async def post_all():
        async with httpx.AsyncClient(base_url=process.url, timeout=60) as client:
            headers = {"content-type": "application/json"}
            return await asyncio.gather(*[client.post("/v1/completions", content=body, headers=headers)
                                          for _ in range(8)])  # fmt: skip

    poller = subprocess.Popen([sys.executable, "-c", POLLER, process.url], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert poller.stdout.readline().strip() == "ready"
        time.sleep(0.2)  # some pings before, for a baseline
        answers = asyncio.run(post_all())
        time.sleep(0.2)
    finally:
        out, _ = poller.communicate("", timeout=30)  # closing its stdin stops it
    assert poller.returncode == 0
    latencies = [float(x) for x in out.split()]
    for r in answers:
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "prompt" and err["code"] == "context_length_exceeded", err
        assert "was not tokenized" in err["message"]
    assert len(latencies) >= 20 and not_blocked(latencies), sorted(latencies)[-5:]
    print(
        f"/health during eight 5 MB prompts: p50 {statistics.median(latencies) * 1000:.1f} ms, "
        f"p99 {p99(latencies) * 1000:.1f} ms, max {max(latencies) * 1000:.1f} ms over {len(latencies)} pings"
    )


def test_tokenizing_runs_off_the_event_loop(ckpt, monkeypatch):
    """A tokenization that takes 0.4 s (a stand-in for a very long prompt; sleeping frees the
    GIL as the Rust tokenizer does) for each of eight requests: /health stays fast throughout."""
    engine = AsyncLLMEngine.from_engine_args(str(ckpt), **ENGINE)
    tokenize = engine.inputs.tokenize
    on_loop = []

    def slow_tokenize(prompt, i=0):
        if isinstance(prompt, str):  # (a list of ids is only checked, inline: that is cheap)
            on_loop.append(not threading.current_thread().name.startswith("tokenizer"))
            time.sleep(0.4)
        return tokenize(prompt, i)

    monkeypatch.setattr(engine.inputs, "tokenize", slow_tokenize)
    with ServerThread(build_app(engine, ["tiny"])) as url:
        stop, latencies = threading.Event(), []
        poller = threading.Thread(target=health_latencies, args=(url, stop, latencies))
        poller.start()

        async def post_all():
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                return await asyncio.gather(*[client.post("/v1/completions", json={"prompt": f"KENT {i}:", "max_tokens": 2})
                                              for i in range(8)])  # fmt: skip

        try:
            answers = asyncio.run(post_all())
        finally:
            stop.set()
            poller.join(30)
    latencies = latencies_of(latencies)
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    assert len(on_loop) == 8 and not any(on_loop)  # every call on the front-end thread, none on the server's
    assert len(latencies) >= 10 and not_blocked(latencies), sorted(latencies)[-5:]


# --- connections stay usable -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def thread_server(ckpt):
    engine = AsyncLLMEngine.from_engine_args(str(ckpt), **ENGINE)
    with ServerThread(build_app(engine, ["tiny"])) as url:
        yield url, engine


def http_exchange(sock: socket.socket, path: str, body: dict) -> tuple[int, dict, bytes]:
    """One request on an open connection; reads exactly one response (Content-Length framed)."""
    data = json.dumps(body).encode()
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (path.encode(), len(data), data))  # fmt: skip
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += sock.recv(65536) or b"<closed>"
        assert not buf.endswith(b"<closed>"), buf
    head, rest = buf.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(rest) < int(headers["content-length"]):
        more = sock.recv(65536)
        assert more, "the server closed the connection in the middle of a response"
        rest += more
    return int(lines[0].split()[1]), headers, rest


def test_a_500_leaves_the_kept_alive_connection_usable(thread_server, monkeypatch):
    url, engine = thread_server
    add = engine.engine.add_request

    def add_or_fail(request_id, prompt, params=None, priority=0, **kw):
        if params.max_tokens == 13:
            raise RuntimeError("boom in add_request")
        return add(request_id, prompt, params, priority, **kw)

    monkeypatch.setattr(engine.engine, "add_request", add_or_fail)
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        for _ in range(3):  # the same connection, again and again
            status, headers, body = http_exchange(sock, "/v1/completions", {"prompt": "x", "max_tokens": 13})
            assert status == 500 and json.loads(body)["error"]["type"] == "server_error"
            assert headers.get("connection") != "close"
            status, _, body = http_exchange(sock, "/v1/completions", {"prompt": "x", "max_tokens": 2})
            assert status == 200 and json.loads(body)["choices"][0]["finish_reason"] == "length"


def test_a_connection_idle_for_6_s_is_still_open(thread_server):
    """uvicorn's default keep-alive (5 s) equals httpx's (and so the openai client's) own
    expiry: a connection reused at ~5 s could be closed by the server under the request.
    The server now keeps idle connections for 30 s, so the client always closes first."""
    url, _ = thread_server
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        assert http_exchange(sock, "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] == 200
        time.sleep(6.0)  # the idle time is the scenario itself, not a wait for something
        assert http_exchange(sock, "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] == 200


def test_405_keeps_allow_and_says_invalid_request(thread_server):
    url, _ = thread_server
    r = httpx.get(url + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers
    assert r.json()["error"]["type"] == "invalid_request_error"
