"""Lab 6d's experiment: what a server's beam search costs, and what the prefix cache saves it.

    python -m labs experiment 6d YOUR_FILE [--widths 1 2 4 8] [--max-tokens 64] [--prompt TEXT]

What it is: `python -m level6_serving` with *your* `beam_search.py`, in a server process of its
own (the swap reaches it: labs/site/sitecustomize.py), and one `"use_beam_search": true` request
per beam width, after a greedy request of the same length. A one-token request goes first, not
shown: it warms the server up and puts the prompt's full blocks in the prefix cache, so every row
starts from the same cache. For each row the server's own
counters (`/metrics`, read before and after) say how many engine requests it ran, how many
prompt tokens those held, how many of them the prefix cache supplied and how many the engine
computed; beside them the wall time and the start of the best answer.

What it is not: a benchmark (one request per row, one run: the seconds are an indication) or a
test of your code (the checks are).

Reference: docs/level6_serving.md, "Beam search"; vLLM `vllm/engine/protocol.py`
(`EngineClient.beam_search`).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from ladder.cli import LadderParser, positive_int
from ladder.models import default_model

COUNTERS = {  # column: the server's counter (a delta per row)
    "requests": "vllm:request_success_total",
    "prompt tokens": "vllm:prefix_cache_queries_total",
    "from cache": "vllm:prefix_cache_hits_total",
    "computed": "vllm:prompt_tokens_total",
}


def parser() -> argparse.ArgumentParser:
    p = LadderParser(prog="python -m labs experiment 6d YOUR_FILE", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None, help="checkpoint or built-in name (default: the built-in model)")
    p.add_argument("--widths", type=positive_int, nargs="+", default=[1, 2, 4, 8],
                   help="beam widths, one search each (at most 10; default 1 2 4 8)")  # fmt: skip
    p.add_argument("--max-tokens", type=positive_int, default=64, help="tokens per hypothesis (default 64)")
    p.add_argument("--prompt", default="ROMEO:\nBut soft, what light", help="the prompt of every row")
    return p


def main(argv=None) -> list[dict]:
    p = parser()
    args = p.parse_args(argv)
    if max(args.widths) > 10:
        p.error("argument --widths: the server searches at most 10 beams (n <= 10)")
    import httpx

    from level6_serving.metrics import parse, value
    from level6_serving.process import ServerProcess  # under a lab's swap it runs your beam_search.py (labs/site)

    model = str(args.model or default_model())
    flags = ["--model", model, "--disable-uvicorn-access-log", "--log-level", "warning"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="lab6d-") as tmp, ServerProcess(flags, Path(tmp) / "server.log") as server:
        print(f"server up at {server.url} (log, while it runs: {server.log})", flush=True)

        def counters() -> dict[str, float]:
            samples = parse(httpx.get(server.url + "/metrics", timeout=30).text)
            return {col: value(samples, name) for col, name in COUNTERS.items()}

        def row(label: str, extra: dict) -> dict:
            before, t0 = counters(), time.perf_counter()
            r = httpx.post(server.url + "/v1/completions", timeout=600, json={
                "prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": 0, **extra})  # fmt: skip
            seconds = time.perf_counter() - t0
            r.raise_for_status()
            after = counters()
            out = {"row": label, **{col: int(after[col] - before[col]) for col in COUNTERS}, "seconds": seconds,
                   "best": r.json()["choices"][0]["text"]}  # fmt: skip
            print(f"  {label}: {out['requests']} engine requests, {out['seconds']:.2f} s", flush=True)
            return out

        httpx.post(server.url + "/v1/completions", timeout=600,
                   json={"prompt": args.prompt, "max_tokens": 1, "temperature": 0}).raise_for_status()  # fmt: skip
        rows.append(row("greedy", {}))
        for w in args.widths:
            rows.append(row(f"beam {w}", {"n": w, "use_beam_search": True}))

    print(f"\nprompt {args.prompt!r}, {args.max_tokens} tokens per answer; model {model}")
    print(f"{'row':>8} {'requests':>9} {'prompt tokens':>14} {'from cache':>16} {'computed':>9} {'seconds':>8}  "
          "best answer")  # fmt: skip
    for r in rows:
        share = r["from cache"] / r["prompt tokens"] if r["prompt tokens"] else 0.0
        print(f"{r['row']:>8} {r['requests']:>9} {r['prompt tokens']:>14} {r['from cache']:>9} ({share:>4.0%})"
              f" {r['computed']:>9} {r['seconds']:>8.2f}  {r['best'][:32]!r}")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
