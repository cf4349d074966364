"""The serving benchmark's client: a workload replayed through HTTP at a request rate, and vLLM's figures.

What it is: the client side that `python -m benchmarks.serving` (serving.py: the command line and the
level-6 suite) and its data-parallel comparison (serving_dp.py) both drive: the arrival times (`arrival_times`),
one streamed `/v1/completions` request timed as it arrives (`send`), a list of them sent at their
arrival times (`run_requests`), and the summary over their results (`summarise`: TTFT, TPOT, ITL,
end-to-end latency, throughput, goodput). `bench` is one run of all three with the settings of
serving.py's command line.

What it is not: a command line (serving.py parses the flags), or anything that starts a server.

Reference: vLLM `benchmarks/benchmark_serving.py` (arrivals, metrics, goodput).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from dataclasses import dataclass, field

from .workloads import Request


# --- arrivals and one request ----------------------------------------------------------------------
def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent. Gaps are gamma-distributed with
    mean 1/rate; shape `burstiness` (1: a Poisson process; < 1 burstier, > 1 more regular)."""
    import numpy as np

    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    return list(np.cumsum(gaps) - gaps[0])


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds until the first chunk with text
    itls: list[float] = field(default_factory=list)  # gaps between chunks with text
    e2e: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""  # the answer, when asked for (keep_text): a conversation's next turn is built on it

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def post_streaming(url: str, payload: dict):
    """POST JSON, then yield the status code and the body's pieces as they arrive.

    Through `level6_serving.http_client.post`, a minimal HTTP/1.1 client that parses only the
    framing: httpx spends about 120 us of CPU per streamed chunk, so on a 2-core machine a client
    reading 100 streams would take CPU from the server it measures (vLLM's benchmark uses aiohttp's
    C parser for the same reason). With `OPENAI_API_KEY` set it sends `Authorization: Bearer <key>`,
    as vLLM's benchmark does (for a server started with `--api-key`)."""
    from level6_serving.http_client import post  # (here: importing level6_serving imports torch)

    key = os.environ.get("OPENAI_API_KEY")
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    answer = post(url, json.dumps(payload).encode(), headers)
    try:
        yield await anext(answer)  # the status
        await anext(answer)  # the headers
        async for piece in answer:
            yield piece
    finally:
        await answer.aclose()  # the connection closes when the caller stops reading, not when collected


EMPTY_TEXT = (b'"text": ""', b'"text":""')  # our server's JSON, and compact JSON (vLLM's)
NO_CHOICES = (b'"choices": []', b'"choices":[]')  # the usage chunk


async def send(url: str, model: str | None, req: Request, exact: bool, keep_text: bool = False) -> Result:
    """One streamed completion: TTFT at the first event with text, ITL between such events (and, with
    `keep_text`, the text itself: parsing every event costs the client CPU, so only when asked)."""
    body = {"prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    if model:
        body["model"] = model
    if exact:
        body.update(min_tokens=req.max_tokens, ignore_eos=True)
    res, t0, last, buf = Result(), time.perf_counter(), None, b""
    try:
        pieces = post_streaming(url, body)
        status = await anext(pieces)
        if status != 200:
            res.error = f"HTTP {status}: {b''.join([p async for p in pieces])[:200]!r}"
            return res
        async for piece in pieces:
            now = time.perf_counter()
            *events, buf = (buf + piece).split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: {"):
                    continue  # [DONE], comments
                if event.startswith(b'data: {"error"'):
                    res.error = json.loads(event[6:])["error"].get("message", "error event")
                    return res
                if any(k in event for k in NO_CHOICES):
                    usage = json.loads(event[6:]).get("usage") or {}
                    res.prompt_tokens, res.output_tokens = (
                        usage.get("prompt_tokens", 0),
                        usage.get("completion_tokens", 0),
                    )
                elif not any(k in event for k in EMPTY_TEXT):  # text: parse nothing, just note the time
                    if keep_text:
                        res.text += json.loads(event[6:])["choices"][0]["text"]
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itls.append(now - last)
                    last = now
        res.e2e, res.ok = time.perf_counter() - t0, last is not None
        res.error = "" if res.ok else "no text in the stream"
    except Exception as e:  # noqa: BLE001 - a failed request is a figure, not a crash
        res.error = repr(e)
    return res


async def run_requests(base_url: str, model: str | None, requests: list[Request], rate: float, burstiness: float,
                       seed: int, max_concurrency: int | None, exact: bool, timeout: float,
                       keep_text: bool = False) -> tuple[list[Result], float]:  # fmt: skip
    """Send every request at its arrival time (at most `max_concurrency` in flight); wait for all."""
    gate = asyncio.Semaphore(max_concurrency or len(requests))
    url = base_url.rstrip("/") + "/v1/completions"

    async def one(at: float, req: Request) -> Result:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        async with gate:
            try:
                return await asyncio.wait_for(send(url, model, req, exact, keep_text), timeout)
            except asyncio.TimeoutError:
                return Result(error=f"no answer within --timeout {timeout:g} s")

    start = time.perf_counter()
    times = arrival_times(len(requests), rate, burstiness, seed)
    results = await asyncio.gather(*(one(at, r) for at, r in zip(times, requests)))
    return list(results), time.perf_counter() - start


def summarise(results: list[Result], duration: float, percentiles: list[float], slo: dict[str, float]) -> dict:
    """vLLM's figures: throughput, and mean / median / percentiles of each latency, in ms."""
    import numpy as np

    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    series = {"ttft": [r.ttft for r in done], "tpot": [r.tpot for r in done if r.tpot is not None],
              "itl": [x for r in done for x in r.itls], "e2el": [r.e2e for r in done]}  # fmt: skip
    good = [r for r in done if all(getattr(r, "e2e" if k == "e2el" else k) is None
                                   or 1000 * getattr(r, "e2e" if k == "e2el" else k) <= v for k, v in slo.items())]  # fmt: skip
    s = {
        "completed": len(done), "failed": len(results) - len(done), "duration_s": duration,
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "request_throughput": len(done) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in done)) / duration,
        "output_tokens": out_tokens, "goodput": len(good) / duration if slo else None,
    }  # fmt: skip
    for name, xs in series.items():
        ms = 1000 * np.array(xs) if xs else np.array([float("nan")])
        s[f"mean_{name}_ms"], s[f"median_{name}_ms"] = float(ms.mean()), float(np.median(ms))
        for p in percentiles:
            s[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    return s


def bench(base_url: str, model: str | None, requests: list[Request], rate: float, args) -> dict:
    """One run at `rate`, and its summary. `args` is serving.py's parsed command line: its client flags
    (burstiness, seed, max_concurrency, exact, timeout, percentiles, goodput) are read here, not copied."""
    results, duration = asyncio.run(run_requests(base_url, model, requests, rate, args.burstiness, args.seed,
                                                 args.max_concurrency, args.exact, args.timeout))  # fmt: skip
    return {"request_rate": rate if math.isfinite(rate) else "inf", "num_prompts": len(requests),
            **summarise(results, duration, args.percentiles, args.goodput)}  # fmt: skip
