"""`python -m benchmarks.sim.quantization`: what fp8 KV and int4 weights buy on a simulated A100 and H100.

What it is: the what-if GPU (docs/what_if.md: the ladder's real level-2 scheduler on a modelled clock)
serving Llama-2-7B and 13B in bfloat16, with the KV cache in fp8 (`kv_cache_dtype="fp8"`), the weights
in int4 (`quantization="int4"`), and both. Per setting:

    capacity    the weights' bytes, the KV budget vLLM's rule leaves (0.9 of the memory, less the weights
                and the activations' share), and the tokens that budget holds
    batch 1     one decode step at 512 tokens of context (the weights' read dominates: int4's lever)
    throughput  output tokens/s and the mean batch serving `--requests` ShareGPT-like requests that all
                arrive at once (the pool's size decides the batch: fp8's lever)

The cost model reads the weights at their width (4 bits and a bf16 scale and zero per 128) and the
KV at its (1 byte a value for fp8); the engine sizes its pool from `kv_cache_dtype` as the real one
does (level 1's setting).

What it is not: a measured GPU. The kernels that would read 4-bit weights and fp8 KV are assumed to
run at the memory's bandwidth, as the bf16 ones are (vLLM's Marlin and FlashAttention-3 fp8 get close
on an H100; the ladder's Triton kernel reads an 8-bit cache but has never run on a GPU, and it has no
GPU kernel for 4-bit weights: docs/quantization.md).

Reference: vLLM docs, "Quantized KV Cache" (fp8: "more tokens in the cache, improving throughput");
gpt-fast's int4 figures; Frantar et al., "MARLIN" (2024).
"""

from __future__ import annotations

import argparse
import math

from ladder.cli import LadderParser, positive_int, save_result

from .clock import SimClock
from .cost import gpu, kv_budget, model_shape, quantized, step_cost
from .serve import make_engine, play, trace, user_params

SETTINGS = {"bf16": {}, "fp8 KV": {"kv_cache_dtype": "fp8"}, "int4 weights": {"quantization": "int4"},
            "int4 + fp8 KV": {"quantization": "int4", "kv_cache_dtype": "fp8"}}  # fmt: skip


def one(model: str, gpu_name: str, settings: dict, requests: int) -> dict:
    hw = gpu(gpu_name)
    shape = quantized(model_shape(model), settings.get("quantization"), settings.get("kv_cache_dtype", "auto"))
    budget = kv_budget(hw, shape)
    engine = make_engine("vllm", model, hw, SimClock(), **settings)
    reqs = trace("sharegpt", requests, math.inf, vocab=shape.vocab, max_len=engine.max_model_len)
    seqs = play(engine, reqs, user_params(engine.max_model_len))
    steps = engine.worker.trace
    busy = sum(s.cost.total for s in steps)
    return {"weights_gb": shape.weight_bytes / 1e9, "kv_budget_gb": budget / 1e9,
            "kv_tokens": budget // shape.kv_bytes_per_token,
            "batch1_decode_ms": step_cost(hw, shape, [(512, 1)], 1).total * 1e3,
            "tokens_per_s": sum(len(s.output_token_ids) for s in seqs) / max(engine.clock.now, 1e-9),
            "mean_batch": sum(s.cost.total * s.batch for s in steps) / busy,
            "preemptions": engine.stats.preemptions}  # fmt: skip


def main(argv=None) -> dict:
    from rich.console import Console
    from rich.table import Table

    p = LadderParser(prog="python -m benchmarks.sim.quantization", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--models", nargs="+", default=["llama-2-7b", "llama-2-13b"])
    p.add_argument("--gpus", nargs="+", default=["a100-80gb", "h100-80gb"])
    p.add_argument("--requests", type=positive_int, default=1000, help="ShareGPT-like requests, all at once (1000)")
    p.add_argument("--out", default=None, help="where the JSON goes (default: the output folder)")
    args = p.parse_args(argv)
    result, console = {"args": vars(args), "runs": {}}, Console()
    for model in args.models:
        for g in args.gpus:
            table = Table(title=f"{model} on a simulated {g}: {args.requests} ShareGPT-like requests at once")
            for col in ("setting", "weights GB", "KV GB", "KV tokens", "batch-1 decode ms", "tok/s", "mean batch",
                        "preemptions"):  # fmt: skip
                table.add_column(col, justify="right")
            runs = result["runs"][f"{model}/{g}"] = {}
            for label, settings in SETTINGS.items():
                r = runs[label] = one(model, g, settings, args.requests)
                base = runs["bf16"]
                table.add_row(label, f"{r['weights_gb']:.1f}", f"{r['kv_budget_gb']:.1f}",
                              f"{r['kv_tokens']:,} ({r['kv_tokens'] / base['kv_tokens']:.2f}x)",
                              f"{r['batch1_decode_ms']:.2f} ({base['batch1_decode_ms'] / r['batch1_decode_ms']:.2f}x)",
                              f"{r['tokens_per_s']:,.0f} ({r['tokens_per_s'] / base['tokens_per_s']:.2f}x)",
                              f"{r['mean_batch']:.0f}", str(r["preemptions"]))  # fmt: skip
            console.print(table)
    save_result(result, args.out, "sim_quantization.json")
    return result


if __name__ == "__main__":
    main()
