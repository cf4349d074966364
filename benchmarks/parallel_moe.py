"""`python -m benchmarks.parallel --moe`: expert parallelism against tensor parallelism, in bytes and seconds.

What it is: the built-in mixture of experts (`tiny-shakespeare-moe`: 4 MoE layers, 8 experts, 2
per token, hidden 192) on two ranks, every expert sliced (TP=2: one all-reduce per MoE layer)
against whole experts per rank (EP: dispatch and combine all-to-alls and an all-gather), greedy,
decode-heavy (8-token prompts, `--max-tokens` outputs), at batches 1, 32 and 128. Per layout and
batch it reports, for the MoE block's messages only (attention's all-reduces are the same in both),

  - bytes per token (all ranks, the tokens the forward passes processed) against the model of
    them, summed over the run's steps: T tokens in a step of L MoE layers, d hidden, b bytes
    per number, N ranks, k experts per token,

        TP   L * N * T * d * b                                        (each rank all-reduces [T, d])
        EP   L * ((2 * d * b + 8) * k * T * (N-1)/N                   (rows to other ranks' experts and back, with
                                                                       an 8-byte expert id each, if routing were uniform;
                  + N * ceil(T/N) * (N-1) * d * b                      the gather, padded;
                  + N * (N-1) * 8)                                     the row counts)

  - seconds inside those messages (the rank that waited least) against the latency-bandwidth
    model, calls * alpha + bytes * beta, alpha and beta measured here first for each kind;
  - output tokens/s.

And, in one process, the grouped expert path (one matmul per expert) against the naive loop (a
token and an expert at a time) on one MoE layer at batch 64, as a ratio.

What it is not: a GPU figure. A gloo message costs about a millisecond here, so both layouts are
far slower than one process; the bytes are what carries over (docs/moe.md).

Reference: Lepikhin et al. 2020, "GShard"; vLLM `fused_moe` (TP vs EP).
"""

from __future__ import annotations

import math
import time

import torch

from ladder.cli import torch_threads
from ladder.models import BUILTIN_MOE

MOE_KINDS = ("moe_all_reduce", "all_to_all_counts", "all_to_all", "all_gather")


def run_layout(model: str, ep: bool, batch: int, max_tokens: int, dtype: str) -> dict:
    from level0_naive import SamplingParams
    from level0_naive.loader import load_metadata
    from level5_multigpu import LLM
    from level5_multigpu.parallel_state import counters, predicted_seconds

    cfg = load_metadata(model).config
    prompts = [[40 + (i % 50)] * 8 for i in range(batch)]
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, temperature=0)
    with LLM(model, dtype=dtype, tensor_parallel_size=2, enable_expert_parallel=ep, max_num_seqs=batch,
             max_num_batched_tokens=8192, kv_cache_memory=1 << 28, max_model_len=512) as llm:  # fmt: skip
        fits = llm.llm_engine.calibrate()
        llm.generate(prompts[:2], SamplingParams(max_tokens=2), progress=False)  # warm up
        before, steps0 = counters(llm.comm_stats(), MOE_KINDS), len(llm.llm_engine.step_log)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, progress=False)
        seconds = time.perf_counter() - t0
        after = counters(llm.comm_stats(), MOE_KINDS)
        step_tokens = [s.num_batched_tokens for s in list(llm.llm_engine.step_log)[steps0:]]
        b = llm.llm_engine.dtype.itemsize
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    processed = sum(step_tokens)
    L, d, k, N = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers)), cfg.hidden_size, cfg.num_experts_per_tok, 2
    if ep:
        model_bytes = sum(L * ((2 * d * b + 8) * k * T * (N - 1) / N + N * math.ceil(T / N) * (N - 1) * d * b
                               + N * (N - 1) * 8) for T in step_tokens)  # fmt: skip
    else:
        model_bytes = sum(L * N * T * d * b for T in step_tokens)
    calls = nbytes = secs = predicted = 0.0
    for kind in MOE_KINDS:
        per_rank = {r: [a - z for a, z in zip(after[kind][r], before[kind][r])] for r in after[kind]}
        c, n = sum(v[0] for v in per_rank.values()), sum(v[1] for v in per_rank.values())
        if not c:
            continue
        fit = fits["all_reduce" if kind == "moe_all_reduce" else "all_to_all" if kind == "all_to_all_counts" else kind]
        calls, nbytes = calls + c, nbytes + n
        secs += min(v[2] for v in per_rank.values())  # the rank that waited least for its peer
        predicted += predicted_seconds(fit, c / len(per_rank), n / len(per_rank))
    return {"layout": "EP" if ep else "TP", "batch": batch, "tokens_per_s": generated / seconds,
            "bytes_per_token": nbytes / processed, "model_bytes_per_token": model_bytes / processed,
            "calls_per_token": calls / processed, "seconds": secs, "predicted_seconds": predicted,
            "processed_tokens": processed}  # fmt: skip


@torch.inference_mode()
def grouped_vs_naive(model: str, batch: int = 64, repeats: int = 5) -> dict:
    """One MoE layer of `model` on `batch` tokens: the grouped path's time against the naive loop's."""
    from level0_naive.loader import load_model

    loaded = load_model(model, torch.float32)
    moe = next(layer.mlp for layer in loaded.model.model.layers if hasattr(layer.mlp, "experts"))
    x = torch.randn(batch, loaded.config.hidden_size, generator=torch.Generator().manual_seed(0))
    best = {}
    for grouped in (True, False):
        moe.grouped = grouped
        moe(x)  # warm up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            moe(x)
            times.append(time.perf_counter() - t0)
        best["grouped" if grouped else "naive"] = min(times)
    moe.grouped = True
    return {"batch": batch, **best, "speedup": best["naive"] / best["grouped"]}


def main(args) -> dict:
    from rich.console import Console
    from rich.table import Table

    model = args.model or str(BUILTIN_MOE)
    batches = [int(b) for b in args.tp_batches.split(",")]
    runs = []
    for batch in batches:
        for ep in (False, True):
            print(f"{'EP' if ep else 'TP'}=2, batch {batch} ...", flush=True)
            with torch_threads(1):
                runs.append(run_layout(model, ep, batch, args.max_tokens, args.dtype))
    with torch_threads(1):
        paths = grouped_vs_naive(model)
    t = Table(title=f"{model}: the MoE block's messages per token processed, TP=2 against EP (2 ranks, gloo)")
    for col in ("layout", "batch", "tok/s", "bytes/token", "model", "error", "calls/token", "time", "alpha-beta",
                "error"):  # fmt: skip
        t.add_column(col, justify="right")
    for r in runs:
        t.add_row(r["layout"], str(r["batch"]), f"{r['tokens_per_s']:.0f}", f"{r['bytes_per_token']:.0f}",
                  f"{r['model_bytes_per_token']:.0f}", f"{100 * (r['bytes_per_token'] / r['model_bytes_per_token'] - 1):+.0f} %",
                  f"{r['calls_per_token']:.2f}", f"{r['seconds']:.3f} s", f"{r['predicted_seconds']:.3f} s",
                  f"{100 * (r['seconds'] / r['predicted_seconds'] - 1):+.0f} %")  # fmt: skip
    Console(width=130).print(t)
    for batch in batches:
        tp, ep = (next(r for r in runs if r["batch"] == batch and r["layout"] == name) for name in ("TP", "EP"))
        print(f"batch {batch}: EP moves {ep['bytes_per_token'] / tp['bytes_per_token']:.2f}x TP's bytes per token")
    print(f"one MoE layer at batch {paths['batch']}: grouped {1e3 * paths['grouped']:.2f} ms, naive "
          f"{1e3 * paths['naive']:.2f} ms: the grouped path is {paths['speedup']:.1f}x the naive loop")  # fmt: skip
    return {"model": model, "runs": runs, "grouped_vs_naive": paths}
