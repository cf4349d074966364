"""Lab 3's experiment: time to first token on a shared system prompt, and hit rate against its length.

    python -m labs experiment 3 YOUR_FILE [--prefix-lengths 0 16 64 256 600] [--questions 16]

What it is: for each length L, a "system prompt" of L characters (the built-in tokenizer
is byte-level: about one token each) followed by a short question, asked `--questions`
times: one question first (it warms the cache, as an earlier conversation would), then
all the others at once. Each L runs twice through level 3 with *your* block pool, prefix
caching off and on, and the table shows the prefix's share of a prompt, the hit rate
(cached prompt tokens / prompt tokens looked up, vLLM's definition), the prompt tokens
actually prefilled, and the mean time to first token of the batch, off and on.

What it is not: a benchmark across workloads (`python -m benchmarks.throughput
--workload shared-prefix` is). TTFT is wall-clock on a shared machine; the hit rates and
token counts are exact.

Reference: docs/level3_prefix.md ("Measured"); vLLM `docs/design/prefix_caching.md`.
"""

from __future__ import annotations

import argparse
import gc
import statistics

from ladder.cli import LadderParser, nonneg_int, positive_int, torch_threads
from ladder.models import default_model

QUESTIONS = ["Who speaks first?", "Where are we?", "What news from France?", "Is the king at hand?",
             "What says the Dauphin?", "How goes the siege?", "Who holds the bridge?", "Where lies the army?",
             "Who keeps the gate?", "What hour is it?", "Shall we fight today?", "Who bears the flag?",
             "What says Exeter?", "Who leads the van?", "How many are we?", "Who won the day?"]  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = LadderParser(prog="python -m labs experiment 3 YOUR_FILE", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None, help="checkpoint or built-in name (default: the built-in model)")
    p.add_argument("--prefix-lengths", type=nonneg_int, nargs="+", default=[0, 16, 64, 256, 600],
                   help="system prompt lengths in characters (default 0 16 64 256 600)")  # fmt: skip
    p.add_argument("--questions", type=positive_int, default=16, help="questions per length (default 16)")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--max-tokens", type=positive_int, default=8, help="tokens per answer (default 8)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads (default 1)")
    return p


def system_prompt(n: int) -> str:
    from level3_prefix.demo import SYSTEM

    return (SYSTEM * (n // len(SYSTEM) + 1))[:n]


def run_one(model, prompts, args, caching: bool) -> dict:
    from level0_naive.sampling_params import SamplingParams
    from level3_prefix import LLM

    # -1: every position; the longer system prompts run past the built-in model's 256-token window
    llm = LLM(model, block_size=args.block_size, enable_prefix_caching=caching, seed=0, max_model_len=-1)
    params = SamplingParams(max_tokens=args.max_tokens, min_tokens=args.max_tokens, ignore_eos=True, temperature=0)
    llm.generate(prompts[:1], params, progress=False)  # the first question warms the cache
    before = (llm.stats.prompt_tokens, llm.prefix_stats())
    outs = llm.generate(prompts[1:], params, progress=False)  # then everyone at once
    stats = llm.prefix_stats()
    queries = stats["prefix_cache_queries"] - before[1]["prefix_cache_queries"]
    hits = stats["prefix_cache_hits"] - before[1]["prefix_cache_hits"]
    return dict(prefilled=llm.stats.prompt_tokens - before[0], hit_rate=hits / queries if queries else 0.0,
                ttft=statistics.mean(o.metrics.ttft for o in outs),
                prompt_len=statistics.mean(len(o.prompt_token_ids) for o in outs))  # fmt: skip


def main(argv=None) -> list[dict]:
    args = parser().parse_args(argv)
    if args.questions < 2:
        parser().error("argument --questions: at least 2 (one warms the cache)")
    model = args.model or default_model()
    rows = []
    with torch_threads(args.threads):
        for n in args.prefix_lengths:
            prefix = system_prompt(n)
            prompts = [f"{prefix}\n{QUESTIONS[i % len(QUESTIONS)]}" for i in range(args.questions)]
            off = run_one(model, prompts, args, False)
            gc.collect()  # an engine holds its KV pool (1 GiB) in reference cycles: free it before the next
            on = run_one(model, prompts, args, True)
            gc.collect()
            rows.append(dict(prefix=n, share=n / on["prompt_len"], off=off, on=on))
            print(f"  ran prefix length {n}", flush=True)
    print(f"\n{args.questions - 1} questions at once after a first one, block size {args.block_size}, "
          f"{args.max_tokens} tokens each; model {model}")  # fmt: skip
    print(f"{'prefix':>6} {'share':>6} {'hit rate':>8} {'prefilled off':>13} {'prefilled on':>12} "
          f"{'TTFT off':>9} {'TTFT on':>8}")  # fmt: skip
    for r in rows:
        print(f"{r['prefix']:>6} {100 * r['share']:>5.0f}% {100 * r['on']['hit_rate']:>7.0f}% "
              f"{r['off']['prefilled']:>13} {r['on']['prefilled']:>12} {r['off']['ttft']:>8.2f}s {r['on']['ttft']:>7.2f}s")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
