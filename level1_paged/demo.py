"""`python -m level1_paged.demo`: one workload, one KV budget, level 0 against level 1.

What it is: the same requests (output lengths spread over 16..512 tokens, `ignore_eos`,
so every request generates exactly its `max_tokens`) and the same KV memory budget (room
for four worst-case requests) run through level 0 (a slab of prompt + max_tokens slots
per request) and level 1 (16-token blocks handed out as tokens arrive). It prints

  - a table: how much of the reserved KV memory held a token (KV waste), how many
    requests were in memory at once, how often level 1 had to evict, tokens/s;
  - a picture of one moment: level 0's slabs and level 1's block pool and block tables;

and saves a picture of the KV memory of both engines, step by step (to a folder outside
the repository, printed at the end; `--plot PATH` to choose; `python -m ladder.figures`
regenerates the committed `docs/img/level1_memory.png` with the docs' settings).

What it is not: a throughput benchmark (`benchmarks/` is). Both engines use static
batching, so the difference shown is memory, and tokens/s follow only from that.

Reference: Kwon et al., SOSP 2023, figure 2 (waste) and section 4.2 (block tables).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ladder.cli import (
    at_least_one,
    demo_parser,
    plot_flag,
    positive_int,
    prompts_for,
    run_demo,
    save_figure,
    spread_lengths,
)
from ladder.models import default_model
from level0_naive.llm import LLM as NaiveLLM
from level0_naive.sampling_params import SamplingParams
from level0_naive.stats import EngineStats

from .block_table import blocks_for
from .engine import LLM as PagedLLM

COLORS = ["red", "green", "yellow", "blue", "magenta", "cyan", "bright_red", "bright_green",
          "bright_yellow", "bright_blue", "bright_magenta", "bright_cyan"]  # fmt: skip
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"


@dataclass
class TracedStats(EngineStats):
    """EngineStats that also keep each step's figures (for the plot) and call a hook after each."""

    history: list[tuple[int, int, int]] = field(default_factory=list)  # (running, bytes reserved, bytes used)
    hook: Callable[[int], None] | None = None

    def record_step(self, running: int, kv_reserved: int, kv_used: int, seconds: float) -> None:
        super().record_step(running, kv_reserved, kv_used, seconds)
        self.history.append((running, kv_reserved, kv_used))
        if self.hook is not None:
            self.hook(self.steps)


def parser():
    p = demo_parser(__doc__, "level1_paged.demo")
    p.add_argument("--requests", type=positive_int, default=24, help="how many requests (default 24)")
    p.add_argument(
        "--budget-requests",
        type=at_least_one,  # below one worst-case request, the longest request could never run
        default=4.0,
        help="KV budget, in worst-case requests (longest prompt + max tokens; >= 1; default 4)",
    )
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block of level 1 (default 16)")
    p.add_argument(
        "--snapshot-step",
        type=positive_int,
        default=64,
        help="the step whose slabs and block tables are drawn (default 64)",
    )
    plot_flag(p, "level1_memory.png", "the memory picture")
    return p


def main(argv=None) -> dict:
    return run_demo(parser(), argv, run, plot="level1_memory.png")


def run(args, console: Console) -> dict:
    model = args.model or default_model()
    cap = args.max_tokens or 512
    lengths = spread_lengths(args.requests, min(16, cap), cap, seed=args.seed)
    prompts = prompts_for(args.requests)
    params = [SamplingParams(max_tokens=n, temperature=args.temperature, ignore_eos=True) for n in lengths]
    # -1: every position the checkpoint has; the built-in model's default is its 256-token training window,
    # and the longest requests run past it (the text grows weaker there; the memory is the point)
    common = dict(dtype=args.dtype, device=args.device, seed=args.seed, max_model_len=-1)
    probe = NaiveLLM(model, kv_cache_memory=1, **common).llm_engine  # only to size the budget (allocates no KV)
    worst = max(len(probe.tokenizer(p)["input_ids"]) for p in prompts) + cap
    budget = int(args.budget_requests * worst * probe.bytes_per_token)
    # At least one worst-case request in whole blocks: level 1's pool is whole blocks, so a
    # budget of exactly `worst` tokens could hold one block too few for the longest request.
    budget = max(budget, blocks_for(worst, args.block_size) * args.block_size * probe.bytes_per_token)
    del probe
    console.print(f"[bold]level 0 vs level 1[/]: {args.requests} requests, "
                  f"output lengths {min(lengths)}..{max(lengths)} (exact), KV budget {budget / 2**20:.2f} MiB = "
                  f"{args.budget_requests:g} worst-case requests of {worst} tokens, model {model}")  # fmt: skip

    engines, snaps = {}, {}
    for name, cls, extra in [("level 0", NaiveLLM, {}), ("level 1", PagedLLM, {"block_size": args.block_size})]:
        llm = cls(model, kv_cache_memory=budget, **common, **extra)
        llm.llm_engine.stats = TracedStats(
            hook=snapshotter(llm.llm_engine, args.snapshot_step, snaps.setdefault(name, {}))
        )
        console.print(f"[bold]{name}[/]")
        llm.generate(prompts, params, progress=not args.no_progress)
        engines[name] = llm

    s0, s1 = engines["level 0"].stats, engines["level 1"].stats
    print_table(console, s0, s1, budget)
    draw_snapshot(
        console, snaps["level 0"], snaps["level 1"], engines["level 1"].llm_engine.num_blocks, args.block_size
    )
    plot(args.plot, s0, s1, budget)
    console.print(f"[bold]KV waste[/] {100 * s0.kv_waste:.1f} % -> [green]{100 * s1.kv_waste:.1f} %[/];  "
                  f"[bold]peak requests in memory[/] {s0.peak_running} -> [green]{s1.peak_running}[/] "
                  f"({s1.peak_running / s0.peak_running:.1f}x);  plot saved to {args.plot}")  # fmt: skip
    return {"level0": s0, "level1": s1, "plot": args.plot}


# --- measuring --------------------------------------------------------------------------
def snapshotter(engine, at_step: int, snap: dict) -> Callable[[int], None]:
    """A hook that copies the engine's KV layout after every step up to `at_step`
    (so a run shorter than that still leaves its last step), and the first step's ids."""

    def hook(step: int) -> None:
        if step > at_step:
            return
        if hasattr(engine, "blocks"):  # level 1: seq_id -> (its block table, tokens cached)
            layout = {sid: (list(t), engine.cached.get(sid, 0)) for sid, t in engine.blocks.tables.items()}
        else:  # level 0: seq_id -> (slab slots reserved, slots used)
            layout = {sid: (slab.reserved, slab.used) for sid, slab in engine.slabs.items()}
        snap.update(step=step, layout=layout)
        snap.setdefault("first_ids", sorted(layout))

    return hook


def print_table(console: Console, s0: EngineStats, s1: EngineStats, budget: int) -> None:
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    t = Table(title="same workload, same KV budget: contiguous slabs vs paged blocks")
    t.add_column("figure")
    t.add_column("level 0 (slabs)", justify="right")
    t.add_column("level 1 (blocks)", justify="right")
    t.add_row("KV budget", mib(budget), mib(budget))
    t.add_row("KV reserved (peak)", mib(s0.kv_reserved_peak), mib(s1.kv_reserved_peak))
    t.add_row("KV holding tokens (peak)", mib(s0.kv_used_peak), mib(s1.kv_used_peak))
    t.add_row("KV waste (time-averaged)", f"[red]{100 * s0.kv_waste:.1f} %[/]", f"[green]{100 * s1.kv_waste:.1f} %[/]")
    t.add_row("requests in memory (peak)", str(s0.peak_running), f"[green]{s1.peak_running}[/]")
    t.add_row("requests in memory (mean over steps)", f"{s0.mean_running:.1f}", f"{s1.mean_running:.1f}")
    t.add_row("evictions (recomputed later)", str(s0.preemptions), str(s1.preemptions))
    t.add_row("model steps", str(s0.steps), str(s1.steps))
    t.add_row("output tokens/s", f"{s0.output_tokens_per_s:.0f}", f"{s1.output_tokens_per_s:.0f}")
    t.add_row("wall time", f"{s0.busy_time:.1f} s", f"{s1.busy_time:.1f} s")
    console.print(t)


# --- pictures ---------------------------------------------------------------------------
def draw_snapshot(console: Console, snap0: dict, snap1: dict, num_blocks: int, bs: int) -> None:
    """Level 0's slabs and level 1's pool at the same step, one character = one block of tokens."""
    ids = sorted(set(snap1.get("first_ids", [])) | set(snap0.get("first_ids", [])))
    label = {sid: (LETTERS[i % len(LETTERS)], COLORS[i % len(COLORS)]) for i, sid in enumerate(ids)}

    layout0 = snap0["layout"]
    console.print(f"\n[bold]level 0 after step {snap0['step']}[/]: one slab per request, "
                  f"one character = {bs} token slots ([bold]█[/] holds tokens, [red]░[/] reserved, empty)")  # fmt: skip
    for sid, (reserved, used) in sorted(layout0.items()):
        ch, color = label.get(sid, ("?", "white"))
        full = -(-used // bs)
        line = Text(f"  {ch} ", style=f"bold {color}")
        line.append("█" * full, style=color).append("░" * (-(-reserved // bs) - full), style="red")
        line.append(f"  {used}/{reserved} slots used")
        console.print(line)
    r0, u0 = sum(r for r, _ in layout0.values()), sum(u for _, u in layout0.values())
    console.print(
        f"  {len(layout0)} requests, {r0} slots reserved, {u0} used: [red]{100 * (1 - u0 / max(r0, 1)):.0f} % empty[/]"
    )

    layout1 = snap1["layout"]
    owner = {b: sid for sid, (table, _) in layout1.items() for b in table}
    console.print(f"\n[bold]level 1 after step {snap1['step']}[/]: the pool of {num_blocks} blocks "
                  f"(a letter = the request owning that block, [dim]·[/] = free)")  # fmt: skip
    per_row = 32
    for start in range(0, num_blocks, per_row):
        line = Text(f"  {start:>4} ", style="dim")
        for b in range(start, min(start + per_row, num_blocks)):
            if b in owner:
                ch, color = label.get(owner[b], ("?", "white"))
                line.append(f"{ch} ", style=f"bold black on {color}")
            else:
                line.append("· ", style="dim")
        console.print(line)
    console.print("  block tables (logical block -> physical block) of the first few requests:")
    for sid, (table, cached) in sorted(layout1.items())[:6]:
        ch, color = label.get(sid, ("?", "white"))
        line = Text(f"  {ch} ", style=f"bold {color}").append(f"{cached:>4} tokens  [")
        line.append(" ".join(f"{b:>3}" for b in table), style=color).append(" ]")
        line.append(f"  last block {cached - bs * (len(table) - 1)}/{bs} full")
        console.print(line)
    r1, u1 = sum(len(t) * bs for t, _ in layout1.values()), sum(c for _, c in layout1.values())
    console.print(f"  {len(layout1)} requests, {r1} slots in their blocks, {u1} used: "
                  f"[green]{100 * (1 - u1 / max(r1, 1)):.0f} % empty[/] (only each last block's tail)\n")  # fmt: skip


def plot(path: Path, s0: TracedStats, s1: TracedStats, budget: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharex=True)
    mib = 2**20
    for ax, (name, s) in zip(axes[:2], [("level 0: a slab per request", s0), ("level 1: blocks on demand", s1)]):
        steps = range(1, len(s.history) + 1)
        reserved = [r / mib for _, r, _ in s.history]
        used = [u / mib for _, _, u in s.history]
        ax.fill_between(steps, reserved, step="post", color="tab:red", alpha=0.25, label="reserved, empty")
        ax.fill_between(steps, used, step="post", color="tab:blue", alpha=0.8, label="holding tokens")
        ax.axhline(budget / mib, color="black", ls="--", lw=1, label="KV budget")
        ax.set_title(f"{name}\nKV waste {100 * s.kv_waste:.1f} % (time-averaged)")
        ax.set_xlabel("model step")
        ax.set_ylabel("KV cache (MiB)")
        ax.set_ylim(0, budget / mib * 1.1)
        ax.legend(loc="upper right", fontsize=8)
    ax = axes[2]
    for name, s, color in [("level 0", s0, "tab:red"), ("level 1", s1, "tab:blue")]:
        ax.step(range(1, len(s.history) + 1), [n for n, _, _ in s.history], where="post", color=color,
                label=f"{name}: peak {s.peak_running}, mean {s.mean_running:.1f}")  # fmt: skip
    ax.set_title("requests in memory at once\n(same budget)")
    ax.set_xlabel("model step")
    ax.set_ylabel("requests")
    ax.legend(loc="upper right", fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
