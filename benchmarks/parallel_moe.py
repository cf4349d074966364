"""`python -m benchmarks.parallel --moe`: expert parallelism against tensor parallelism, in bytes and seconds.

What it is: the built-in mixture of experts (`tiny-shakespeare-moe`: 4 MoE layers, 8 experts, 2
per token, hidden 192) on two ranks, every expert sliced (TP=2: one all-reduce per MoE layer)
against whole experts per rank (EP: dispatch and combine all-to-alls and an all-gather), greedy,
decode-heavy (8-token prompts, `--max-tokens` outputs), at batches 1, 32 and 128, `--repeats`
rounds with the batches in turn. Per layout and batch it reports, over the rounds, for the MoE block's messages only (attention's all-reduces are the same in both),

  - bytes per token (all ranks, the tokens the forward passes processed) against the model of
    them, summed over the run's steps: T tokens in a step of L MoE layers, d hidden, b bytes
    per number, N ranks, k experts per token,

        TP   L * N * T * d * b                                        (each rank all-reduces [T, d])
        EP   L * ((2 * d * b + 8) * k * T * (N-1)/N                   (rows to other ranks' experts and back, with
                                                                       an 8-byte expert id each, if routing were uniform;
                  + N * ceil(T/N) * (N-1) * d * b                      the gather, padded;
                  + N * (N-1) * 8)                                     the row counts)

  - seconds on the wire in those messages against the latency-bandwidth model, calls * alpha +
    bytes * beta per kind. Every call is recorded on both ranks: a collective ends for both
    together, so the rank that came last spent only the transfer in it (the wire time, summed
    over calls) and the other also waited for its peer (reported apart: under EP a rank whose
    experts got more rows keeps the other waiting). alpha and beta are fitted on three other
    batches (CALIBRATION) of the same engine and predict the table's: the check is that a
    run's messages cost what their count and size say. Beside them, alpha and beta of calls
    in a tight loop (`alpha_beta`), whose alpha on a shared 2-core machine comes out lower: a
    call amid a run finds its peer asleep and its caches cold;
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
CALIBRATION = (4, 64, 256)  # the batches alpha and beta are fitted on, in a run; the table's are predicted


def run_layout(model: str, ep: bool, batches: list[int], max_tokens: int, dtype: str, repeats: int) -> list[dict]:
    """One TP=2 engine (EP or not), decoding each batch in turn, `repeats` rounds; per batch, its MoE
    messages by kind summed over the rounds: calls and bytes (all ranks), seconds on the wire and
    waiting (`waited`); tokens/s of its best round."""
    from level0_naive import SamplingParams
    from level0_naive.loader import load_metadata
    from level5_multigpu import LLM
    from level5_multigpu.parallel_state import counters, waited

    cfg = load_metadata(model).config
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, temperature=0)
    rows = {batch: {"layout": "EP" if ep else "TP", "batch": batch, "kinds": {}, "tokens_per_s": 0.0,
                    "processed_tokens": 0, "model_bytes": 0.0} for batch in batches}  # fmt: skip
    with LLM(model, dtype=dtype, tensor_parallel_size=2, enable_expert_parallel=ep, max_num_seqs=max(batches),
             max_num_batched_tokens=8192, kv_cache_memory=1 << 28, max_model_len=512) as llm:  # fmt: skip
        executor, b = llm.llm_engine.executor, llm.llm_engine.dtype.itemsize
        loop_fits = llm.llm_engine.calibrate()
        llm.generate([[40] * 8] * 2, SamplingParams(max_tokens=2), progress=False)  # warm up
        for _ in range(repeats):  # the batches take turns, so a slow minute falls on all of them
            for batch in batches:
                row, prompts = rows[batch], [[40 + (i % 50)] * 8 for i in range(batch)]
                llm.llm_engine.step_log.clear()  # a ring of the last 1,024 steps: this run's alone
                before = counters(llm.comm_stats(), MOE_KINDS)
                executor.collective_rpc("record_calls", True)
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, progress=False)
                seconds = time.perf_counter() - t0
                records = executor.collective_rpc("record_calls", False)
                after = counters(llm.comm_stats(), MOE_KINDS)
                step_tokens = [s.num_batched_tokens for s in llm.llm_engine.step_log]
                for kind in MOE_KINDS:
                    per_rank = {r: [a - z for a, z in zip(after[kind][r], before[kind][r])] for r in after[kind]}
                    calls, nbytes = sum(v[0] for v in per_rank.values()), sum(v[1] for v in per_rank.values())
                    if calls:
                        wire, waiting = waited(records, kind)
                        k = row["kinds"].setdefault(kind, {"calls": 0, "bytes": 0, "ranks": len(per_rank),
                                                           "wire_seconds": 0.0, "waited_seconds": 0.0})  # fmt: skip
                        k["calls"], k["bytes"] = k["calls"] + calls, k["bytes"] + nbytes
                        k["wire_seconds"], k["waited_seconds"] = k["wire_seconds"] + wire, k["waited_seconds"] + waiting
                tokens_per_s = sum(len(o.outputs[0].token_ids) for o in outs) / seconds
                row["tokens_per_s"] = max(row["tokens_per_s"], tokens_per_s)
                row["processed_tokens"] += sum(step_tokens)
                row["model_bytes"] += model_bytes(cfg, ep, step_tokens, b)
    return [{**rows[batch], "loop_fits": loop_fits} for batch in batches]


def model_bytes(cfg, ep: bool, step_tokens: list[int], b: int) -> float:
    """The docstring's formula for the MoE block's bytes, summed over the steps (2 ranks)."""
    L, d, k, N = sum(cfg.moe.is_moe_layer(i) for i in range(cfg.num_layers)), cfg.hidden_size, cfg.moe.num_experts_per_tok, 2
    if ep:
        return sum(L * ((2 * d * b + 8) * k * T * (N - 1) / N + N * math.ceil(T / N) * (N - 1) * d * b
                        + N * (N - 1) * 8) for T in step_tokens)  # fmt: skip
    return sum(L * N * T * d * b for T in step_tokens)


def fit_in_run(rows: list[dict]) -> dict[str, dict]:
    """alpha and beta per kind from whole runs (the calibration batches): a run's wire time per call
    against its bytes per call, fitted as `alpha_beta` fits single calls in a loop."""
    from level5_multigpu.parallel_state import fit_alpha_beta

    fits = {}
    for kind in MOE_KINDS:
        pts = [(r["kinds"][kind]["bytes"] / r["kinds"][kind]["calls"],
                r["kinds"][kind]["wire_seconds"] * r["kinds"][kind]["ranks"] / r["kinds"][kind]["calls"])
               for r in rows if kind in r["kinds"]]  # fmt: skip
        if pts:
            fits[kind] = fit_alpha_beta([r["batch"] for r in rows], [x for x, _ in pts], [t for _, t in pts])
    return fits


def summarise(row: dict, fits: dict[str, dict]) -> dict:
    """A measured run's totals against the alpha-beta prediction from `fits` (per kind, per rank)."""
    from level5_multigpu.parallel_state import predicted_seconds

    k = row["kinds"].values()
    calls, nbytes = sum(v["calls"] for v in k), sum(v["bytes"] for v in k)
    predicted = sum(predicted_seconds(fits[kind], v["calls"] / v["ranks"], v["bytes"] / v["ranks"])
                    for kind, v in row["kinds"].items())  # fmt: skip
    return {**row, "bytes_per_token": nbytes / row["processed_tokens"],
            "model_bytes_per_token": row["model_bytes"] / row["processed_tokens"],
            "calls_per_token": calls / row["processed_tokens"], "seconds": sum(v["wire_seconds"] for v in k),
            "waited_seconds": sum(v["waited_seconds"] for v in k), "predicted_seconds": predicted}  # fmt: skip


@torch.inference_mode()
def grouped_vs_naive(model: str, batch: int = 64, repeats: int = 20) -> dict:
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
    if set(batches) & set(CALIBRATION):  # a batch both fitted on and predicted would prove nothing
        raise SystemExit(f"--tp-batches {args.tp_batches}: {sorted(set(batches) & set(CALIBRATION))} "
                         f"is a calibration batch {CALIBRATION}; pick others")  # fmt: skip
    runs, fits = [], {}
    for ep in (False, True):
        print(f"{'EP' if ep else 'TP'}=2: calibration batches {CALIBRATION}, then {batches} ...", flush=True)
        with torch_threads(1):
            rows = run_layout(model, ep, [*CALIBRATION, *batches], args.max_tokens, args.dtype, args.repeats)
        layout_fits = fit_in_run(rows[: len(CALIBRATION)])
        fits.update(layout_fits)
        runs += [summarise(r, layout_fits) for r in rows[len(CALIBRATION):]]
    with torch_threads(1):
        paths = grouped_vs_naive(model)
    t = Table(title=f"{model}: the MoE block's messages per token processed, TP=2 against EP (2 ranks, gloo)")
    for col in ("layout", "batch", "tok/s", "bytes/token", "model", "error", "calls/token", "on the wire", "alpha-beta",
                "error", "waiting"):  # fmt: skip
        t.add_column(col, justify="right")
    for r in sorted(runs, key=lambda r: r["batch"]):
        t.add_row(r["layout"], str(r["batch"]), f"{r['tokens_per_s']:.0f}", f"{r['bytes_per_token']:.0f}",
                  f"{r['model_bytes_per_token']:.0f}", f"{100 * (r['bytes_per_token'] / r['model_bytes_per_token'] - 1):+.0f} %",
                  f"{r['calls_per_token']:.2f}", f"{r['seconds']:.3f} s", f"{r['predicted_seconds']:.3f} s",
                  f"{100 * (r['seconds'] / r['predicted_seconds'] - 1):+.0f} %", f"{r['waited_seconds']:.3f} s")  # fmt: skip
    Console(width=130).print(t)
    loop = runs[0]["loop_fits"] | next(r for r in runs if r["layout"] == "EP")["loop_fits"]
    for kind, fit in fits.items():
        tight = loop["all_reduce" if kind == "moe_all_reduce" else kind]
        print(f"{kind}: alpha {1e6 * fit['alpha_s']:.0f} us, beta {1e9 * fit['beta_s_per_byte']:.2f} ns/byte in a run; "
              f"{1e6 * tight['alpha_s']:.0f} us, {1e9 * tight['beta_s_per_byte']:.2f} ns/byte in a loop of calls alone")
    for batch in batches:
        tp, ep = (next(r for r in runs if r["batch"] == batch and r["layout"] == name) for name in ("TP", "EP"))
        print(f"batch {batch}: EP moves {ep['bytes_per_token'] / tp['bytes_per_token']:.2f}x TP's bytes per token")
    print(f"one MoE layer at batch {paths['batch']}: grouped {1e3 * paths['grouped']:.2f} ms, naive "
          f"{1e3 * paths['naive']:.2f} ms: the grouped path is {paths['speedup']:.1f}x the naive loop")  # fmt: skip
    return {"model": model, "runs": runs, "fits_in_a_run": fits, "grouped_vs_naive": paths}
