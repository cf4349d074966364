"""`python -m level5_multigpu.demo`: one model, four layouts over processes, the same text.

What it is: the same prompts, greedy, through TP=1, TP=2, PP=2 and TP=2 x PP=2, each
rank a process of its own on this CPU, talking over gloo. It prints

  - whether every layout wrote exactly the same text (float64 by default, so a
    different order of additions across ranks cannot flip a near-tie);
  - a table per layout: tokens/s, messages and bytes per generated token (all ranks),
    and rank 0's time inside all-reduces next to the latency-bandwidth model's price
    for them, t = calls * alpha + bytes * beta, with alpha and beta measured here
    first (rank 0 also schedules and samples, so it arrives last at every all-reduce:
    its time there is transfer, not waiting for a peer);
  - the pipeline schedule of the PP=2 run: which stage ran which micro-batch when,
    so the bubble is visible (saved outside the repository, printed at the end;
    `--plot PATH` to choose; `python -m ladder.figures` regenerates the committed
    `docs/img/level5_pipeline.png`).

`--moe` runs the mixture-of-experts demo instead (its room's, `features/moe/demo.py`: TP against expert
parallelism on the built-in `tiny-shakespeare-moe`, and its routing).

What it is not: a speed demonstration. On a CPU a gloo message costs about a millisecond
and a tiny model's layer far less, so TP=2 is slower here; `benchmarks/parallel.py`
measures where parallelism pays, with a 100M-parameter model.

Reference: Shoeybi et al., "Megatron-LM" (2019); Huang et al., "GPipe" (2019), figure 2.
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ladder import rooms
from ladder.cli import (
    demo_parser,
    parse_demo_args,
    plot_flag,
    plot_path,
    positive_int,
    prompts_for,
    save_figure,
    torch_threads,
)
from ladder.models import default_model
from level0_naive.sampling_params import SamplingParams

from .engine import LLM
from .parallel_state import predicted_seconds

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def parser():
    p = demo_parser(__doc__, "level5_multigpu.demo")
    p.add_argument("--requests", type=positive_int, default=8, help="how many requests (default 8)")
    p.add_argument("--moe", action="store_true", help="run the mixture-of-experts demo instead (features/moe/demo.py)")
    p.add_argument("--pipeline-partition", type=partition_arg, default=None,
                   help="layers per stage for the PP=2 layouts, e.g. 4,2 (default: as even as possible)")  # fmt: skip
    plot_flag(p, "level5_pipeline.png", "the pipeline schedule")
    p.set_defaults(max_tokens=32, temperature=0.0, dtype="float64")
    return p


def partition_arg(text: str) -> list[int]:
    import argparse

    try:
        parts = [int(x) for x in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) != 2 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not two layer counts >= 1, like 4,2")
    return parts


def main(argv=None) -> dict:
    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    if "--moe" in argv:  # the mixture-of-experts demo (its room's), with the rest of the flags
        return rooms.load("moe").demo_main([a for a in argv if a != "--moe"])
    p = parser()
    args = parse_demo_args(p, argv)
    if args.pipeline_partition:  # checked before any rank starts
        from level0_naive.loader import load_metadata

        layers = load_metadata(args.model or default_model()).config.num_layers
        if sum(args.pipeline_partition) != layers:
            p.error(
                f"argument --pipeline-partition: {args.pipeline_partition} does not add up to the model's {layers} layers"
            )
    args.plot = plot_path(args.plot, "level5_pipeline.png")
    with torch_threads(args.threads):
        return run(args, Console())


def run(args, console: Console) -> dict:
    model = args.model or default_model()
    prompts = prompts_for(args.requests)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    console.print(f"[bold]level 5[/]: {model}, {args.requests} requests x {args.max_tokens} tokens, {args.dtype}, "
                  f"one process per rank, gloo")  # fmt: skip
    rows, texts, timeline = {}, {}, None
    for tp, pp in LAYOUTS:
        name = f"TP={tp} PP={pp}"
        with LLM(model, dtype=args.dtype, device=args.device, seed=args.seed, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                 max_num_seqs=max(1, args.requests // pp), pipeline_partition=args.pipeline_partition if pp > 1 else None) as llm:  # fmt: skip
            model_fit = llm.llm_engine.calibrate()
            llm.generate(prompts[:1], SamplingParams(max_tokens=2), progress=False)  # warm up
            before = _totals(llm.comm_stats())
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, progress=not args.no_progress)
            seconds = time.perf_counter() - t0
            stats = llm.comm_stats()
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        texts[name] = [o.outputs[0].text for o in outs]
        calls, nbytes = (a - b for a, b in zip(_totals(stats), before))
        rows[name] = dict(tps=tokens / seconds, calls=calls / tokens, bytes=nbytes / tokens, seconds=seconds,
                          **_all_reduce_time(stats[0][0], model_fit.get("all_reduce")))  # fmt: skip
        if pp == 2 and tp == 1:
            timeline = {rank: events for rank, (_, events) in stats.items()}
    same = all(t == texts["TP=1 PP=1"] for t in texts.values())
    console.print(f"identical text in all four layouts: [bold]{same}[/]")
    console.print(f"[dim]{texts['TP=1 PP=1'][0][:100]!r}[/]")
    show_table(console, rows)
    if timeline:
        plot(args.plot, timeline)
        console.print(f"pipeline schedule: {args.plot}")
    return {"identical": same, "rows": rows, "plot": args.plot}


def _totals(stats: dict) -> tuple[int, int]:
    """Calls and bytes of the tensor messages (all-reduces, gathers, sends), over all ranks."""
    kinds = ("all_reduce", "gather", "send")
    calls = sum(s.by_kind.get(k, [0, 0, 0])[0] for s, _ in stats.values() for k in kinds)
    nbytes = sum(s.by_kind.get(k, [0, 0, 0])[1] for s, _ in stats.values() for k in kinds)
    return int(calls), int(nbytes)


def _all_reduce_time(rank0, fit: dict | None) -> dict:
    """Rank 0's seconds inside all-reduces, and calls * alpha + bytes * beta for the same calls."""
    calls, nbytes, secs = rank0.by_kind.get("all_reduce", [0, 0, 0.0])
    predicted = None if fit is None else predicted_seconds(fit, calls, nbytes)
    return {"all_reduce_s": secs if calls else None, "predicted_s": predicted,
            "alpha_us": None if fit is None else 1e6 * fit["alpha_s"], "beta_ns_per_kib": None if fit is None else 1e9 * 1024 * fit["beta_s_per_byte"]}  # fmt: skip


COLUMNS = {  # the table's columns, each explained under it
    "layout": "TP ranks per stage x PP stages, one process per rank",
    "tok/s": "generated tokens per second, all requests",
    "msgs/tok": "all-reduces, gathers and sends per generated token, all ranks",
    "bytes/tok": "their bytes per generated token, all ranks",
    "rank 0 all-reduce": "seconds rank 0 spent in all-reduces, warm-up included (measured)",
    "alpha-beta": "the model's price for those calls: calls * alpha + bytes * beta",
    "alpha": "the model's cost per message before its bytes, measured here first",
}


def show_table(console: Console, rows: dict) -> None:
    t = Table(title="same prompts, same tokens: what the layouts cost on this CPU")
    for col in COLUMNS:
        t.add_column(col, justify="right")
    for name, r in rows.items():
        measured = "-" if r["all_reduce_s"] is None else f"{r['all_reduce_s']:.2f} s"
        pred = "-" if r["predicted_s"] is None else f"{r['predicted_s']:.2f} s"
        fit = "-" if r["alpha_us"] is None else f"{r['alpha_us']:.0f} us"
        t.add_row(
            name.replace(" ", "\u00a0"),
            f"{r['tps']:.0f}",
            f"{r['calls']:.1f}",
            f"{r['bytes'] / 1024:.1f} KiB",
            measured,
            pred,
            fit,
        )
    console.print(t)
    width = max(map(len, COLUMNS)) + 1
    for col, meaning in COLUMNS.items():
        console.print(f"  {col + ':':{width}} {meaning}", style="dim", markup=False, highlight=False)
    console.print("[dim]  (\"-\": a layout without all-reduces; PP's sends are isends that overlap the next\n"
                  "  stage's work, so their time has no column)[/]")  # fmt: skip


def plot(path: Path, timeline: dict) -> None:
    """One row per rank (= stage here), one box per forward, colored by micro-batch, the idle
    time between boxes hatched: the bubble."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = {r: ev[-24:] for r, ev in timeline.items()}  # the last micro-batches: a steady pipeline
    t0 = min(s for ev in events.values() for _, s, _ in ev)
    span = 1e3 * (max(e for ev in events.values() for _, _, e in ev) - t0)  # ms
    cmap, fontsize = plt.get_cmap("tab10"), 7
    fig, ax = plt.subplots(figsize=(10, 2.8))
    idle = dict(facecolor="whitesmoke", hatch="///", edgecolor="silver", linewidth=0)
    boxes = []  # (rank, micro-batch, left, width) in ms, numbered once the layout is known
    for rank, ev in sorted(events.items()):
        free = 0.0  # where this stage's previous forward ended
        for mb, s, e in ev:
            left, width = 1e3 * (s - t0), 1e3 * (e - s)
            if left > free:
                ax.barh(rank, left - free, left=free, height=0.6, **idle)
            ax.barh(rank, width, left=left, color=cmap(mb % 10), edgecolor="black", height=0.6)
            boxes.append((rank, mb, left, width))
            free = left + width
    ax.set_xlim(0, span)
    ax.set_yticks(sorted(events), [f"stage {r}" for r in sorted(events)])
    ax.set_ylim(len(events) - 0.5, -0.5)
    ax.set_xlabel("milliseconds")
    ax.set_title(f"PP=2: the last {max(map(len, events.values()))} forwards of each stage", fontsize=9)
    legend = [
        Patch(facecolor=cmap(0), edgecolor="black",
              label="one micro-batch's forward on one stage (number: the micro-batch; one colour per micro-batch)"),
        Patch(**idle, label="stage idle: the bubble"),
    ]  # fmt: skip
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.32), ncols=2, fontsize=8, frameon=False)
    fig.tight_layout()
    renderer, px_per_ms = fig.canvas.get_renderer(), ax.get_window_extent().width / span
    for rank, mb, left, width in boxes:
        label = ax.text(left + width / 2, rank, str(mb), ha="center", va="center", fontsize=fontsize)
        # A number only where it fits inside its box: in a narrow one it would print over its neighbours.
        if label.get_window_extent(renderer).width + 6 > width * px_per_ms:
            label.remove()
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    main()
