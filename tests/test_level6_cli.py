"""Level 6's command lines: `python -m level6_serving` as a real process, the demo, and the
benchmark client.

What it is: the server as an operator runs it. A bad flag is one line that names it;
`--tensor-parallel-size 2` serves the offline text from two ranks; `--api-key` gives 401
(health and metrics open), a full queue gives 503 + Retry-After, and SIGTERM lets the request
in flight finish, aborts the one past the drain timeout, and exits 0; a server goes with the
process that started it, even one killed with SIGKILL. The demo runs and leaves nothing behind; `python -m benchmarks.serving` measures a running server (`server` in
conftest.py) and refuses a bad flag in one line.

What it is not: a speed test: the benchmark's numbers are only checked to be there.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from level6_helpers import LONG_CONTEXT, NAME, offline, wait_for

from ladder.models import REPO
from level6_serving.metrics import parse, value
from level6_serving.process import ServerProcess

pytestmark = pytest.mark.level6


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
    (["--stream-interval", "0"], "--stream-interval"),
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


def alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped by whoever adopted it, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_server_goes_with_the_process_that_started_it(ckpt, tmp_path):
    """A ServerProcess's server watches the process that started it: SIGKILL that process (no time to
    stop anything) and the server drains and exits by itself, as a data-parallel router's replicas do
    when the router is killed."""
    flags = ["--model", str(ckpt), "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "16MiB"]
    code = ("import time; from pathlib import Path; from level6_serving.process import ServerProcess; "
            f"s = ServerProcess({flags!r}, log=Path({str(tmp_path / 'server.log')!r})).start(); "
            "print(s.proc.pid, flush=True); time.sleep(600)")  # fmt: skip
    starter, pid = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO), 0
    try:
        line = starter.stdout.readline()
        assert line.strip().isdigit(), f"the starter printed no pid: {line!r}; {tmp_path / 'server.log'}"
        pid = int(line)
        assert alive(pid)
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait()
        # its watch polls twice a second; then a drain with nothing to drain
        wait_for(lambda: not alive(pid), 30, f"the server's exit (its log: {tmp_path / 'server.log'})")
        assert "drained" in (tmp_path / "server.log").read_text()
    finally:
        starter.kill()
        starter.wait()
        starter.stdout.close()
        if pid and alive(pid):  # (the check failed: leave nothing running)
            os.killpg(pid, signal.SIGKILL)


LONG = 30_000  # tokens of the drain test's long requests


def test_server_process_api_key_backpressure_and_sigterm_drain(checkpoint_factory, tmp_path):
    # The long requests must still be running when the drain's deadline comes, however fast the machine:
    # 1900 tokens finished within it on a quick one (about 1 ms a step at batch 2). LONG tokens take tens
    # of seconds there, and the drain aborts them 1.5 s after SIGTERM; 64 MiB holds two of them (1 KiB a token).
    # (--max-model-len -1: all of the checkpoint's positions, past its tokenizer's 2048.)
    model = checkpoint_factory("llama", tokenizer=True, max_position_embeddings=LONG + 64)
    flags = ["--model", str(model), "--api-key", "sk-test", "--dtype", "float32", "--max-num-seqs", "2",
             "--max-num-waiting", "1", "--drain-timeout", "1.5", "--kv-cache-memory", "64MiB",
             "--max-model-len", "-1", "--disable-uvicorn-access-log"]  # fmt: skip
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
        long_a = asyncio.create_task(stream(LONG, a_first))
        await asyncio.wait_for(a_first.wait(), 30)
        long_b = asyncio.create_task(stream(LONG, b_first))
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
def test_demo_runs_and_leaves_nothing_behind(long_ckpt, tmp_path, capsys):
    from level6_serving import demo

    plot = tmp_path / "streams.png"  # the abandoned stream asks for nearly all of long_ckpt's positions
    res = demo.main(["--model", str(long_ckpt), "--clients", "4", "--max-tokens", "12", "--plot", str(plot),
                     "--max-model-len", str(LONG_CONTEXT)])  # fmt: skip
    out = capsys.readouterr().out
    assert res["exit_code"] == 0 and "exit status 0" in out
    assert res["tokens"] > 0 and res["freed_seconds"] < 1.0 and res["kv_after_abort"] == 0.0
    assert res["aborted"] == 1  # the request whose client left, and only it
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
