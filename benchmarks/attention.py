"""`python -m benchmarks.attention`: the CPU paged-attention backends timed side by side.

What it is: milliseconds per call of `paged_attention_ref` (the oracle),
`paged_attention_torch` (plain torch) and `paged_attention_cpu` (the compiled kernel, the
CPU default when it builds) on decode batches, and on one query of `--query` tokens (a
speculative verification or a short chunk), one torch thread, the best of several repeats,
alternating the backends. The Triton kernel is timed on a GPU by
`tests/test_level1_kernel.py::time_kernel_vs_torch`. What it is not: a test.

    python -m benchmarks.attention --seqs 16 64 --contexts 160 576 1024
"""

from __future__ import annotations

import argparse
import time

import torch

from features.cpu_kernels import attention as cpu_attention
from level1_paged.attention_ref import paged_attention_ref, paged_attention_torch


def decode_batch(num_seqs: int, context: int, hq: int = 8, hkv: int = 4, d: int = 64, bs: int = 16, seed: int = 0,
                 query: int = 1):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-context // bs)
    num_blocks = num_seqs * per_seq
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)  # [N, bs, Hkv, D]
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    tables = torch.randperm(num_blocks, generator=g).view(num_seqs, per_seq).int()  # [B, blocks]
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)  # [B]
    q = torch.randn(num_seqs * query, hq, d, generator=g)  # [B * query, Hq, D]: the last `query` tokens of each
    qsl = torch.arange(num_seqs + 1, dtype=torch.int32) * query  # [B+1]
    return q, k_cache, v_cache, qsl, seq_lens, tables, d**-0.5


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seqs", type=int, nargs="+", default=[64])
    p.add_argument("--contexts", type=int, nargs="+", default=[600, 1024])
    p.add_argument("--query", type=int, default=1, help="query tokens per sequence (1: decodes)")
    p.add_argument("--heads", type=int, nargs=2, default=[8, 4], metavar=("HQ", "HKV"))
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    backends = {"ref": paged_attention_ref, "torch": paged_attention_torch}
    if cpu_attention.available():
        backends["cpu"] = cpu_attention.paged_attention_cpu
    out = {}
    for seqs in args.seqs:
        for ctx in args.contexts:
            batch = decode_batch(seqs, ctx, *args.heads, query=args.query)
            best = dict.fromkeys(backends, float("inf"))
            for _ in range(args.repeats):
                for name, fn in backends.items():
                    t = time.perf_counter()
                    fn(*batch)
                    best[name] = min(best[name], 1000 * (time.perf_counter() - t))
            out[f"{seqs}x{ctx}"] = best
            times = ", ".join(f"{n} {best[n]:.2f} ms" for n in backends)
            vs = f" (cpu {best['torch'] / best['cpu']:.1f}x torch)" if "cpu" in best else ""
            print(f"{seqs} x {args.query}-token queries over {ctx} context: {times}{vs}")
    return out


if __name__ == "__main__":
    main()
