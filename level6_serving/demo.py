"""`python -m level6_serving.demo`: start the server, talk to it with the `openai` client, read /metrics.

What it is: what a user of level 6 does, in one run of well under a minute on a laptop CPU:

  1. start `python -m level6_serving` on a free port (a real process, as you would);
  2. stream one chat answer, printed as the chunks arrive, with its time to first token;
  3. stream `--clients` completions at once (`AsyncOpenAI`), and draw when each chunk of
     each stream arrived: the engine batches them step by step, so the streams advance
     together, and short ones leave early (a picture, outside the repository by default;
     `--plot PATH` to choose);
  4. open a long stream (nearly the whole context) and walk away after a few chunks: /metrics
     shows the request aborted and its KV blocks free;
  5. read the Prometheus counters, and check that they add up to what the clients received;
  6. send SIGTERM: the server drains and exits 0. Nothing is left running, whatever happens,
     and its log (a scratch file) is removed with it. The last lines say how to start a
     server of your own (the demo's is gone by then) and send it a request.

What it is not: a benchmark (`python -m benchmarks.serving` is).

Reference: the OpenAI Python client's streaming API; vLLM's `vllm serve` quickstart.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ladder.cli import (
    demo_parser,
    int_at_least,
    parse_demo_args,
    plot_flag,
    plot_path,
    positive_int,
    prompts_for,
    save_figure,
)

from .metrics import aborted, parse, value
from .process import ServerProcess

MODULE = "level6_serving.demo"
ABORT_TIMEOUT = 30.0  # seconds step 3 waits for the abandoned request to stop running
SHOW_CLIENTS = 16  # rows of the clients table; more would scroll the rest of the demo away
START = "to try it yourself, start a server that stays up (port 8000, until Ctrl-C): python -m level6_serving"
CURL = ("and send it a request from another terminal: curl http://127.0.0.1:8000/v1/completions "
        "-H \"Content-Type: application/json\" -d '{\"prompt\": \"ROMEO:\\n\", \"max_tokens\": 32}'")  # fmt: skip


def parser():
    p = demo_parser(__doc__, MODULE)
    p.add_argument("--clients", type=positive_int, default=16, help="concurrent streaming clients (default 16)")
    p.add_argument("--max-model-len", type=int_at_least(64), default=512,
                   help="the server's context length; the abandoned stream asks for nearly all of it (default 512)")  # fmt: skip
    plot_flag(p, "level6_streams.png", "the stream timeline")
    p.set_defaults(max_tokens=48)
    return p


def main(argv=None) -> dict:
    args = parse_demo_args(parser(), argv)
    args.plot = plot_path(args.plot, "level6_streams.png")
    console = Console()
    flags = ["--dtype", args.dtype, "--device", args.device, "--threads", str(args.threads), "--seed", str(args.seed),
             "--max-model-len", str(args.max_model_len), "--disable-uvicorn-access-log"] + (["--model", args.model] if args.model else [])  # fmt: skip
    server = ServerProcess(flags)
    console.print(f"[bold]$ python -m level6_serving --port 0 {' '.join(flags)}[/]\n"
                  f"(log, removed when the server stops: {server.log})")  # fmt: skip
    with server:
        console.print(f"server up at {server.url}\n")
        result = asyncio.run(talk(server.url, args, console))
        console.print("\n[bold]SIGTERM[/]: the server drains and exits")
    result["exit_code"] = server.returncode
    console.print(f"exit status {server.returncode}; last log line: {server.tail().strip().splitlines()[-1]}")
    # The demo's server is gone: point at one the reader starts, never at the stopped one's URL.
    for line in (START, CURL):
        console.print(line, markup=False, highlight=False, soft_wrap=True)  # unbroken: copied whole
    return result


async def talk(url: str, args, console: Console) -> dict:
    import httpx
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="not-needed", max_retries=0)
    http = httpx.AsyncClient(base_url=url, timeout=60)
    model = (await client.models.list()).data[0].id
    before = parse((await http.get("/metrics")).text)

    # 1. one chat answer, streamed
    console.rule("[bold]1. a streamed chat answer")
    t0, ttft = time.perf_counter(), None
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Speak, what news?"}], max_tokens=args.max_tokens,
        temperature=args.temperature, seed=args.seed, stream=True)  # fmt: skip
    async for chunk in stream:
        text = chunk.choices[0].delta.content if chunk.choices else None
        if text:
            ttft = ttft or time.perf_counter() - t0
            console.print(text, end="", style="green", soft_wrap=True, markup=False, highlight=False)
    console.print(f"\n[dim](time to first token {1000 * (ttft or 0):.0f} ms)[/]")

    # 2. many clients at once
    console.rule(f"[bold]2. {args.clients} streaming clients at once")
    arrivals: list[list[float]] = [[] for _ in range(args.clients)]
    lengths = [
        args.max_tokens // 4 + (i * 7) % (args.max_tokens - args.max_tokens // 4 + 1) for i in range(args.clients)
    ]

    async def one(i: int, prompt: str) -> tuple[int, str]:
        s = await client.completions.create(model=model, prompt=prompt, max_tokens=lengths[i], stream=True,
                                            temperature=args.temperature, seed=args.seed + i,
                                            stream_options={"include_usage": True})  # fmt: skip
        text, used = "", 0
        async for chunk in s:
            if chunk.choices and chunk.choices[0].text:
                arrivals[i].append(time.perf_counter() - t0)
                text += chunk.choices[0].text
            if chunk.usage:
                used = chunk.usage.completion_tokens
        return used, text

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts_for(args.clients))))
    wall = time.perf_counter() - t0
    tokens = sum(n for n, _ in results)
    console.print(client_table(results, arrivals))
    console.print(f"{tokens} tokens to {args.clients} clients in {wall:.2f} s: [bold]{tokens / wall:.0f} tokens/s[/]")
    draw(arrivals, args.plot)
    console.print(f"timeline of every chunk: {args.plot}")

    # 3. a client that walks away
    console.rule("[bold]3. a client that disconnects mid-answer")
    aborted_before = aborted(parse((await http.get("/metrics")).text))
    long = args.max_model_len - 32  # the prompt is a dozen tokens
    body = {"model": model, "prompt": "KING LEAR:\n", "max_tokens": long, "stream": True, "ignore_eos": True}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        seen = 0
        async for line in r.aiter_lines():
            seen += line.startswith("data: ")
            if seen == 5:
                running = value(parse((await http.get("/metrics")).text), "vllm:num_requests_running")
                console.print(f"after 5 chunks: vllm:num_requests_running = {running:.0f}; closing the connection")
                break
    t_close = time.perf_counter()
    while value(parse((await http.get("/metrics")).text), "vllm:num_requests_running") > 0:
        if time.perf_counter() - t_close > ABORT_TIMEOUT:  # a demo that hangs teaches nothing: say what broke
            raise RuntimeError(f"the disconnected request was still running {ABORT_TIMEOUT:.0f} s after its "
                               "client left: the server did not abort it (see the server log)")  # fmt: skip
        await asyncio.sleep(0.005)
    freed = time.perf_counter() - t_close
    after_abort = parse((await http.get("/metrics")).text)
    kv, gone = value(after_abort, "vllm:kv_cache_usage_perc"), aborted(after_abort) - aborted_before
    console.print(f"{1000 * freed:.0f} ms later: running = 0, vllm:kv_cache_usage_perc = {kv:.3f} (blocks free); "
                  f"requests finished as aborted: {gone:.0f} (of {long} tokens asked for)")  # fmt: skip

    # 4. the counters add up
    console.rule("[bold]4. /metrics")
    after = parse((await http.get("/metrics")).text)
    rows = ["vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
            "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total",
            "vllm:time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_sum"]  # fmt: skip
    table = Table("series", "value")
    for name in rows:
        table.add_row(name, f"{value(after, name):g}")
    console.print(table)
    gen = value(after, "vllm:generation_tokens_total") - value(before, "vllm:generation_tokens_total")
    console.print(f"generation tokens counted by the server: {gen:.0f} (the {args.clients} clients received "
                  f"{tokens}, plus the chat answer and the abandoned stream)")  # fmt: skip
    await http.aclose()
    await client.close()
    return {"tokens": tokens, "tokens_per_s": tokens / wall, "freed_seconds": freed, "kv_after_abort": kv,
            "aborted": gone, "generation_tokens_counted": gen}  # fmt: skip


def client_table(results: list[tuple[int, str]], arrivals: list[list[float]], limit: int = SHOW_CLIENTS) -> Table:
    """One row per client, at most `limit`; the title says how many of how many are shown."""
    n = len(results)
    title = f"all {n} clients" if n <= limit else f"the first {limit} of {n} clients (the rest are in the picture)"
    table = Table("client", "TTFT", "tokens", "text (start)", title=title)
    for i, (used, text) in enumerate(results[:limit]):
        table.add_row(str(i), f"{1000 * arrivals[i][0]:.0f} ms" if arrivals[i] else "-", str(used), repr(text[:40]))
    return table


def draw(arrivals: list[list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.25 * len(arrivals) + 1.5))
    for i, times in enumerate(arrivals):
        ax.plot(times, [i] * len(times), "|", markersize=6, color="tab:blue")
        if times:
            ax.plot([0, times[0]], [i, i], color="tab:orange", linewidth=1)  # waiting for the first token
    ax.set_xlabel("seconds since the clients started")
    ax.set_ylabel("client")
    ax.set_title("each mark: one streamed chunk (orange: time to first token)")
    save_figure(fig, path)


if __name__ == "__main__":
    main()
