"""`python -m benchmarks.serving --data-parallel-size 2`: what replicas and their router buy, through HTTP.

What it is: the data-parallel figures of level 6 (level6_serving/router.py), in one process run,
every server a `python -m level6_serving` child with one torch thread per replica:

  1. `uniform`, every request at once, DP=1 against DP=N (`--data-parallel-size`): output
     tokens/s, in alternating order over `--repeats` (each layout's fastest kept);
  2. the `chat` workload replayed turn by turn (each conversation's next prompt is its last prompt,
     the answer the server gave, and the next user turn: so its history is in some replica's
     prefix cache; a turn's requests sent at once, in a seeded shuffled order), DP=N with
     round-robin routing against `--router` (default prefix-aware):
     prefill tokens the replicas computed (`vllm:prompt_tokens_total`, summed; a prefix hit is
     not computed), prefix-cache hits, and p50 TTFT over every turn.

`--stream-interval N` reaches every server on both sides (an event per N tokens after a choice's
first text: docs/scaling_out.md measures what it moves).

The answers' token ids come from the server's own `/tokenize` (the built-in models' byte-level
vocabulary turns text back into the same ids).

What it is not: a test (it reports ratios; nothing fails on a number), or a multi-machine figure:
on this 2-core CPU two replicas with one thread each use both cores, which is the whole gain.
"""

from __future__ import annotations

import asyncio
import math
import random

import httpx

from level6_serving.metrics import parse, value

from .serving_client import bench, run_requests, summarise
from .workloads import Request, make_workload


def counters(url: str) -> dict[str, float]:
    """The replicas' summed prefill tokens and prefix hits (or the one server's, for DP=1)."""
    s = parse(httpx.get(url + "/metrics", timeout=30).text)
    pick = lambda name: sum(v for k, v in s.items() if k.startswith(name) and 'replica="all"' in k) or value(s, name)  # noqa: E731
    return {"prompt_tokens": pick("vllm:prompt_tokens_total"), "prefix_hits": pick("vllm:prefix_cache_hits_total")}


def play_chat(url: str, wl, args) -> tuple[list, float]:
    """Every turn of every conversation, a turn's requests all at once; returns their results and seconds."""
    results, seconds, reqs = [], 0.0, list(wl.first)
    turns = [None, *wl.follow_ups]
    for t, turn in enumerate(turns):
        if turn is not None:  # prompt so far + the server's answer + the next user turn
            answers = [httpx.post(url + "/tokenize", json={"prompt": r.text, "add_special_tokens": False},
                                  timeout=60).json()["tokens"] for r in results[-len(reqs):]]  # fmt: skip
            reqs = [Request(q.prompt + a + user, n) for q, a, (user, n) in zip(reqs, answers, turn)]
        # Conversations do not take turns in the same order every time: a seeded shuffle per turn (in a
        # fixed order, round-robin would send each conversation to the same replica by accident, or never).
        order = random.Random(args.seed * 1000 + t).sample(range(len(reqs)), len(reqs))
        got, secs = asyncio.run(run_requests(url, None, [reqs[i] for i in order], math.inf, 1.0, args.seed + t, None,
                                             args.exact, args.timeout, keep_text=True))  # fmt: skip
        back = [None] * len(reqs)
        for i, res in zip(order, got):
            back[i] = res
        results += back
        seconds += secs
    return results, seconds


def run(args, console, flags: list[str]) -> dict:
    from level6_serving.process import ServerProcess

    from .roofline import Dims

    n, dp = args.num_prompts or (16 if args.quick else 64), args.data_parallel_size
    vocab = Dims.from_checkpoint(flags[flags.index("--model") + 1]).vocab
    uniform = make_workload("uniform", n, vocab, args.seed, quick=args.quick)
    chat = make_workload("chat", n, vocab, args.seed, quick=args.quick)
    flags = [*flags, "--threads", "1"]
    out = {"data_parallel_size": dp, "router": args.router, "uniform": {}, "chat": {}}

    console.rule(f"[bold]uniform, all at once: DP=1 against DP={dp}")
    best: dict[int, dict] = {}
    for rep in range(args.repeats):
        for size in (1, dp) if rep % 2 == 0 else (dp, 1):
            with ServerProcess([*flags, "--data-parallel-size", str(size)]) as server:
                bench(server.url, None, uniform.first[:2], math.inf, args)  # warm-up
                r = bench(server.url, None, uniform.first, math.inf, args)
            console.print(f"  DP={size}: {r['output_throughput']:.0f} output tok/s ({r['failed']} failed)")
            if size not in best or r["output_throughput"] > best[size]["output_throughput"]:
                best[size] = r
    out["uniform"] = {f"dp{k}": v for k, v in best.items()}
    out["uniform"]["ratio"] = best[dp]["output_throughput"] / best[1]["output_throughput"]

    other = args.router if args.router != "round-robin" else "prefix-aware"
    console.rule(f"[bold]chat, turn by turn, DP={dp}: round-robin against {other}")
    for policy in ("round-robin", other):
        with ServerProcess([*flags, "--data-parallel-size", str(dp), "--router", policy]) as server:
            before = counters(server.url)
            results, seconds = play_chat(server.url, chat, args)
            after = counters(server.url)
        s = summarise(results, seconds, args.percentiles, {})
        s.update({k: after[k] - before[k] for k in after})
        out["chat"][policy] = s
        console.print(f"  {policy}: {s['prompt_tokens']:.0f} prefill tokens computed, {s['prefix_hits']:.0f} from the "
                      f"cache, p50 TTFT {s['median_ttft_ms']:.0f} ms, {s['failed']} failed")  # fmt: skip
    rr, pa = out["chat"]["round-robin"], out["chat"][other]
    out["chat"]["prefill_ratio"] = pa["prompt_tokens"] / max(rr["prompt_tokens"], 1)
    out["chat"]["ttft_ratio"] = pa["median_ttft_ms"] / rr["median_ttft_ms"]
    console.print(f"[bold]DP={dp} against DP=1 on uniform: {out['uniform']['ratio']:.2f}x output tokens/s")
    console.print(f"[bold]{other} against round-robin on chat: prefill tokens {out['chat']['prefill_ratio']:.2f}x, "
                  f"p50 TTFT {out['chat']['ttft_ratio']:.2f}x")  # fmt: skip
    return out
