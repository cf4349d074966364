"""`python -m benchmarks.disagg`: disaggregated prefill and decode against colocated serving, on two cores.

What it is: the issue's comparison, every server a `python -m level6_serving` child. The workload
is the one disaggregation is for: `--decoders` requests with short prompts generate
`--decode-tokens` tokens each (streamed), and while they do, `--long` requests with
`--prompt-tokens`-token prompts arrive every `--gap` seconds (each wants a few tokens). Three
layouts of the same two cores:

    colocated   one server, two torch threads: a long prompt's prefill shares every step with the
                decodes (chunked prefill splits it into --max-num-batched-tokens pieces)
    dp          two servers, one thread and one core each, behind the data-parallel router
                (round-robin): a long prompt stalls the decodes of its replica only
    disagg      a prefill instance (core 0) and a decode instance (core 1), TCPConnectors, behind
                the proxy (level6_serving/disagg.py): the decodes never share a step with a prompt

Reported per layout: the decoding streams' inter-token latency (every gap between two chunks
with text, pooled; p50 and p99), the long prompts' time to first token, output tokens/s over the
run, and for `disagg` the KV moved per request (bytes and fetch time, from the decode instance's
/metrics). The client, the router and the proxy run in this process, on the same two cores.

What it is not: a GPU figure. On a GPU a prefill is compute-bound and a decode step memory-bound,
and the KV goes over NVLink or RDMA; here both are a CPU's, and the KV crosses a loopback socket.
The ratios say what separating the phases removes (the stall), not what a GPU pair would gain.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time

import httpx

from ladder.cli import LadderParser, nonneg_float, positive_int, save_json
from level6_serving.api_server import ServerThread
from level6_serving.disagg import build_disagg_app
from level6_serving.metrics import parse, value
from level6_serving.process import ServerProcess
from level6_serving.router import build_router_app

from .serving_client import send
from .workloads import Request

LAYOUTS = ("colocated", "dp", "disagg")


def parser() -> argparse.ArgumentParser:
    p = LadderParser(prog="python -m benchmarks.disagg", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default="tiny-shakespeare", help="the checkpoint every server loads")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--decoders", type=positive_int, default=4, help="streams decoding while the long prompts arrive")
    p.add_argument("--decode-tokens", type=positive_int, default=300, help="tokens each decoding stream generates")
    p.add_argument("--long", type=positive_int, default=10, help="long-prompt requests")
    p.add_argument("--prompt-tokens", type=positive_int, default=1500, help="each long prompt's length")
    p.add_argument("--gap", type=nonneg_float, default=0.2, help="seconds between two long prompts' arrivals")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048, help="every server's token budget")
    p.add_argument("--out", default=None, help="where the JSON goes (default: the output folder)")
    return p


def workload(args, vocab: int = 90) -> tuple[list[Request], list[Request]]:
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    decoders = [Request(ids(32), args.decode_tokens) for _ in range(args.decoders)]
    longs = [Request(ids(args.prompt_tokens), 4) for _ in range(args.long)]
    return decoders, longs


async def play(url: str, decoders: list[Request], longs: list[Request], gap: float):
    """The decoders at once, the long prompts from 0.3 s on, every `gap` s -> (results, results, seconds)."""

    async def later(at: float, req: Request):
        await asyncio.sleep(at)
        return await send(url + "/v1/completions", None, req, exact=True)

    t0 = time.perf_counter()
    both = await asyncio.gather(*(send(url + "/v1/completions", None, r, exact=True) for r in decoders),
                                *(later(0.3 + i * gap, r) for i, r in enumerate(longs)))  # fmt: skip
    return both[: len(decoders)], both[len(decoders) :], time.perf_counter() - t0


def server(args, threads: int, cores: set[int] | None, kv: dict | None = None) -> ServerProcess:
    flags = ["--model", args.model, "--max-model-len", str(args.prompt_tokens + 64), "--threads", str(threads),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--enforce-eager"]  # fmt: skip
    if kv is not None:
        flags += ["--kv-transfer-config", json.dumps(kv)]
    return ServerProcess(flags, cpus=cores)


def percentile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else (xs[0] if xs else 0.0)


def measure(layout: str, args) -> dict:
    decoders, longs = workload(args)
    procs, moved = [], {}
    try:
        if layout == "colocated":
            procs = [server(args, 2, None).start()]
            front = None
        else:
            kinds = [None, None] if layout == "dp" else [{"kv_connector": "TCPConnector", "kv_role": role, "kv_port": 0}
                                                         for role in ("kv_producer", "kv_consumer")]  # fmt: skip
            cores = sorted(os.sched_getaffinity(0))
            pins = [{cores[0]}, {cores[1]}] if len(cores) >= 2 else [None, None]
            procs = [server(args, 1, pin, kv).start() for pin, kv in zip(pins, kinds)]
            urls = [p.url for p in procs]
            front = build_router_app(urls, "round-robin") if layout == "dp" else build_disagg_app(urls[:1], urls[1:])
        with ServerThread(front) if front is not None else _Nothing(procs[0].url) as url:
            asyncio.run(play(url, decoders[:1], longs[:1], 0.0))  # warm both paths (first requests are slower)
            before = parse(httpx.get(procs[-1].url + "/metrics").text)
            dec, lng, seconds = asyncio.run(play(url, decoders, longs, args.gap))
            after = parse(httpx.get(procs[-1].url + "/metrics").text)
        if layout == "disagg":
            n = len(decoders) + len(longs)
            moved = {name: (value(after, f"ladder:kv_transfer_{name}_total") - value(before, f"ladder:kv_transfer_{name}_total")) / n
                     for name in ("bytes", "seconds")}  # fmt: skip
    finally:
        for p in procs:
            p.stop(timeout=30)
    failed = [r.error for r in dec + lng if not r.ok]
    if failed:
        raise SystemExit(f"{layout}: {len(failed)} requests failed, the first: {failed[0]}")
    itl = [g for r in dec for g in r.itls]
    ttft = [r.ttft for r in lng]
    return {"layout": layout, "itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p99_ms": 1e3 * percentile(itl, 99),
            "itl_max_ms": 1e3 * max(itl), "stalls_over_100ms": sum(g > 0.1 for g in itl), "gaps": len(itl),
            "long_ttft_p50_s": percentile(ttft, 50), "long_ttft_max_s": max(ttft),
            "decoder_ttft_p50_s": percentile([r.ttft for r in dec], 50),
            "output_tok_s": sum(r.output_tokens for r in dec + lng) / seconds, "seconds": seconds,
            "kv_bytes_per_request": moved.get("bytes"), "kv_fetch_ms_per_request": 1e3 * moved.get("seconds", 0.0)}  # fmt: skip


class _Nothing:
    """`with` over a URL that needs no front end."""

    def __init__(self, url: str):
        self.url = url

    def __enter__(self) -> str:
        return self.url

    def __exit__(self, *exc) -> None:
        pass


def main(argv=None) -> dict:
    from rich.console import Console
    from rich.table import Table

    args = parser().parse_args(argv)
    layouts = [x.strip() for x in args.layouts.split(",")]
    if unknown := [x for x in layouts if x not in LAYOUTS]:
        parser().error(f"argument --layouts: unknown {', '.join(unknown)}; known: {', '.join(LAYOUTS)}")
    console = Console(width=140)
    console.print(f"{args.decoders} streams of {args.decode_tokens} tokens; {args.long} prompts of {args.prompt_tokens} "
                  f"tokens arriving every {args.gap:g} s; {args.model}, two cores")
    rows = []
    for layout in layouts:
        console.print(f"  {layout} ...")
        rows.append(measure(layout, args))
    base = rows[0]
    table = Table("layout", "ITL p50 ms", "ITL p99 ms", f"p99 / {base['layout']}", "gaps > 100 ms", "long TTFT p50 s",
                  "output tok/s", "KV per request")  # fmt: skip
    for r in rows:
        kv = "" if r["kv_bytes_per_request"] is None else \
            f"{r['kv_bytes_per_request'] / 1e6:.2f} MB, {r['kv_fetch_ms_per_request']:.1f} ms"  # fmt: skip
        table.add_row(r["layout"], f"{r['itl_p50_ms']:.1f}", f"{r['itl_p99_ms']:.1f}",
                      f"{r['itl_p99_ms'] / base['itl_p99_ms']:.2f}x", f"{r['stalls_over_100ms']} of {r['gaps']}",
                      f"{r['long_ttft_p50_s']:.2f}",
                      f"{r['output_tok_s']:.0f}", kv)  # fmt: skip
    console.print(table)
    if args.out is None:
        save_json({"args": vars(args), "rows": rows}, "disagg.json")
    else:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return {"args": vars(args), "rows": rows}


if __name__ == "__main__":
    main()
