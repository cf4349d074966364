"""Lab 2's experiment: thrashing under a tight KV budget, and an admission watermark.

    python -m labs experiment 2 YOUR_FILE [--watermarks 0 0.02 0.05 0.1 0.2] [--requests 96]

What it is: the `spread` workload of the benchmarks (prompts 16-64 tokens, outputs 8-512,
exact lengths) through level 1 (static batching) and through level 2 with *your*
scheduler, on a KV budget that holds `--kv-requests` worst-case requests, once per
watermark. Before each level-2 run it sets `engine.scheduler.watermark = w`; a scheduler
whose `_admit` refuses an admission that would leave fewer than `w * num_blocks` free
blocks turns that into a policy (the handout says how). It prints, per run: preemptions,
prompt tokens prefilled (recomputation included, and as a multiple of the prompts), the
steps and the requests running in a step (mean over the steps), output tokens/s, mean time
to first token and wall time.

What it is not: a benchmark that can fail. Tokens/s on a shared machine drifts by 10-20 %
between runs, more on a busy one; preemptions, prefilled tokens, steps and requests
running depend only on the token counts and the policy, so they are exact and repeatable.

Reference: docs/level2_continuous.md, exercise 3; vLLM V0's `watermark` (BlockSpaceManager).
"""

from __future__ import annotations

import argparse
import statistics
import time

from ladder.cli import LadderParser, nonneg_float, positive_int, torch_threads
from ladder.models import default_model


def parser() -> argparse.ArgumentParser:
    p = LadderParser(prog="python -m labs experiment 2 YOUR_FILE", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None, help="checkpoint or built-in name (default: the built-in model)")
    p.add_argument("--requests", type=positive_int, default=96, help="spread requests (default 96)")
    p.add_argument("--kv-requests", type=positive_int, default=16,
                   help="the KV budget holds this many worst-case requests (default 16)")  # fmt: skip
    p.add_argument("--watermarks", type=nonneg_float, nargs="+", default=[0.0, 0.02, 0.05, 0.1, 0.2],
                   help="fractions of the pool to keep free at admission (default 0 0.02 0.05 0.1 0.2)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seeds the workload (default 0)")
    p.add_argument("--quick", action="store_true", help="every length about 8-16x shorter: a smoke run in seconds")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads (default 1)")
    return p


def run_one(llm, prompts, params) -> dict:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, progress=False)
    wall = time.perf_counter() - t0
    s = llm.stats
    # The requests each step ran: level 2's step log names them (its stats count those still running after the
    # step, the finished ones gone); level 1's stats count the step's own.
    log = getattr(llm.llm_engine, "step_log", None)
    running = statistics.mean(len(r.request_ids) for r in log) if log else s.running_sum / max(s.steps, 1)
    return dict(preemptions=s.preemptions, prefilled=s.prompt_tokens, steps=s.steps, running=running,
                tok_s=s.output_tokens_per_s,
                ttft=statistics.mean(o.metrics.ttft for o in outs), wall=wall)  # fmt: skip


def main(argv=None) -> list[dict]:
    args = parser().parse_args(argv)
    from benchmarks.workloads import make_workload
    from level0_naive.sampling_params import SamplingParams
    from level1_paged import LLM as StaticLLM
    from level2_continuous import LLM

    model = args.model or default_model()
    rows = []
    with torch_threads(args.threads):
        probe = LLM(model, kv_cache_memory=1 << 20)
        vocab, per_token = probe.llm_engine.model_config.vocab_size, probe.llm_engine.bytes_per_token
        del probe
        wl = make_workload("spread", args.requests, vocab, seed=args.seed, quick=args.quick)
        prompts = [r.prompt for r in wl.first]
        params = [SamplingParams(max_tokens=r.max_tokens, min_tokens=r.max_tokens, ignore_eos=True, temperature=0)
                  for r in wl.first]  # fmt: skip
        budget = args.kv_requests * wl.max_seq_len * per_token
        prompt_total = sum(len(p) for p in prompts)
        # max_model_len -1: every position; spread's longest requests run past the built-in model's 256-token window
        kw = dict(kv_cache_memory=budget, max_num_seqs=256, seed=args.seed, max_model_len=-1)
        print(f"{args.requests} spread requests ({wl.description}), {sum(r.max_tokens for r in wl.first)} output "
              f"tokens; KV budget {budget / 2**20:.1f} MiB = {args.kv_requests} worst-case requests; model {model}")  # fmt: skip
        if not hasattr(LLM(model, **kw).llm_engine.scheduler, "watermark"):
            print("note: your Scheduler has no `watermark` attribute, so every level-2 row runs the same policy "
                  "(the handout's part 2 adds it)")  # fmt: skip
        warm = StaticLLM(model, **kw)
        warm.generate(prompts[:2], params[:2], progress=False)  # first-call costs out of the measurement
        rows.append(dict(engine="level 1 (static)", **run_one(StaticLLM(model, **kw), prompts, params)))
        for w in args.watermarks:
            llm = LLM(model, **kw, step_log_size=1 << 20)  # every step's record, not the last 1024
            llm.llm_engine.scheduler.watermark = w
            rows.append(dict(engine=f"level 2, watermark {w:g}", **run_one(llm, prompts, params)))
            print(f"  ran watermark {w:g}", flush=True)
    print()
    print(f"{'engine':<26} {'preemptions':>11} {'prefilled':>10} {'x prompts':>9} {'steps':>6} {'running':>7} "
          f"{'tok/s':>7} {'TTFT mean':>9} {'wall':>6}")  # fmt: skip
    for r in rows:
        print(f"{r['engine']:<26} {r['preemptions']:>11} {r['prefilled']:>10} {r['prefilled'] / prompt_total:>8.2f}x "
              f"{r['steps']:>6} {r['running']:>7.2f} {r['tok_s']:>7.0f} {r['ttft']:>8.2f}s {r['wall']:>5.1f}s")  # fmt: skip
    print("running: the requests a step ran, mean over the steps; steps, running, preemptions and prefilled are exact")
    return rows


if __name__ == "__main__":
    main()
