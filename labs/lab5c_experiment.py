"""Lab 5c's experiment: what a pipeline of two stages buys, and where its time goes.

    python -m labs experiment 5c YOUR_FILE [--batch 64] [--max-tokens 24] [--repeats 2] [--model M] [--plot PATH]

What it is: *your* `engine.py` running the same decode-heavy requests (8-token prompts,
`--max-tokens` outputs each, greedy) in one process (TP=1, PP=1: level 4's step) and split
into two stages (PP=2, each stage a process of one torch thread, talking over gloo), as
`python -m benchmarks.parallel` does. PP=2 holds `--batch / 2` requests per micro-batch, so
the two layouts run the same requests at once. For the PP=2 run it reads every rank's forward
timeline (`llm.comm_stats()`) over the timed run and prints how busy each stage was and for how
much of the run both stages computed at the same time: the pipeline's overlap, which your
`_step` makes (or does not), and draws the best PP=2 run's last forwards on each stage, the idle
time hatched (level 5's demo's picture: `lab5c_pipeline.png` outside the repository unless
`--plot`). Each layout's best of `--repeats` rounds (noise only slows a run).

The model is `benchmarks.parallel`'s ~100M-parameter random Llama (built once into the output
folder, about a minute), where a forward takes tens of milliseconds and the stages' overlap
shows; `--model` takes any other checkpoint or built-in name.

What it is not: a test of your code (the checks are) or a GPU figure: on a CPU the two stages
also share one memory bus, and a gloo message costs about a millisecond.

Reference: docs/level5_multigpu.md, "Pipeline parallelism"; Huang et al., "GPipe" (2019).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ladder.cli import LadderParser, plot_path, positive_int, torch_threads


def parser() -> argparse.ArgumentParser:
    p = LadderParser(prog="python -m labs experiment 5c YOUR_FILE", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None, help="checkpoint or built-in name (default: the ~100M random Llama)")
    p.add_argument("--batch", type=positive_int, default=64, help="requests, all at once (default 64)")
    p.add_argument("--max-tokens", type=positive_int, default=24, help="output tokens per request (default 24)")
    p.add_argument("--repeats", type=positive_int, default=2, help="rounds; each layout keeps its best (default 2)")
    p.add_argument("--plot", type=Path, default=None,
                   help="where to draw the PP=2 run's stages (default: lab5c_pipeline.png outside the repository)")  # fmt: skip
    return p


def busy(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals, as sorted disjoint intervals."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Seconds both unions of intervals cover (each sorted and disjoint)."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def run(model: str, pp: int, args) -> dict:
    from benchmarks.parallel import decode_heavy, layout_kwargs
    from level0_naive import SamplingParams
    from level5_multigpu import LLM  # under the lab's swap: your engine.py

    prompts, params = decode_heavy(args.batch, args.max_tokens)
    with LLM(model, dtype="float32", pipeline_parallel_size=pp, **layout_kwargs(args.batch, pp)) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=2), progress=False)  # warm up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, progress=False)
        t1 = time.perf_counter()
        stats = llm.comm_stats() if pp > 1 else {}
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    row = {"pp": pp, "tokens_per_s": tokens / (t1 - t0), "seconds": t1 - t0}
    if pp > 1:  # ranks 0 and 1 are stages 0 and 1 (TP=1); perf_counter is one clock for every process here
        row["timeline"] = {r: [ev for ev in stats[r][1] if ev[1] >= t0] for r in (0, 1)}  # the timed run's forwards
        stages = [busy([(s, e) for _, s, e in row["timeline"][r]]) for r in (0, 1)]
        window = t1 - t0
        row["stage_busy"] = [sum(e - s for s, e in st) / window for st in stages]
        row["both_busy"] = overlap(*stages) / window
        row["forwards"] = [len(row["timeline"][r]) for r in (0, 1)]
    return row


def main(argv=None) -> dict:
    p = parser()
    args = p.parse_args(argv)
    if args.max_tokens > 200:  # each rank keeps its last 512 forwards (rank.py's Timeline): the whole run must fit
        p.error("argument --max-tokens: at most 200 (the ranks' timelines keep 512 forwards)")
    from rich.console import Console
    from rich.table import Table

    from benchmarks.parallel import model_path

    console = Console()
    model = model_path(args)
    best: dict[int, dict] = {}
    for rep in range(args.repeats):
        for pp in (1, 2) if rep % 2 == 0 else (2, 1):  # alternate the order: drift hits both alike
            console.print(f"round {rep + 1}/{args.repeats}: PP={pp}, {args.batch} requests ...")
            with torch_threads(1):
                r = run(model, pp, args)
            console.print(f"  {r['tokens_per_s']:.0f} tokens/s")
            if pp not in best or r["tokens_per_s"] > best[pp]["tokens_per_s"]:
                best[pp] = r
    t = Table(title=f"{args.batch} requests, {args.max_tokens} tokens each, best of {args.repeats}")
    for col in ("layout", "tokens/s", "x PP=1", "stage 0 busy", "stage 1 busy", "both at once", "forwards"):
        t.add_column(col, justify="left" if col == "layout" else "right")
    for pp, r in sorted(best.items()):
        ratio = r["tokens_per_s"] / best[1]["tokens_per_s"]
        extra = ["-"] * 4
        if pp > 1:
            extra = [f"{r['stage_busy'][0]:.0%}", f"{r['stage_busy'][1]:.0%}", f"{r['both_busy']:.0%}",
                     f"{r['forwards'][0]} / {r['forwards'][1]}"]  # fmt: skip
        t.add_row(f"PP={pp}", f"{r['tokens_per_s']:.0f}", f"{ratio:.2f}x", *extra)
    console.print(t)
    console.print("PP=1: one process (level 4's step). busy: the share of the timed run a stage spent in forwards; "
                  "both at once: the share in which both stages computed, the pipeline's overlap (0 % when one "
                  "micro-batch is in flight at a time). forwards: each stage's, in the timed run.")  # fmt: skip
    if 2 in best and all(best[2]["timeline"].values()):
        from level5_multigpu.demo import plot  # under the lab's swap: your engine, the reference's picture

        path = plot_path(args.plot, "lab5c_pipeline.png")
        plot(path, best[2]["timeline"])
        console.print(f"the PP=2 run's stages, forward by forward: {path}")
    return best


if __name__ == "__main__":
    main()
