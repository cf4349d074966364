"""`python -m level0_naive.demo`: the naive engine on a mixed-length workload.

Shows a few completions, then what static batching with contiguous slabs costs: how much
of the reserved KV memory ever held a token, how many requests ran at once, and how
long the short requests waited behind the long ones.
"""

from __future__ import annotations

import statistics

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from ladder.cli import demo_parser, positive_int, prompts_for, run_demo, spread_lengths
from ladder.models import default_model

from .llm import LLM
from .sampling_params import SamplingParams


def parser():
    p = demo_parser(__doc__, "level0_naive.demo")
    p.add_argument("--requests", type=positive_int, default=16, help="how many requests (default 16)")
    return p


def main(argv=None):
    return run_demo(parser(), argv, run)


def run(args, console: Console):
    model = args.model or default_model()
    cap = args.max_tokens or 256
    lengths = spread_lengths(args.requests, min(16, cap), cap, seed=args.seed)
    # -1: every position the checkpoint has; the built-in model's default is its 256-token training window,
    # and these requests run past it (the text grows weaker there; the memory is the point)
    common = dict(dtype=args.dtype, device=args.device, seed=args.seed, max_model_len=-1)
    probe = LLM(model, kv_cache_memory=1, **common)  # only to size the budget
    # A KV budget that holds about four requests' worst case: tight, as real GPUs are.
    budget = 4 * (cap + 16) * probe.llm_engine.bytes_per_token
    llm = LLM(model, kv_cache_memory=budget, **common)
    del probe
    prompts = prompts_for(args.requests)
    params = [SamplingParams(max_tokens=n, temperature=args.temperature, ignore_eos=True) for n in lengths]
    console.print(f"[bold]level 0[/]: {args.requests} requests, output lengths {min(lengths)}..{max(lengths)}, "
                  f"KV budget {budget / 2**20:.1f} MiB, model {model}")  # fmt: skip
    outs = llm.generate(prompts, params, progress=not args.no_progress)

    for out in outs[:3]:
        console.print(
            Panel(
                out.prompt + out.outputs[0].text,
                title=f"request {out.request_id} ({len(out.outputs[0].token_ids)} tokens)",
                expand=False,
            )
        )

    s = llm.stats
    ttft = [o.metrics.ttft for o in outs]
    table = Table(title="level 0: contiguous slabs + static batching")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("KV reserved (peak)", f"{s.kv_reserved_peak / 2**20:.2f} MiB")
    table.add_row("KV holding tokens (peak)", f"{s.kv_used_peak / 2**20:.2f} MiB")
    table.add_row("KV waste (time-averaged)", f"[red]{100 * s.kv_waste:.1f} %[/]")
    table.add_row("requests at once (peak / mean)", f"{s.peak_running} / {s.mean_running:.1f}")
    table.add_row("output tokens/s", f"{s.output_tokens_per_s:.0f}")
    table.add_row("TTFT mean / max", f"{statistics.mean(ttft):.2f} s / {max(ttft):.2f} s")
    console.print(table)
    return s


if __name__ == "__main__":
    main()
