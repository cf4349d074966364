"""Lab 6's experiment: latency against request rate, through HTTP, with your server code.

    python -m labs experiment 6 YOUR_FILE [--rates 1 2 4 8 inf] [--num-prompts 32] [--workload shared-prefix]

What it is: `python -m level6_serving` with *your* `serving.py`, in a server process of its
own (the swap reaches it: labs/site/sitecustomize.py), and `benchmarks.serving`'s
client against it, once per request rate (Poisson arrivals; `inf` sends everything at
once). One table row per rate: requests done and failed, time to first token (p50,
p99), time per output token (p50), inter-token latency (p99), end-to-end latency (p50)
and output tokens/s. The server's log and the client's JSON live in a temporary folder,
removed when the experiment ends (the log's path is printed, to follow it while it runs).

What it is not: the level-6 benchmark suite (`python -m benchmarks.serving` without
`--base-url` compares server configurations against level 2's capacity).

Reference: vLLM `benchmarks/benchmark_serving.py`; docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

from ladder.cli import LadderParser, positive_int
from ladder.models import default_model


def rate(text: str) -> float:
    from benchmarks.serving import rate as parse

    return parse(text)


def parser() -> argparse.ArgumentParser:
    p = LadderParser(prog="python -m labs experiment 6 YOUR_FILE", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None, help="checkpoint or built-in name (default: the built-in model)")
    p.add_argument("--rates", type=rate, nargs="+", default=[1.0, 2.0, 4.0, 8.0, math.inf],
                   help="requests per second, or inf (default 1 2 4 8 inf)")  # fmt: skip
    p.add_argument("--num-prompts", type=positive_int, default=32, help="requests per rate (default 32)")
    p.add_argument("--workload", default="shared-prefix", choices=["uniform", "spread", "shared-prefix", "latency"])
    p.add_argument("--quick", action="store_true", help="the workload's lengths about 8-16x shorter (a smoke run)")
    return p


def main(argv=None) -> list[dict]:
    args = parser().parse_args(argv)
    from benchmarks import serving as bench
    from level6_serving.process import ServerProcess  # under a lab's swap it starts your serving.py (labs/site)

    model = str(args.model or default_model())
    # -1: every position, as benchmarks.serving's servers (shared-prefix prompts pass the tokenizer's 256-token window)
    flags = ["--model", model, "--max-model-len", "-1", "--disable-uvicorn-access-log", "--log-level", "warning"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="lab6-") as tmp, ServerProcess(flags, Path(tmp) / "server.log") as server:
        print(f"server up at {server.url} (log, while it runs: {server.log})", flush=True)
        out = Path(tmp) / "run.json"
        for r in args.rates:
            argv = ["--base-url", server.url, "--workload", args.workload, "--num-prompts", str(args.num_prompts),
                    "--request-rate", str(r), "--out", str(out), *(["--quick"] if args.quick else [])]  # fmt: skip
            bench.main(argv)
            rows.append(json.loads(out.read_text())["run"])
    print(f"\n{args.num_prompts} {args.workload} requests per rate, streamed through HTTP; model {model}")
    print(f"{'rate':>6} {'done':>5} {'failed':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'ITL p99':>8} "
          f"{'E2E p50':>8} {'out tok/s':>9}")  # fmt: skip
    for s in rows:
        print(f"{str(s['request_rate']):>6} {s['completed']:>5} {s['failed']:>6} {s['median_ttft_ms']:>7.0f}ms "
              f"{s['p99_ttft_ms']:>7.0f}ms {s['median_tpot_ms']:>7.1f}ms {s['p99_itl_ms']:>6.1f}ms "
              f"{s['median_e2el_ms']:>6.0f}ms {s['output_throughput']:>9.0f}")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
