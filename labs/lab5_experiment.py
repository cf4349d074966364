"""Lab 5's experiment: tensor parallelism over gloo, and what a token costs in communication.

    python -m labs experiment 5 YOUR_FILE [--tp 1 2] [--requests 4] [--max-tokens 16]

What it is: the same prompts, greedy, through level 5 with *your* layers at each
`--tp` (TP=2 starts one more process, which runs your file too), on this CPU over gloo.
Per layout it prints tokens/s; rank 0's all-reduces and gathers, calls and bytes, and the
bytes per token through a forward (prompt tokens and generated ones), next to what the
model's shapes predict (two all-reduces per layer
and one for the embedding, each of [tokens, hidden], per forward; one gather of the
logits rows); rank 0's seconds inside all-reduces, next to the latency-bandwidth
model t = calls x alpha + bytes x beta with alpha and beta measured here first
(`--no-calibrate` skips that); and whether the text equals TP=1's.

What it is not: a speed demonstration: a gloo message costs about a millisecond on a CPU
and a 6M-parameter layer far less, so TP=2 is slower here (docs/level5_multigpu.md, "On
GPUs", says why it is the other way round on NVLink).

Reference: Shoeybi et al., "Megatron-LM" (2019), section 3; docs/level5_multigpu.md.
"""

from __future__ import annotations

import argparse
import time

from ladder.cli import LadderParser, positive_int, prompts_for, torch_threads
from ladder.models import default_model


def parser() -> argparse.ArgumentParser:
    p = LadderParser(prog="python -m labs experiment 5 YOUR_FILE", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None, help="checkpoint or built-in name (default: the built-in model)")
    p.add_argument("--tp", type=positive_int, nargs="+", default=[1, 2], help="tensor-parallel sizes (default 1 2)")
    p.add_argument("--requests", type=positive_int, default=4, help="prompts (default 4)")
    p.add_argument("--max-tokens", type=positive_int, default=16, help="tokens per prompt (default 16)")
    p.add_argument("--dtype", default="float64", help="float64 (default: no near-tie can flip) or float32")
    p.add_argument("--no-calibrate", action="store_true", help="skip measuring alpha and beta")
    return p


def snapshot(llm) -> dict:
    """Rank 0's counters now: {kind: [calls, bytes, seconds]} (a copy; the live object keeps counting)."""
    return {k: list(v) for k, v in llm.comm_stats()[0][0].by_kind.items()}


def delta(before: dict, after: dict, kind: str) -> list:
    return [a - b for a, b in zip(after.get(kind, [0, 0, 0.0]), before.get(kind, [0, 0, 0.0]))]


def main(argv=None) -> list[dict]:
    args = parser().parse_args(argv)
    from level0_naive.loader import load_metadata
    from level0_naive.sampling_params import SamplingParams
    from level5_multigpu import LLM
    from level5_multigpu.parallel_state import predicted_seconds

    model = args.model or default_model()
    cfg = load_metadata(model).config
    prompts = prompts_for(args.requests)
    params = SamplingParams(max_tokens=args.max_tokens, min_tokens=args.max_tokens, ignore_eos=True, temperature=0)
    width = 8 if args.dtype == "float64" else 4
    rows, texts = [], {}
    with torch_threads(1):
        for tp in args.tp:
            with LLM(model, dtype=args.dtype, tensor_parallel_size=tp, distributed_timeout_s=120) as llm:
                fit = {} if args.no_calibrate else llm.llm_engine.calibrate().get("all_reduce", {})
                before = snapshot(llm)
                steps_before = llm.stats.steps
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, progress=False)
                seconds = time.perf_counter() - t0
                after = snapshot(llm)
                steps = llm.stats.steps - steps_before
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            fed = sum(
                len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outs
            )  # tokens through a forward
            texts[tp] = [o.outputs[0].token_ids for o in outs]
            ar, ga = (delta(before, after, kind) for kind in ("all_reduce", "gather"))
            per_forward = 2 * cfg.num_layers + 1 if tp > 1 else 0
            rows.append(dict(tp=tp, tok_s=tokens / seconds, tokens=tokens, steps=steps, ar_calls=ar[0],
                             ar_bytes=ar[1], ar_s=ar[2], gathers=ga[0], pred_calls=per_forward * steps,
                             pred_bytes=per_forward * fed * cfg.hidden_size * width,
                             pred_s=predicted_seconds(fit, ar[0], ar[1]) if fit else None,
                             alpha_us=1e6 * fit["alpha_s"] if fit else None, fed=fed,
                             beta_us_per_kib=1e6 * 1024 * fit["beta_s_per_byte"] if fit else None))  # fmt: skip
    print(f"\n{model}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {args.requests} prompts x "
          f"{args.max_tokens} tokens, {args.dtype}, gloo on this CPU")  # fmt: skip
    r = rows[0]
    print(f"{r['steps']} steps; {r['fed']} tokens through a forward ({r['fed'] - r['tokens'] + args.requests} prompt "
          f"tokens, and every generated token but each request's last), {r['tokens']} generated")  # fmt: skip
    print(f"{'TP':>3} {'tok/s':>7} {'all-reduces':>11} {'predicted':>9} {'KiB':>8} {'predicted':>9} {'per token':>10} "
          f"{'gathers':>7} {'rank 0 s':>8} {'a-b model':>9} {'alpha':>7} {'beta':>10}  same text")  # fmt: skip
    for r in rows:
        pred_s = "-" if r["pred_s"] is None else f"{r['pred_s']:.3f}"
        alpha = "-" if r["alpha_us"] is None else f"{r['alpha_us']:.0f}us"
        beta = "-" if r["beta_us_per_kib"] is None else f"{r['beta_us_per_kib']:.2f}us/KiB"
        print(f"{r['tp']:>3} {r['tok_s']:>7.0f} {r['ar_calls']:>11} {r['pred_calls']:>9} {r['ar_bytes'] / 1024:>8.1f} "
              f"{r['pred_bytes'] / 1024:>9.1f} {r['ar_bytes'] / r['fed'] / 1024:>8.2f}Ki {r['gathers']:>7} "
              f"{r['ar_s']:>8.3f} {pred_s:>9} {alpha:>7} {beta:>10}  {texts[r['tp']] == texts[args.tp[0]]}")  # fmt: skip
    print("per token: all-reduce KiB per token through a forward; beta: the per-byte cost, in microseconds per KiB")
    return rows


if __name__ == "__main__":
    main()
