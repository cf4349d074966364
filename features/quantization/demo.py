"""`python -m features.quantization.demo`: the KV cache in 8 bits. The same memory holds about 4x the blocks, so
more requests run at once.

    python -m features.quantization.demo              # 16 requests of 64 greedy tokens, three caches
    python -m features.quantization.demo --quick      # 8 requests of 24 tokens (seconds)
    python -m features.quantization.demo --no-plot    # the numbers only

What it is: one KV budget (room for `--budget-requests` of the demo's longest requests in float32)
spent three ways, `kv_cache_dtype=` "auto" (the model's float32), "fp8" and "int8": level 1's setting,
whose formats are this room's kv.py (the engine reaches them through ladder/rooms.py; this demo uses
only the setting). It lives with the room, not at level 1 as the issue named it, because its step
loop is level 2's and a level imports no level above it. One cached number takes 4 bytes in float32, 1 in fp8, and 1 in int8 plus a 4-byte
scale per token and head (docs/quantization.md):

    one token's K and V = 2 x layers x KV heads x (head_dim x 4 | head_dim | head_dim + 4) bytes
    blocks = budget // (block_size x that)        float32 : fp8 : int8  =  1 : 4 : 4D / (D + 4)

The same greedy requests go through each engine's online API (`add_request`, then `step` until done; the
step loop is level 2's, so the engine is level 3's `LLMEngine`, prefix caching off so that every block
has one owner), and after every step the demo notes how many requests were running and which blocks
each one held. Printed: each pool's blocks and bytes per token, the peak and mean requests running,
preemptions, steps and a rough tokens/s; the first request's text in each format and whether it is
float32's. Either format can tip a near tie between two tokens (fp8, with 3 mantissa bits, more often:
docs/quantization.md's agreement table), and one changed greedy token sends the rest of a text elsewhere;
where they differ, the demo says how near a tie float32 saw there.
Drawn (unless `--no-plot`): each pool at the step with the most requests running, one square per block
coloured by the request that holds it, and the requests running step by step.

What it is not: a benchmark (`python -m benchmarks.quantization --kv` is: repeats, the best of each) or an
accuracy figure (`python -m benchmarks.quality`).
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from ladder.cli import LadderParser, at_least_one, plot_flag, positive_int, run_demo, save_figure
from ladder.models import default_model
from level0_naive import LLM as NaiveLLM
from level0_naive import SamplingParams
from level1_paged.block_table import blocks_for
from level3_prefix import LLMEngine

DTYPES = ("auto", "fp8", "int8")
LINES = [  # prompts of 30-60 tokens (bytes): a request's prefill takes a few blocks before it writes a word
    "ROMEO:\nBut, soft! what light through yonder window breaks?\n",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n",
    "HAMLET:\nTo be, or not to be: that is the question.\n",
    "KING RICHARD III:\nNow is the winter of our discontent\n",
    "MACBETH:\nIs this a dagger which I see before me?\n",
    "PORTIA:\nThe quality of mercy is not strain'd;\n",
    "JAQUES:\nAll the world's a stage,\n",
    "MARK ANTONY:\nFriends, Romans, countrymen, lend me your ears;\n",
]
LABEL = {"auto": "float32", "fp8": "fp8", "int8": "int8"}


def parser() -> LadderParser:
    p = LadderParser(prog="python -m features.quantization.demo", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None, help="a checkpoint directory or built-in name (default: tiny-shakespeare)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA if available")
    p.add_argument("--requests", type=positive_int, default=None, help="how many requests (default 16, quick 8)")
    p.add_argument("--max-tokens", type=positive_int, default=None,
                   help="greedy tokens per request (default 64, quick 24)")  # fmt: skip
    p.add_argument("--budget-requests", type=at_least_one, default=4.0,
                   help="KV budget, in the longest request's float32 bytes (>= 1; default 4)")  # fmt: skip
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--quick", action="store_true", help="8 requests of 24 tokens (seconds)")
    p.add_argument("--no-plot", action="store_true", help="draw no picture")
    plot_flag(p, "quant_demo.png", "the picture of the three pools")
    return p


def main(argv=None) -> dict:
    return run_demo(parser(), argv, run, plot="quant_demo.png")


def run(args, console: Console) -> dict:
    model = args.model or default_model()
    n = args.requests or (8 if args.quick else 16)
    max_tokens = args.max_tokens or (24 if args.quick else 64)
    prompts = [LINES[i % len(LINES)] for i in range(n)]
    # ignore_eos: every request makes exactly max_tokens, so the three runs do the same work; request 0 also
    # keeps its two best tokens' logprobs at each step, to say how close a choice the formats disagree on was
    params = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2 if i == 0 else None)
              for i in range(n)]  # fmt: skip
    common = dict(dtype="float32", device=args.device, enable_prefix_caching=False)
    probe = NaiveLLM(model, kv_cache_memory=1, dtype="float32", device=args.device).llm_engine  # sizes only, no KV
    longest = max(len(probe.tokenizer(p)["input_ids"]) for p in prompts) + max_tokens
    # in whole float32 blocks (so fp8's pool is exactly 4x), and at least the longest request, or it could never run
    tokens = max(int(args.budget_requests * longest), longest)
    tokens = blocks_for(tokens, args.block_size) * args.block_size
    budget = tokens * probe.bytes_per_token
    del probe
    console.print(f"[bold]the KV cache in 8 bits[/]: {n} requests of {max_tokens} greedy tokens\nmodel: {model}\n"
                  f"one KV budget: {budget / 2**20:.2f} MiB = {args.budget_requests:g} x the longest request "
                  f"({longest} tokens) in float32")  # fmt: skip

    runs = {}
    for dt in DTYPES:
        engine = LLMEngine(model, kv_cache_memory=budget, kv_cache_dtype=dt, block_size=args.block_size, **common)
        console.print(f"  {LABEL[dt]:>7}: {engine.num_blocks:>4} blocks, {engine.bytes_per_token:,} bytes per token")
        runs[dt] = run_requests(engine, prompts, params)

    print_table(console, runs, budget)
    same = print_texts(console, runs, prompts[0])
    picture = None
    if not args.no_plot:
        picture = args.plot
        plot(picture, runs, args.block_size)
        console.print(f"picture: {picture}")
    return {"blocks": {LABEL[d]: r["blocks"] for d, r in runs.items()},
            "bytes_per_token": {LABEL[d]: r["bytes_per_token"] for d, r in runs.items()},
            "peak_running": {LABEL[d]: r["peak"] for d, r in runs.items()},
            "mean_running": {LABEL[d]: r["mean"] for d, r in runs.items()},
            "preemptions": {LABEL[d]: r["preemptions"] for d, r in runs.items()},
            "steps": {LABEL[d]: len(r["running"]) for d, r in runs.items()},
            "texts": {LABEL[d]: r["outputs"]["0"].text for d, r in runs.items()},
            "same_text": same, "budget": budget, "picture": picture}  # fmt: skip


# --- measuring --------------------------------------------------------------------------
def run_requests(engine, prompts: list[str], params: list[SamplingParams]) -> dict:
    """Every prompt through `add_request` and `step`, noting after each step who runs and which blocks
    each holds; the layout kept is the one with the most requests running (the fullest pool among ties)."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    running, used, finals, best = [], [], {}, None
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0]  # its text, token ids and (request 0) logprobs
        now = engine.scheduler.running
        running.append(len(now))
        used.append(engine.num_blocks - engine.num_free_blocks())  # blocks some request holds
        if best is None or (running[-1], used[-1]) > (len(best[1]), best[2]):
            # request index -> its block table (physical block ids in logical order)
            best = (len(running), {int(r.request_id): list(engine.kv.block_table(r)) for r in now}, used[-1])
    seconds = time.perf_counter() - t0
    return {"blocks": engine.num_blocks, "bytes_per_token": engine.bytes_per_token, "running": running,
            "peak": max(running), "mean": sum(running) / len(running),
            "preemptions": engine.stats.preemptions, "tokens_per_s": engine.stats.generated_tokens / seconds,
            "outputs": finals, "snapshot": best}  # fmt: skip


def print_table(console: Console, runs: dict, budget: int) -> None:
    t = Table(title=f"the same {budget / 2**20:.2f} MiB of KV cache, three formats")
    for col in ("cache", "bytes/tok", "blocks", "peak", "mean", "preempt.", "steps", "tok/s"):
        t.add_column(col, justify="left" if col == "cache" else "right")
    for dt, r in runs.items():
        t.add_row(LABEL[dt], f"{r['bytes_per_token']:,}", str(r["blocks"]), str(r["peak"]), f"{r['mean']:.1f}",
                  str(r["preemptions"]), str(len(r["running"])), f"{r['tokens_per_s']:.0f}")  # fmt: skip
    console.print(t)
    console.print("  bytes/tok: one token's K and V, all layers;  blocks: of the same budget\n"
                  "  peak, mean: requests running after a step;  steps: model steps to the end\n"
                  "  preempt.: requests sent back to be recomputed, for want of a block\n"
                  "  tok/s: output tokens/s, one run each: a rough figure (the benchmark, the\n"
                  "  best of repeats: python -m benchmarks.quantization --kv)")  # fmt: skip


def print_texts(console: Console, runs: dict, prompt: str) -> dict:
    """The first request's text in each format, and whether it is float32's (a difference is shown, not hidden)."""
    ref = runs["auto"]["outputs"]["0"]
    console.print(f"\n[bold]request 0[/] (greedy), prompt {prompt!r}\n[bold]float32[/]: {ref.text!r}")
    same = {"float32": True}
    for dt in DTYPES[1:]:
        out = runs[dt]["outputs"]["0"]
        same[LABEL[dt]] = out.text == ref.text
        if same[LABEL[dt]]:
            console.print(f"[bold]{LABEL[dt]}[/]: the same text as float32")
            continue
        k = next((i for i, (a, b) in enumerate(zip(out.token_ids, ref.token_ids)) if a != b), None)
        console.print(f"[bold]{LABEL[dt]}[/]: {out.text!r}")
        console.print("  [yellow]not float32's text[/]" +
                      ("" if k is None else f" from token {k} on: {near_tie(ref, out.token_ids[k], k)}"))  # fmt: skip
    return same


def near_tie(ref, token: int, k: int) -> str:
    """How far float32 put the token the 8-bit cache chose below its own choice, at the first difference."""
    lp = ref.logprobs[k] if ref.logprobs else {}
    if token not in lp:  # not float32's second choice: no near tie to name
        return "Every later token follows from that one."
    ours, theirs = lp[ref.token_ids[k]], lp[token]
    return (
        f"float32 put {ours.decoded_token!r} only {ours.logprob - theirs.logprob:.4f} nats above "
        f"{theirs.decoded_token!r} there, a near tie the 8-bit rounding tipped; every later token follows from it"
    )


# --- the picture ------------------------------------------------------------------------
def plot(path, runs: dict, block_size: int) -> None:
    """One panel per pool (a square per block, the same size in all, coloured by its request, white if free),
    and the requests running at each step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    cols = 8  # blocks per row, the same in every panel: a pool 4x as large is 4x as tall
    rows = max(-(-r["blocks"] // cols) for r in runs.values())
    colors = plt.get_cmap("tab20").colors
    fig, axes = plt.subplots(1, len(runs) + 1, figsize=(14, 7), gridspec_kw={"width_ratios": [1] * len(runs) + [2]})
    for ax, (dt, r) in zip(axes, runs.items()):
        step, tables, _ = r["snapshot"]
        owner = {b: i for i, table in tables.items() for b in table}  # physical block -> request index
        for b in range(r["blocks"]):
            x, y = b % cols, b // cols
            i = owner.get(b)
            ax.add_patch(Rectangle((x, -y - 1), 0.92, 0.92, facecolor="white" if i is None else colors[i % 20],
                                   edgecolor="0.6", lw=0.5))  # fmt: skip
            if i is not None:
                ax.text(x + 0.46, -y - 0.54, str(i), ha="center", va="center", fontsize=6)
        ax.set_xlim(-0.2, cols + 0.1)
        ax.set_ylim(-rows - 0.2, 0.2)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title(f"{LABEL[dt]}: {r['blocks']} blocks of {block_size} tokens\n{len(tables)} requests running "
                     f"(step {step})", fontsize=10)  # fmt: skip
    ax = axes[-1]
    styles = {"auto": dict(lw=1.5), "fp8": dict(lw=4, alpha=0.5), "int8": dict(lw=1.5, ls="--")}  # fp8, int8 coincide
    for dt, r in runs.items():
        ax.step(range(1, len(r["running"]) + 1), r["running"], where="post", **styles.get(dt, {}),
                label=f"{LABEL[dt]}: peak {r['peak']}, mean {r['mean']:.1f}, {r['preemptions']} preemptions")  # fmt: skip
    ax.set_ylim(0, max(r["peak"] for r in runs.values()) + 1)
    ax.set_xlabel("model step")
    ax.set_ylabel("requests running")
    ax.set_title("requests running at each step\n(the same KV memory)", fontsize=10)
    ax.legend(loc="upper right", fontsize=7)
    fig.suptitle("the same KV memory in float32, fp8 and int8: a square is a block, its colour and number the "
                 "request holding it (white: free)", fontsize=11)  # fmt: skip
    save_figure(fig, path)


if __name__ == "__main__":
    main()
