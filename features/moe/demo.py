"""`python -m features.moe.demo` (or `python -m level5_multigpu.demo --moe`): a mixture of
experts in one process, with every expert sliced over two ranks, and with whole experts per rank.

What it is: the built-in mixture (`tiny-shakespeare-moe`: 8 experts, 2 per token, Mixtral's
layout) greedy on the same prompts in three layouts,

    one process       SparseMoE (layer.py) in level 0's model
    TP=2              every expert sliced over 2 ranks; one all-reduce per MoE layer
    TP=2 + EP         4 whole experts per rank; tokens dispatched to their experts' ranks and
                      combined back (all-to-alls: the row counts, the rows, their expert ids, the
                      answers), then gathered (one all-gather)

and prints whether the three wrote the same text (float64), the messages and bytes per
generated token of each kind (the MoE block's against attention's), each kind's time against
the latency-bandwidth model's price t = calls * alpha + bytes * beta (alpha and beta measured
here first, per kind; a kind's time is its time on the wire: per call, the least any rank spent
in it, the others having also waited for a peer), and the routing: for one line of text,
which expert each byte went to in each layer, and each expert's share of the (token, choice)
slots per layer. `--plot PATH`
draws the routing (default: moe_routing.png outside the repository;
`python -m ladder.figures --only moe` regenerates the committed `docs/img/moe_routing.png`).

What it is not: a speed demonstration (a gloo message costs a millisecond here, a tiny expert
microseconds; `python -m benchmarks.parallel --moe` measures bytes per token at several batches).

Reference: Jiang et al. 2024, "Mixtral of Experts", figure 8 (which expert each token took);
Lepikhin et al. 2020, "GShard" (dispatch and combine).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from ladder.cli import demo_parser, plot_flag, positive_int, prompts_for, run_demo, save_figure
from ladder.models import BUILTIN_MOE
from level0_naive.sampling_params import SamplingParams
from level5_multigpu.engine import LLM
from level5_multigpu.parallel_state import counters, predicted_seconds, waited

LAYOUTS = {"one process": dict(tensor_parallel_size=1), "TP=2": dict(tensor_parallel_size=2),
           "TP=2 + EP": dict(tensor_parallel_size=2, enable_expert_parallel=True)}  # fmt: skip
KINDS = ("moe_all_reduce", "all_to_all_counts", "all_to_all", "all_gather", "all_reduce")  # the MoE block's, then attention's
LINE = "ROMEO:\nBut, soft! what light through yonder window breaks?"


def parser():
    p = demo_parser(__doc__, "features.moe.demo")
    p.add_argument("--requests", type=positive_int, default=8, help="how many requests (default 8)")
    plot_flag(p, "moe_routing.png", "the routing picture")
    p.set_defaults(max_tokens=32, temperature=0.0, dtype="float64", model=None)
    return p


def main(argv=None) -> dict:
    return run_demo(parser(), argv, run, plot="moe_routing.png", width=110)


def run(args, console: Console) -> dict:
    model = args.model or str(BUILTIN_MOE)
    prompts = prompts_for(args.requests)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    console.print(f"[bold]level 5, a mixture of experts[/]: {model}, {args.requests} requests x {args.max_tokens} "
                  f"tokens, {args.dtype}, one process per rank, gloo")  # fmt: skip
    texts, rows = {}, {}
    for name, layout in LAYOUTS.items():
        with LLM(model, dtype=args.dtype, device=args.device, seed=args.seed, max_num_seqs=args.requests,
                 **layout) as llm:  # fmt: skip
            fits = llm.llm_engine.calibrate()
            llm.generate(prompts[:1], SamplingParams(max_tokens=2), progress=False)  # warm up
            before = counters(llm.comm_stats(), KINDS)
            ranked = layout["tensor_parallel_size"] > 1  # (one process sends nothing)
            if ranked:
                llm.llm_engine.executor.collective_rpc("record_calls", True)  # every message's time, per rank
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, progress=not args.no_progress)
            seconds = time.perf_counter() - t0
            records = llm.llm_engine.executor.collective_rpc("record_calls", False) if ranked else []
            after = counters(llm.comm_stats(), KINDS)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        fed = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outs)  # through a forward
        texts[name] = [o.outputs[0].text for o in outs]
        rows[name] = {"tps": tokens / seconds, "kinds": {}}
        for kind in KINDS:
            calls, nbytes = (sum(after[kind][r][i] - before[kind][r][i] for r in after[kind]) for i in (0, 1))
            secs = waited(records, kind)[0] if calls else 0.0  # per call, the least any rank spent in it: the wire
            fit = fits.get({"moe_all_reduce": "all_reduce"}.get(kind, kind))
            per_rank_calls = calls / max(len(after[kind]), 1)
            pred = predicted_seconds(fit, per_rank_calls, nbytes / max(len(after[kind]), 1)) if fit and calls else None
            rows[name]["kinds"][kind] = dict(calls=calls / tokens, bytes=nbytes / tokens, seconds=secs if calls else None,
                                             predicted=pred)  # fmt: skip
    same = all(t == texts["one process"] for t in texts.values())
    console.print(f"identical text in all three layouts: [bold]{same}[/]")
    console.print(f"[dim]{texts['one process'][0][:100]!r}[/]")
    show_table(console, rows)
    console.print(f"{tokens} tokens generated; {fed} through a forward (the prompts' {fed - tokens + len(outs)}, and "
                  f"every generated token but each request's last): a formula per token of a forward (docs/moe.md) "
                  f"times {fed / tokens:.3f} is a figure per generated token")  # fmt: skip
    routing = route_line(model, LINE)
    show_routing(console, routing)
    plot(args.plot, routing)
    console.print(f"routing picture: {args.plot}")
    return {"identical": same, "rows": rows, "routing": routing, "plot": args.plot}


def show_table(console: Console, rows: dict) -> None:
    t = Table(title="same prompts, same tokens: what each layout sends per generated token (all ranks)")
    for col in ("layout", "tok/s", "message", "msgs/tok", "bytes/tok", "on the wire", "alpha-beta"):
        t.add_column(col, justify="right")
    for name, r in rows.items():
        first = True
        for kind, k in r["kinds"].items():
            if not k["calls"]:
                continue
            t.add_row(name if first else "", f"{r['tps']:.0f}" if first else "", kind, f"{k['calls']:.1f}",
                      f"{k['bytes'] / 1024:.2f} KiB", "-" if k["seconds"] is None else f"{k['seconds']:.3f} s",
                      "-" if k["predicted"] is None else f"{k['predicted']:.3f} s")  # fmt: skip
            first = False
        if first:
            t.add_row(name, f"{r['tps']:.0f}", "none", "0", "0", "-", "-")
    console.print(t)
    console.print("[dim]moe_all_reduce: TP's sum of every expert's slices; all_to_all_counts: EP's row counts, "
                  "sent before the rows; all_to_all: EP's dispatch and combine (bytes to other ranks); all_gather: "
                  "EP's slices back to every rank; all_reduce: attention's, the same in both[/]")  # fmt: skip


@torch.inference_mode()
def route_line(model: str, line: str) -> dict:
    """One forward of `line` through level 0's model: each MoE layer's expert choices per byte."""
    from level0_naive.kv_cache import Slab, SlabAttention
    from level0_naive.loader import load_model

    loaded = load_model(model, torch.float32)
    ids = loaded.tokenizer(line, add_special_tokens=False)["input_ids"]
    slab = Slab(loaded.config, len(ids), torch.float32, "cpu")
    loaded.model(torch.tensor(ids), torch.arange(len(ids)), SlabAttention([slab], torch.tensor([0, len(ids)])))
    layers = [layer.mlp.last_ids.tolist() for layer in loaded.model.model.layers if hasattr(layer.mlp, "last_ids")]
    E = loaded.config.moe.num_experts
    load = [[sum(e == x for tok in choices for e in tok) / (len(choices) * len(choices[0])) for x in range(E)]
            for choices in layers]  # fmt: skip
    return {"chars": [loaded.tokenizer.decode([t]) for t in ids], "choices": layers, "load": load, "num_experts": E}


def show_routing(console: Console, routing: dict) -> None:
    t = Table(title="each expert's share of the (token, choice) slots, per layer (uniform: 1/E)")
    t.add_column("layer")
    for e in range(routing["num_experts"]):
        t.add_column(f"e{e}", justify="right")
    for i, row in enumerate(routing["load"]):
        t.add_row(str(i), *(f"{100 * x:.0f} %" for x in row))
    console.print(t)
    first = "".join(c if c.isprintable() and c != " " else "·" for c in routing["chars"])
    console.print(f"[dim]layer 0's first choice per byte of {first!r}:[/]")
    console.print(" ".join(str(tok[0]) for tok in routing["choices"][0]))


def plot(path: Path, routing: dict) -> None:
    """Left: the first-choice expert of every byte of the line, per layer; right: load per expert per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chars, choices, E = routing["chars"], routing["choices"], routing["num_experts"]
    grid = [[tok[0] for tok in layer] for layer in choices]  # [layers, tokens]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 3.2), gridspec_kw={"width_ratios": [4, 1]})
    cmap = plt.get_cmap("tab10", E)
    a.imshow(grid, cmap=cmap, vmin=-0.5, vmax=E - 0.5, aspect="auto")
    a.set_xticks(range(len(chars)), [c if c.strip() else "·" for c in chars], fontsize=7, family="monospace")
    a.set_yticks(range(len(grid)), [f"layer {i}" for i in range(len(grid))], fontsize=8)
    a.set_title("the expert each byte went to first", fontsize=9)
    from matplotlib.patches import Patch

    a.legend(handles=[Patch(color=cmap(e), label=f"expert {e}") for e in range(E)], loc="upper center",
             bbox_to_anchor=(0.5, -0.22), ncols=E, fontsize=7, frameon=False)  # fmt: skip
    im = b.imshow([[100 * x for x in row] for row in routing["load"]], cmap="Blues", aspect="auto", vmin=0)
    b.set_xticks(range(E), [str(e) for e in range(E)], fontsize=8)
    b.set_yticks([])
    b.set_xlabel("expert", fontsize=8)
    b.set_title("share of slots, %", fontsize=9)
    fig.colorbar(im, ax=b, fraction=0.08)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    main()
