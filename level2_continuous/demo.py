"""`python -m level2_continuous.demo`: static batching (level 1) against continuous batching (level 2).

What it is: one workload whose output lengths are widely spread (most requests are short
answers of 16..48 tokens, one in five is a long one of 384..512; `ignore_eos`, so each
request generates exactly its `max_tokens`) through both engines with the same KV budget
and the same number of seats (`max_num_seqs=8`; the budget holds 8 worst-case requests,
so memory never forces a preemption and the only difference is *when a free seat is
refilled*). It prints a table of tokens/s and request latency (mean, p50, p99), the
measured share of each level-2 step spent in the scheduler and its bookkeeping, and
saves a timeline (to a folder outside the repository, printed at the end; `--plot PATH`
to choose; `python -m ladder.figures` regenerates the committed
`docs/img/level2_timeline.png`): one row per request, a light bar while it queued, a
dark bar from its first step to its last. At level 1 short requests queue behind
every earlier batch's longest member (head-of-line blocking); at level 2 they start as
soon as anyone finishes.

What it is not: a throughput benchmark (`benchmarks/` is), nor a model of arrivals over
time: every request arrives at t = 0, as in `LLM.generate`.

Reference: Yu et al., "Orca" (OSDI 2022), figures 1 and 2; vLLM V1 `v1/core/sched/scheduler.py`.
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ladder.cli import (
    demo_parser,
    fraction,
    plot_flag,
    positive_int,
    prompts_for,
    run_demo,
    save_figure,
)
from ladder.models import default_model
from level0_naive.llm import LLM as NaiveLLM
from level0_naive.sampling_params import SamplingParams
from level1_paged.engine import LLM as StaticLLM

from .engine import LLM as ContinuousLLM


def mixed_lengths(n: int, cap: int, long_fraction: float, seed: int = 0) -> list[int]:
    """Heavy-tailed output lengths: mostly short (16..48), a `long_fraction` long (3/4 cap..cap)."""
    rng = random.Random(seed)
    short = (min(16, cap), min(48, cap))
    return [rng.randint(cap * 3 // 4, cap) if rng.random() < long_fraction else rng.randint(*short) for _ in range(n)]


def parser():
    p = demo_parser(__doc__, "level2_continuous.demo")
    p.add_argument("--requests", type=positive_int, default=32, help="how many requests (default 32)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="max_num_seqs of both engines (default 8)")
    p.add_argument(
        "--long-fraction", type=fraction, default=0.2, help="share of long requests, in [0, 1] (default 0.2)"
    )
    plot_flag(p, "level2_timeline.png", "the timeline")
    return p


def main(argv=None) -> dict:
    return run_demo(parser(), argv, run, plot="level2_timeline.png")


def run(args, console: Console) -> dict:
    model = args.model or default_model()
    cap = args.max_tokens or 512
    lengths = mixed_lengths(args.requests, cap, args.long_fraction, seed=args.seed)
    prompts = prompts_for(args.requests)
    params = [SamplingParams(max_tokens=n, temperature=args.temperature, ignore_eos=True) for n in lengths]
    # -1: every position the checkpoint has; the built-in model's default is its 256-token training window,
    # and the longest requests run past it (the text grows weaker there; the scheduling is the point)
    common = dict(dtype=args.dtype, device=args.device, seed=args.seed, max_num_seqs=args.batch_size, max_model_len=-1)
    probe = NaiveLLM(model, kv_cache_memory=1, **common).llm_engine  # only to size the budget (allocates no KV)
    worst = max(len(probe.tokenizer(p)["input_ids"]) for p in prompts) + cap
    budget = args.batch_size * worst * probe.bytes_per_token
    del probe
    n_long = sum(n > 48 for n in lengths)
    console.print(f"[bold]level 1 vs level 2[/]: {args.requests} requests ({args.requests - n_long} short, {n_long} long; "
                  f"output lengths {min(lengths)}..{max(lengths)}), {args.batch_size} seats, "
                  f"KV budget {budget / 2**20:.2f} MiB = {args.batch_size} worst-case requests, model {model}")  # fmt: skip

    results = {}
    for name, cls in [("level 1", StaticLLM), ("level 2", ContinuousLLM)]:
        llm = cls(model, kv_cache_memory=budget, **common)
        console.print(f"[bold]{name}[/]")
        outs = llm.generate(prompts, params, progress=not args.no_progress)
        results[name] = (llm, outs)

    table, figures = latency_table(results)
    console.print(table)
    share = scheduler_share(results["level 2"][0], args.batch_size)
    console.print(share["text"])
    plot(args.plot, results, lengths)
    f1, f2 = figures["level 1"], figures["level 2"]
    console.print(f"[bold]tokens/s[/] {f1['tps']:.0f} -> [green]{f2['tps']:.0f}[/] ({f2['tps'] / f1['tps']:.2f}x);  "
                  f"[bold]mean latency[/] {f1['mean']:.2f} s -> [green]{f2['mean']:.2f} s[/];  "
                  f"[bold]p99[/] {f1['p99']:.2f} s -> [green]{f2['p99']:.2f} s[/];  "
                  f"timeline saved to {args.plot}")  # fmt: skip
    return {"level1": f1, "level2": f2, "scheduler_share": share["share"], "plot": args.plot}


# --- measuring --------------------------------------------------------------------------------
def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def latency_table(results: dict) -> tuple[Table, dict]:
    t = Table(title="same workload, same KV budget, same seats: static vs continuous batching")
    t.add_column("figure")
    for name in results:
        t.add_column(f"{name} ({'static' if name == 'level 1' else 'continuous'})", justify="right")
    figures = {}
    for name, (llm, outs) in results.items():
        e2e = [o.metrics.e2e for o in outs]
        ttft = [o.metrics.ttft for o in outs]
        queued = [o.metrics.first_scheduled_time - o.metrics.arrival_time for o in outs]
        figures[name] = dict(tps=llm.stats.output_tokens_per_s, mean=statistics.mean(e2e), p50=percentile(e2e, 0.5),
                             p99=percentile(e2e, 0.99), ttft=statistics.mean(ttft), queued=statistics.mean(queued),
                             steps=llm.stats.steps, running=llm.stats.mean_running, wall=llm.stats.busy_time,
                             preemptions=llm.stats.preemptions)  # fmt: skip
    rows = [("output tokens/s", "tps", "{:.0f}"), ("request latency, mean", "mean", "{:.2f} s"),
            ("request latency, p50", "p50", "{:.2f} s"), ("request latency, p99", "p99", "{:.2f} s"),
            ("time to first token, mean", "ttft", "{:.2f} s"), ("time queued, mean", "queued", "{:.2f} s"),
            ("requests running (mean over steps)", "running", "{:.1f}"), ("model steps", "steps", "{}"),
            ("preemptions", "preemptions", "{}"), ("wall time", "wall", "{:.1f} s")]  # fmt: skip
    for label, key, fmt in rows:
        t.add_row(label, *(fmt.format(figures[name][key]) for name in results))
    return t, figures


def scheduler_share(llm, batch_size: int) -> dict:
    """Scheduler + block bookkeeping + batch building, as a share of step time (level 2):
    the mean from the engine's counters, the median from its ring buffer of recent steps."""
    s = llm.stats
    sched, total, steps = s.schedule_seconds, s.step_seconds, s.steps
    full = [
        r.schedule_seconds / r.step_seconds
        for r in llm.llm_engine.step_log
        if r.running == batch_size and r.num_prefill_tokens == 0
    ]
    text = (f"[bold]level 2 scheduler + bookkeeping[/]: {1e3 * sched / steps:.2f} ms of a {1e3 * total / steps:.2f} ms step "
            f"on average = [bold]{100 * sched / total:.1f} %[/] of step time over {steps} steps")  # fmt: skip
    if full:
        median = 100 * statistics.median(full)
        text += f"; {median:.1f} % (median) in the {len(full)} pure-decode steps with all {batch_size} seats busy"
    return {"share": sched / total, "text": text}


# --- the picture --------------------------------------------------------------------------------
def plot(path: Path, results: dict, lengths: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = len(lengths)
    fig, axes = plt.subplots(2, 1, figsize=(11, 2.0 + 0.22 * n), sharex=True)
    for ax, (name, (llm, outs)) in zip(axes, results.items()):
        t0 = min(o.metrics.arrival_time for o in outs)
        for row, (o, length) in enumerate(zip(outs, lengths)):
            m = o.metrics
            start, run = m.first_scheduled_time - t0, m.finished_time - m.first_scheduled_time
            ax.barh(row, start, left=m.arrival_time - t0, color="0.85", height=0.7)
            ax.barh(row, run, left=start, color="tab:orange" if length > 48 else "tab:blue", height=0.7)
        kind = "static batching: a batch's seats free only when its longest request ends" if name == "level 1" \
            else "continuous batching: a seat is refilled the step after it frees"  # fmt: skip
        e2e = [o.metrics.e2e for o in outs]
        ax.set_title(f"{name}, {kind}\nmean latency {statistics.mean(e2e):.2f} s, p99 {percentile(e2e, 0.99):.2f} s, "
                     f"{llm.stats.output_tokens_per_s:.0f} output tokens/s", fontsize=10)  # fmt: skip
        ax.set_ylabel("request (submission order)")
        ax.set_ylim(n - 0.5, -0.5)
        ax.set_yticks(range(0, n, max(1, n // 8)))
    axes[-1].set_xlabel("seconds since the requests arrived")
    legend = [Patch(color="0.85", label="queued"), Patch(color="tab:blue", label="running, short request"),
              Patch(color="tab:orange", label="running, long request")]  # fmt: skip
    axes[0].legend(handles=legend, loc="upper right", fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
