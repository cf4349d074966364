"""`python -m level3_prefix.demo`: the headline demo. A long shared system prompt, many short
questions, prefix caching off and on.

Every request is "system prompt (several hundred tokens) + a short question". The
system prompt has been seen once before (a first conversation warms the cache, as in
any chat service). Then all the questions arrive at once. Without caching each one
prefills the whole system prompt again; with caching it is found in the block pool and
only the question is computed. The table shows time to first token (TTFT), throughput
and hit rate; a panel shows which KV blocks five running requests share; a plot of
every request's TTFT goes to a folder outside the repository (printed at the end;
`--plot PATH` to choose; `python -m ladder.figures` regenerates the committed
`docs/img/level3_ttft.png`).
"""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ladder.cli import demo_parser, plot_flag, positive_int, run_demo, save_figure
from ladder.models import default_model
from level0_naive.sampling_params import SamplingParams

from .engine import LLM, LLMEngine

SYSTEM = (
    "You are the Chorus of a history play. Speak in blank verse, as the Chorus of King Henry V "
    "speaks: O for a Muse of fire, that would ascend the brightest heaven of invention, a kingdom "
    "for a stage, princes to act and monarchs to behold the swelling scene! Then should the warlike "
    "Harry, like himself, assume the port of Mars; and at his heels, leash'd in like hounds, should "
    "famine, sword and fire crouch for employment. But pardon, gentles all, the flat unraised "
    "spirits that have dared on this unworthy scaffold to bring forth so great an object. Answer "
    "every question briefly, name the speaker, and keep to the matter of the play. "
)
QUESTIONS = [
    "Who speaks first?", "Where are we?", "What news from France?", "Is the king at hand?",
    "What says the Dauphin?", "How goes the siege?", "Who holds the bridge?", "What of the tennis balls?",
    "Where lies the army?", "Who keeps the gate?", "What hour is it?", "Shall we fight today?",
    "What of the French?", "Who bears the flag?", "What says Exeter?", "Is Falstaff dead?",
    "Who leads the van?", "What of the prisoners?", "How many are we?", "What says the herald?",
    "Who won the day?", "What name has the field?", "Is the princess fair?", "What is the end?",
]  # fmt: skip


def run(llm: LLM, prompts: list[list[int]], max_tokens: int, temperature: float):
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=temperature, ignore_eos=True)
    llm.generate(prompts[:1], params, progress=False)  # a first conversation: warms the cache
    busy = llm.stats.busy_time
    outs = llm.generate(prompts[1:], params, progress=False)  # everyone else, at once
    return outs, llm.stats.busy_time - busy


SHOWN = 5  # requests drawn in the shared-blocks panel


def shared_blocks_picture(model, prompts: list[list[int]], args) -> Text:
    """Admit the first SHOWN questions one step apart, and draw each one's block table by ref
    count while all of them are still running (each generates more tokens than there are steps)."""
    engine = LLMEngine(model, dtype=args.dtype, device=args.device, block_size=args.block_size, max_model_len=-1)
    for i, p in enumerate(prompts[:SHOWN]):
        engine.add_request(f"q{i}", p, SamplingParams(max_tokens=SHOWN + 2, temperature=0, ignore_eos=True))
        engine.step()  # one at a time, so each finds the blocks of those before it
    running = engine.scheduler.running
    pic = Text(
        f"after {SHOWN} steps, one new question admitted per step; all {len(running)} are running:\n", style="italic"
    )
    for req in running:
        pic.append(f"{req.request_id:>4}  ")
        refs = [b.ref_cnt for b in engine.kv.req_blocks[req.seq_id]]
        for ref, run in itertools.groupby(refs):  # a run of blocks with the same ref count: one cell
            pic.append(f" {ref} x{len(list(run))} ", style="bold black on green" if ref > 1 else "black on grey70")
            pic.append(" ")
        pic.append(f" {QUESTIONS[int(req.request_id[1:])]!r}\n")
    pic.append(f"a cell 'r xN' is N consecutive KV blocks of {args.block_size} tokens, each used by r running requests.\n"
               "Green: the system prompt's blocks, shared by all; grey: each question's own tail and answer.",
               style="italic")  # fmt: skip
    return pic


def parser():
    p = demo_parser(__doc__, "level3_prefix.demo")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block (default 16)")
    plot_flag(p, "level3_ttft.png", "the TTFT plot")
    p.set_defaults(max_tokens=16, temperature=0.8)
    return p


def main(argv=None) -> dict:
    return run_demo(parser(), argv, demo, plot="level3_ttft.png")


def demo(args, console: Console) -> dict:
    model = args.model or default_model()

    results = {}
    for caching in (False, True):
        llm = LLM(
            model,
            dtype=args.dtype,
            device=args.device,
            block_size=args.block_size,
            enable_prefix_caching=caching,
            seed=args.seed,
            max_model_len=-1,  # the system prompt alone is 632 tokens: past the built-in model's 256-token window
        )
        prompts = [
            llm.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
            for q in QUESTIONS
        ]
        outs, seconds = run(llm, prompts, args.max_tokens, args.temperature)
        results[caching] = (llm, outs, seconds)
    share = sum(len(SYSTEM.encode()) / len(p) for p in prompts) / len(prompts)  # the byte tokenizer: 1 token a byte
    console.print(f"[bold]level 3[/]: {len(QUESTIONS) - 1} questions after a first one, prompts of "
                  f"{min(map(len, prompts))}..{max(map(len, prompts))} tokens, the shared system prompt is "
                  f"~{100 * share:.0f}% of each; model {model}")  # fmt: skip

    llm_on, outs_on, _ = results[True]
    for out in outs_on[:2]:
        console.print(
            Panel(
                QUESTIONS[int(out.request_id)] + "\n" + out.outputs[0].text,
                title=f"request {out.request_id}",
                expand=False,
            )
        )
    console.print("[dim](the built-in model was trained on 256-byte windows, so after a ~650-token prompt its prose "
                  "degrades; this demo measures time, and checks that caching never changes a token)[/]")  # fmt: skip

    table = Table(title="prefix caching: off vs on (same model, same KV budget)")
    for col in ("", "TTFT mean", "TTFT p50", "TTFT p99", "output tok/s", "prefill tokens computed", "hit rate"):
        table.add_column(col, justify="right")
    ttfts = {}
    for caching, (llm, outs, seconds) in results.items():
        ttft = sorted(1000 * o.metrics.ttft for o in outs)
        ttfts[caching] = ttft
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        hit = llm.prefix_stats()["prefix_cache_hit_rate"] if caching else 0.0
        p99 = ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))]
        table.add_row("on" if caching else "off", f"{statistics.mean(ttft):.0f} ms", f"{statistics.median(ttft):.0f} ms",
                      f"{p99:.0f} ms", f"{tokens / seconds:.0f}", f"{llm.stats.prompt_tokens}", f"{100 * hit:.0f} %")  # fmt: skip
    cut = 1 - statistics.mean(ttfts[True]) / statistics.mean(ttfts[False])
    same = [o.outputs[0].token_ids for o in outs_on] == [o.outputs[0].token_ids for o in results[False][1]]
    console.print(table)
    console.print(f"mean TTFT cut by caching: [bold green]{100 * cut:.0f} %[/]; identical outputs: {same}")
    console.print(
        Panel(
            shared_blocks_picture(model, prompts, args),
            title=f"blocks shared between {SHOWN} running requests (ref counts)",
            expand=False,
        )
    )
    plot(ttfts, args.plot)
    console.print(f"plot: {args.plot}")
    return {
        "ttft_cut": cut,
        "identical": same,
        "ttft_ms": ttfts,
        "hit_rate": llm_on.prefix_stats()["prefix_cache_hit_rate"],
    }


def plot(ttfts: dict[bool, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for caching, color in ((False, "tab:red"), (True, "tab:green")):
        ys = ttfts[caching]
        ax.plot(
            range(1, len(ys) + 1),
            ys,
            marker="o",
            color=color,
            label=f"prefix caching {'on' if caching else 'off'} (mean {statistics.mean(ys):.0f} ms)",
        )
    ax.set_xlabel("requests, sorted by TTFT")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("A shared system prompt: TTFT with and without prefix caching")
    ax.legend()
    ax.grid(alpha=0.3)
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    main()
