"""`python -m benchmarks.serving`: latency and throughput through HTTP, vLLM's benchmark_serving way.

What it is: a client (`serving_client.py`) that replays a workload (`workloads.py`: the same
seeded token-id prompts and exact output lengths as the offline harness) against an
OpenAI-compatible `/v1/completions`, streaming, with arrivals at a request rate (Poisson, or
gamma with `--burstiness`), and reports vLLM's figures: TTFT (until the first chunk with
text), TPOT, ITL (between chunks), end-to-end latency (mean, p50, p90, p99), request and
token throughput, and goodput under an SLO (`--goodput ttft:500 tpot:50`, milliseconds).

    python -m benchmarks.serving --base-url http://localhost:8000 --model tiny-shakespeare \\
        --workload shared-prefix --num-prompts 64 --request-rate 4     # one run, any server
    python -m benchmarks.serving                                       # the issue's figures (minutes)
    python -m benchmarks.serving --quick                               # the same, tiny (about a minute)
    python -m benchmarks.serving --data-parallel-size 2                # replicas and their router (serving_dp.py)

Without `--base-url` it runs the level-6 suite, every figure in one process run:

  1. offline references (in this process, before any server starts): level 2's capacity
     on the shared-prefix workload (requests/s with everything queued at once: a rate
     above it saturates level 2), and the level-6 engine's offline tokens/s on `uniform`;
  2. for each server configuration (prefix caching on/off x speculation off/on, each a
     `python -m level6_serving` child process, so the client never shares its GIL), the
     shared-prefix workload at request rates that are multiples of level 2's capacity;
  3. with caching on: `uniform` all at once (HTTP tokens/s against the offline figure),
     and 100 concurrent streams (errors, p99 ITL).

It writes JSON and a plot of latency against request rate outside the repository
(`ladder.cli.output_dir()`, or `--out` / `--plot`) and prints the performance goals with
what was measured. Output lengths are exact (`min_tokens = max_tokens`, `ignore_eos`:
vLLM's extensions; a server without them gets `--no-exact-lengths`). A server started with
`--api-key` needs `OPENAI_API_KEY` set to the key, as vLLM's benchmark does.

What it is not: a test. Nothing fails because of a number; on a shared machine the
absolute figures drift, so compare the ratios of one run.

Reference: vLLM `benchmarks/benchmark_serving.py` (arrivals, metrics, goodput).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from ladder.cli import LadderParser, check_device_and_models, nonneg_int, output_dir, positive_float, positive_int

from .serving_client import bench
from .workloads import make_workload

WORKLOADS = ("uniform", "spread", "shared-prefix", "latency")  # chat's later turns need the answers: not replayed
CONFIGS = ("cache", "nocache", "cache+spec", "nocache+spec")
SLO_KEYS = ("ttft", "tpot", "e2el")


# --- the level-6 suite --------------------------------------------------------------------------------
def suite(args, console) -> dict:
    import torch

    from ladder.models import BUILTIN, BUILTIN_DRAFT, default_model
    from level6_serving.process import ServerProcess

    from .engines import make_engine
    from .roofline import Dims
    from .throughput import machine_info

    torch.set_num_threads(args.threads)
    model = str(args.model or default_model())
    draft = args.draft_model or (str(BUILTIN_DRAFT) if Path(model).resolve() == BUILTIN.resolve() else None)
    spec = {"num_speculative_tokens": 4, **({"model": draft} if draft else {"method": "ngram", "prompt_lookup_max": 4})}
    vocab, q = Dims.from_checkpoint(model).vocab, args.quick
    n = args.num_prompts or (16 if q else 64)
    prefix_wl = make_workload("shared-prefix", n, vocab, args.seed, quick=q)
    uniform_wl = make_workload("uniform", n, vocab, args.seed, quick=q)
    many_wl = make_workload("uniform", 100, vocab, args.seed + 1, quick=q)
    kv = args.kv_cache_memory
    common = dict(dtype=args.dtype, device=args.device, kv_cache_memory=kv, max_num_seqs=args.max_num_seqs,
                  hf_batch_size=1, seed=args.seed, progress=False)  # fmt: skip
    data = {"schema": 1, "machine": machine_info(torch.device("cpu")), "model": model, "speculative_config": spec,
            "command": " ".join(["python -m benchmarks.serving", *args.argv]), "quick": q, "runs": {}}  # fmt: skip

    console.print(f"[bold]offline references[/] ({model}, {args.threads} torch thread(s), KV {kv >> 20} MiB)")
    level2 = make_engine("level2_continuous", model, **common)
    level2.warmup()
    res = level2.run(prefix_wl)
    served_offline = OfflineLevel6(model, uniform_wl, args)
    refs = {"level2_continuous": reference(prefix_wl, res.duration, sum(r["output_len"] for r in res.records)),
            "level6_serving": served_offline.run()}  # fmt: skip
    for name, ref in refs.items():
        console.print(f"  {name} on {ref['workload']}: {ref['requests_per_s']:.2f} req/s, "
                      f"{ref['output_tokens_per_s']:.0f} output tok/s")  # fmt: skip
    data["offline"] = refs
    capacity = refs["level2_continuous"]["requests_per_s"]
    rates = [m * capacity for m in args.rate_multiples]
    data["level2_capacity_rps"], data["rates"] = capacity, rates

    flags = server_flags(args, model) + ["--threads", str(args.threads)]
    for cfg in args.configs:
        extra = (["--no-enable-prefix-caching"] if cfg.startswith("nocache") else []) + (
            ["--speculative-config", json.dumps(spec)] if cfg.endswith("+spec") else [])  # fmt: skip
        console.rule(f"[bold]server: {cfg}")
        with ServerProcess(flags + extra) as server:
            bench(server.url, None, prefix_wl.first[:2], math.inf, args)  # warm-up (and the shared prefix, cached)
            runs = []
            for rate in rates:
                runs.append(bench(server.url, None, prefix_wl.first, rate, args))
                console.print(f"  shared-prefix at {rate:.2f} req/s: p50 TTFT {runs[-1]['median_ttft_ms']:.0f} ms, "
                              f"p50 TPOT {runs[-1]['median_tpot_ms']:.1f} ms, {runs[-1]['failed']} failed")  # fmt: skip
            data["runs"][cfg] = {"shared-prefix": runs}
            if cfg == "cache":
                # Offline and HTTP in turns while this server idles or works: a neighbour's load
                # hits both alike; the fastest of each is the least disturbed (timeit's reasoning).
                tries = []
                for rep in range(args.repeats):
                    if rep % 2 == 0:
                        off = served_offline.run()
                        http = bench(server.url, None, uniform_wl.first, math.inf, args)
                    else:
                        http = bench(server.url, None, uniform_wl.first, math.inf, args)
                        off = served_offline.run()
                    tries.append((off, http))
                refs["level6_serving"] = max((t[0] for t in tries), key=lambda r: r["output_tokens_per_s"])
                over = max((t[1] for t in tries), key=lambda r: r["output_throughput"])
                over["repeats"] = [[a["output_tokens_per_s"], b["output_throughput"]] for a, b in tries]
                many = bench(server.url, None, many_wl.first, math.inf, args)
                data["runs"][cfg].update(overhead=over, streams_100=many)
                console.print(
                    f"  uniform, all at once: {over['output_throughput']:.0f} output tok/s over HTTP, "
                    f"{refs['level6_serving']['output_tokens_per_s']:.0f} offline (fastest of {args.repeats})"
                )
                console.print(f"  100 concurrent streams: {many['failed']} failed, p99 ITL {many['p99_itl_ms']:.1f} ms")
        console.print(f"  server exit status {server.returncode}")
    data["goals"] = goals(data)
    return data


def server_flags(args, model: str) -> list[str]:
    """The flags every suite server gets (the offline references use the same settings)."""
    return ["--model", model, "--dtype", args.dtype, "--device", args.device, "--kv-cache-memory",
            str(args.kv_cache_memory), "--max-num-seqs", str(args.max_num_seqs), "--seed", str(args.seed),
            "--max-model-len", "-1",  # as offline: every position (the workloads pass the 256-token window)
            "--stream-interval", str(args.stream_interval),
            "--disable-uvicorn-access-log", "--log-level", "warning"]  # fmt: skip


def reference(wl, seconds: float, output_tokens: int) -> dict:
    return {"workload": wl.name, "seconds": seconds, "requests_per_s": len(wl.first) / seconds,
            "output_tokens_per_s": output_tokens / seconds}  # fmt: skip


class OfflineLevel6:
    """The served engine, offline: the same requests, all at once, through `LLM.generate`."""

    def __init__(self, model: str, wl, args):
        from level6_serving import LLM, SamplingParams

        self.wl = wl
        self.llm = LLM(model, dtype=args.dtype, device=args.device, kv_cache_memory=args.kv_cache_memory,
                       max_num_seqs=args.max_num_seqs, seed=args.seed, max_model_len=-1)  # as served  # fmt: skip
        self.params = [SamplingParams(max_tokens=r.max_tokens, min_tokens=r.max_tokens, ignore_eos=True,
                                      temperature=0) for r in wl.first]  # fmt: skip
        self.llm.generate([r.prompt for r in wl.first[:4]], self.params[:4], progress=False)  # warm-up

    def run(self) -> dict:
        t0 = time.perf_counter()
        outs = self.llm.generate([r.prompt for r in self.wl.first], self.params, progress=False)
        return reference(self.wl, time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs))


def goals(data: dict) -> list[dict]:
    runs, rates = data["runs"], data["rates"]
    out = []
    if "cache" in runs and "nocache" in runs:
        i = max(range(len(rates)), key=lambda j: rates[j])  # the highest rate: the most saturated
        on, off = runs["cache"]["shared-prefix"][i], runs["nocache"]["shared-prefix"][i]
        ratio = on["median_ttft_ms"] / off["median_ttft_ms"]
        out.append({"goal": f"p50 TTFT, caching on / off, shared-prefix at {rates[i]:.2f} req/s "
                            f"({rates[i] / data['level2_capacity_rps']:.2f}x level 2's capacity)",
                    "measured": ratio, "target": "<= 0.3", "met": ratio <= 0.3})  # fmt: skip
    if "cache" in runs:
        ratio = (
            runs["cache"]["overhead"]["output_throughput"] / data["offline"]["level6_serving"]["output_tokens_per_s"]
        )
        out.append({"goal": "HTTP streaming tok/s / offline engine tok/s (uniform)", "measured": ratio,
                    "target": ">= 0.85", "met": ratio >= 0.85})  # fmt: skip
        many = runs["cache"]["streams_100"]
        out.append({"goal": f"100 concurrent streams: failures (p99 ITL {many['p99_itl_ms']:.1f} ms)",
                    "measured": many["failed"], "target": "0", "met": many["failed"] == 0})  # fmt: skip
    return out


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ladder.cli import save_figure

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    cap = data["level2_capacity_rps"]
    for cfg, runs in data["runs"].items():
        xs = [r["request_rate"] / cap for r in runs["shared-prefix"]]
        for ax, key in zip(axes, ("median_ttft_ms", "median_tpot_ms", "p99_itl_ms")):
            ax.plot(xs, [r[key] for r in runs["shared-prefix"]], "o-", label=cfg)
    for ax, title in zip(axes, ("p50 TTFT (ms)", "p50 TPOT (ms)", "p99 ITL (ms)")):
        ax.set_title(title)
        ax.set_xlabel("request rate / level 2's capacity")
        ax.set_yscale("log")
        ax.axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
    axes[0].legend()
    fig.suptitle(f"shared-prefix through HTTP (level 2 saturates at {cap:.2f} req/s)")
    save_figure(fig, path)


def print_run(console, s: dict, percentiles: list[float]) -> None:
    from rich.table import Table

    t = Table(title=f"{s['num_prompts']} requests at {s['request_rate']} req/s: {s['completed']} done, "
                    f"{s['failed']} failed in {s['duration_s']:.1f} s")  # fmt: skip
    cols = ["mean", "median", *(f"p{p:g}" for p in percentiles)]
    for col in ["metric", *cols]:
        t.add_column(col, justify="left" if col == "metric" else "right")
    for name in ("ttft", "tpot", "itl", "e2el"):
        t.add_row(f"{name} (ms)", *(f"{s[f'{c}_{name}_ms']:.1f}" for c in cols))
    console.print(t)
    goodput = "" if s["goodput"] is None else f", goodput {s['goodput']:.2f} req/s"
    console.print(f"request throughput {s['request_throughput']:.2f} req/s, output {s['output_throughput']:.0f} "
                  f"tok/s, total {s['total_token_throughput']:.0f} tok/s{goodput}")  # fmt: skip
    for e in s["errors"]:
        console.print(f"[red]error:[/] {e}")


# --- the command line ---------------------------------------------------------------------------------
def rate(text: str) -> float:
    if text.strip().lower() == "inf":
        return math.inf
    return positive_float(text)


def number_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(not 0 < v < math.inf for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of positive numbers")
    return values


def percentile_list(text: str) -> list[float]:
    values = number_list(text)
    if any(v >= 100 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: percentiles must be in (0, 100)")
    return values


def slo(text: str) -> tuple[str, float]:
    key, _, ms = text.partition(":")
    try:
        value = float(ms)
    except ValueError:
        value = -1.0
    if key not in SLO_KEYS or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY:MILLISECONDS with KEY one of {', '.join(SLO_KEYS)}")
    return key, value


def config_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in CONFIGS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown configuration {', '.join(bad) or repr(text)}; known: {', '.join(CONFIGS)}"
        )
    return names


def parser() -> argparse.ArgumentParser:
    p = LadderParser(prog="python -m benchmarks.serving", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    a = p.add_argument
    a("--base-url", default=None, help="benchmark this running server (http://host:port) instead of the suite")
    a("--model", default=None, help="with --base-url: the 'model' field to send (default: none); otherwise the "
                                    "checkpoint to serve (default: the built-in tiny Shakespeare model)")  # fmt: skip
    a("--draft-model", default=None, help="the suite's speculative draft (default: the built-in draft, else n-grams)")
    a("--workload", choices=WORKLOADS, default="shared-prefix", help="with --base-url (default shared-prefix)")
    a("--num-prompts", type=positive_int, default=None, help="requests per run (default 64; --quick 16)")
    a("--request-rate", type=rate, default=math.inf, help="with --base-url: requests/s, or inf (default inf)")
    a(
        "--rate-multiples",
        type=number_list,
        default=None,
        help="the suite's request rates, as multiples of level 2's capacity (default 0.25,0.5,1,1.5; --quick 0.5,1.5)",
    )
    a("--burstiness", type=positive_float, default=1.0, help="gamma shape of the gaps: 1 is Poisson (default 1)")
    a("--max-concurrency", type=positive_int, default=None, help="requests in flight at most (default: no limit)")
    a("--goodput", type=slo, nargs="+", default=[], metavar="KEY:MS",
      help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000 (milliseconds)")  # fmt: skip
    a("--percentiles", type=percentile_list, default=[50, 90, 99], help="comma list (default 50,90,99)")
    a("--configs", type=config_list, default=list(CONFIGS), help=f"the suite's servers (default {','.join(CONFIGS)})")
    a("--no-exact-lengths", dest="exact", action="store_false",
      help="do not send min_tokens / ignore_eos (vLLM extensions) to a server that refuses them")  # fmt: skip
    a("--quick", action="store_true", help="tiny workloads and two rates: a smoke run")
    a("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "float64"], help="default auto")
    a("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default auto")
    a("--kv-cache-memory", type=positive_int, default=256 << 20, help="bytes of KV cache, offline and served (256 MiB)")
    a("--max-num-seqs", type=positive_int, default=256, help="batch limit, offline and served (default 256)")
    a("--threads", type=positive_int, default=1, help="torch threads of the engines (default 1)")
    a("--seed", type=nonneg_int, default=0, help="seeds the workloads and the arrivals (default 0)")
    a("--stream-interval", type=positive_int, default=1,
      help="the suite's servers' --stream-interval: an event per this many tokens after the first (default 1)")  # fmt: skip
    a("--repeats", type=positive_int, default=None,
      help="offline-vs-HTTP pairs for the overhead ratio, fastest kept (default 3; --quick 1)")  # fmt: skip
    a("--timeout", type=positive_float, default=600.0, help="seconds one request may take (default 600)")
    a("--data-parallel-size", type=positive_int, default=1,
      help="above 1: the data-parallel comparison instead of the suite (serving_dp.py): DP=1 against this many "
           "replicas on uniform, and round-robin against --router on chat")  # fmt: skip
    a("--router", default="prefix-aware", choices=["round-robin", "least-loaded", "prefix-aware"],
      help="with --data-parallel-size: the policy compared with round-robin (default prefix-aware)")  # fmt: skip
    a("--out", type=Path, default=None, help="results JSON (default: serving.json outside the repository)")
    a("--plot", type=Path, default=None, help="the suite's plot (default: serving_latency.png beside the JSON)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if args.base_url is None:
        check_device_and_models(p, args, ("model", "draft_model"))
    elif not args.base_url.startswith(("http://", "https://")):
        p.error(f"argument --base-url: {args.base_url!r} is not an http:// or https:// URL")
    args.goodput = dict(args.goodput)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.rate_multiples = args.rate_multiples or ([0.5, 1.5] if args.quick else [0.25, 0.5, 1.0, 1.5])
    return args


def main(argv=None) -> dict:
    from rich.console import Console
    from rich.table import Table

    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    args.argv = argv
    console = Console(width=None if Console().is_terminal else 150)
    if args.base_url:
        # Token ids 32-126 (printable ASCII), valid for any vocabulary of 127 tokens or more.
        wl = make_workload(args.workload, args.num_prompts or 64, 127, args.seed, quick=args.quick)
        data = {"base_url": args.base_url, "workload": wl.name, "command": " ".join(["python -m benchmarks.serving", *argv]),
                "run": bench(args.base_url, args.model, wl.first, args.request_rate, args)}  # fmt: skip
        print_run(console, data["run"], args.percentiles)
    elif args.data_parallel_size > 1:
        from ladder.models import default_model

        from .serving_dp import run as run_dp

        data = {"command": " ".join(["python -m benchmarks.serving", *argv]),
                **run_dp(args, console, server_flags(args, str(args.model or default_model())))}  # fmt: skip
    else:
        data = suite(args, console)
        t = Table(
            title="the performance goals" + (" (a --quick smoke run: these figures say little)" if args.quick else "")
        )
        for col in ("goal", "measured", "target", "met"):
            t.add_column(col)
        for g in data["goals"]:
            t.add_row(g["goal"], f"{g['measured']:.3g}", g["target"], "[green]yes[/]" if g["met"] else "[red]no[/]")
        console.print(t)
    out = Path(args.out or output_dir() / "serving.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    console.print(f"wrote {out}")
    if not args.base_url and args.data_parallel_size == 1:
        path = Path(args.plot or out.with_name("serving_latency.png"))
        plot(data, path)
        console.print(f"wrote {path}")
    return data


if __name__ == "__main__":
    main()
