"""`python -m level3_prefix.beam_demo`: beam search on the paged cache, and the blocks its beams share.

One prompt, `--beam-width` beams (default 4), `--max-tokens` tokens (default 48). The demo
prints the finished beams, best first, with their scores; then the block-sharing picture,
drawn at a few steps of the search: each live beam's block table, a cell per block with the
number of beams that hold it. Blocks the beams agree on are held once (green, the count is
their number of holders); each beam's own tail is grey. Below it: blocks held against
blocks without sharing, at every step and over the whole search, and how many blocks the
copy-on-write copied. Then the same for `n` samples of the prompt, which fork after it.

What it is not: a benchmark (`python -m benchmarks.beam_memory` measures the saving on
two length mixes, beside the PagedAttention paper's figures).
"""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from ladder.cli import demo_parser, positive_int, run_demo
from ladder.models import default_model
from level0_naive.sampling_params import SamplingParams

from .beam_search import BeamSearchParams, beam_search
from .engine import LLM

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?"


def table_row(label: str, blocks: list[int], refs: list[int]) -> Text:
    row = Text(f"{label:>8} ")
    for b, r in zip(blocks, refs):
        row.append(f"{b:>3}:{r}", style="bold black on green" if r > 1 else "black on grey70")
        row.append(" ")
    return row


def picture(snapshots: list[tuple[int, list[list[int]], list[int]]], label: str) -> Text:
    """snapshots: (step, tables of the live sequences, ref count per block id)."""
    pic = Text()
    for step, tables, refs in snapshots:
        held, without = len({b for t in tables for b in t}), sum(map(len, tables))
        pic.append(
            f"step {step}: {len(tables)} {label}, {held} blocks held, {without} without sharing\n", style="italic"
        )
        for i, t in enumerate(tables):
            pic.append_text(table_row(f"{label[:-1]} {i}", t, [refs[b] for b in t]))
            pic.append("\n")
    pic.append("a cell 'b:r' is KV block b, held by r sequences (green: shared, grey: its own)", style="italic")
    return pic


def main(argv=None) -> dict:
    p = demo_parser(__doc__, "level3_prefix.beam_demo")
    p.add_argument("--beam-width", type=positive_int, default=4)
    p.add_argument("--block-size", type=positive_int, default=8, help="tokens per KV block (default 8: small, to see)")
    p.set_defaults(max_tokens=48, temperature=0.0)
    return run_demo(p, argv, run)


def run(args, console: Console) -> dict:
    model = args.model or default_model()
    llm = LLM(model, dtype=args.dtype, device=args.device, block_size=args.block_size, seed=args.seed,
              enable_prefix_caching=False)  # fmt: skip
    engine, kv = llm.llm_engine, llm.llm_engine.kv
    steps, totals = [], [0, 0]

    def on_step(beams):
        tables = [kv.block_table(b) for b in beams]
        totals[0] += len({b for t in tables for b in t})
        totals[1] += sum(map(len, tables))
        steps.append((len(steps) + 1, tables, kv.ref_counts()))

    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens, temperature=args.temperature)
    [out] = beam_search(engine, [PROMPT], params, on_step=on_step)
    console.print(f"[bold]beam search[/], width {args.beam_width}, up to {args.max_tokens} tokens, block size "
                  f"{args.block_size}; model {model}\n[bold]prompt[/] {PROMPT!r}")  # fmt: skip
    for i, s in enumerate(out.sequences):
        text = s.text[len(PROMPT) :] if s.text and s.text.startswith(PROMPT) else repr(s.output_token_ids)
        console.print(f"  beam {i}  score {s.score:8.4f}  ({s.finish_reason}, {len(s.logprobs)} tokens)  {text!r}")
    shown = [steps[0], steps[len(steps) // 2], steps[-1]] if len(steps) > 2 else steps
    console.print(picture(shown, "beams"))
    beam_saved = 1 - totals[0] / totals[1]
    console.print(f"over the search: {totals[0]} block-steps held, {totals[1]} without sharing: "
                  f"[bold]{100 * beam_saved:.0f}% saved[/]; {kv.num_copied} blocks copied on write")  # fmt: skip

    # n samples of the same prompt: they fork after it
    snaps, n = [], args.beam_width
    llm2 = LLM(model, dtype=args.dtype, device=args.device, block_size=args.block_size, seed=args.seed,
               enable_prefix_caching=False, observers=[lambda record, snap: snaps.append(snap)])  # fmt: skip
    sp = SamplingParams(n=n, max_tokens=args.max_tokens, temperature=args.temperature or 1.0, seed=args.seed)
    llm2.generate([PROMPT], sp, progress=False)
    views = [(i + 1, [list(r.block_ids) for r in s.requests if r.status == "running"], list(s.ref_counts))
             for i, s in enumerate(snaps)]  # fmt: skip
    views = [v for v in views if len(v[1]) == n]
    console.print(f"\n[bold]parallel sampling[/], n = {n}: sample 0 prefills the prompt, the others fork from it")
    console.print(picture(views[:1] + views[-1:], "samples"))
    forked = llm2.llm_engine.kv.forked_tokens
    console.print(f"{forked} prompt tokens taken from sample 0 instead of computed; "
                  f"{llm2.stats.prompt_tokens} prompt tokens computed in all")  # fmt: skip
    return {"sequences": out.sequences, "beam_saved": beam_saved, "copied": kv.num_copied, "forked_tokens": forked}


if __name__ == "__main__":
    main()
