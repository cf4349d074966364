"""`python -m benchmarks.attention`: the CPU paged-attention backends timed side by side.

What it is: milliseconds per call of `paged_attention_ref` (the oracle) and
`paged_attention_torch` (the CPU default) on a decode batch, one torch thread, the best
of several repeats, alternating the two. The Triton kernel is timed on a GPU by
`tests/test_level1_kernel.py::time_kernel_vs_torch`. What it is not: a test.
"""

from __future__ import annotations

import argparse
import time

import torch

from level1_paged.attention_ref import paged_attention_ref, paged_attention_torch


def decode_batch(num_seqs: int, context: int, hq: int = 8, hkv: int = 4, d: int = 64, bs: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-context // bs)
    num_blocks = num_seqs * per_seq
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)  # [N, bs, Hkv, D]
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    tables = torch.randperm(num_blocks, generator=g).view(num_seqs, per_seq).int()  # [B, blocks]
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)  # [B]
    q = torch.randn(num_seqs, hq, d, generator=g)  # [B, Hq, D]: one query token each
    qsl = torch.arange(num_seqs + 1, dtype=torch.int32)  # [B+1]
    return q, k_cache, v_cache, qsl, seq_lens, tables, d**-0.5


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--contexts", type=int, nargs="+", default=[600, 1024])
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = {}
    for ctx in args.contexts:
        batch = decode_batch(args.seqs, ctx)
        best = {"ref": float("inf"), "torch": float("inf")}
        for _ in range(args.repeats):
            for name, fn in (("ref", paged_attention_ref), ("torch", paged_attention_torch)):
                t = time.perf_counter()
                fn(*batch)
                best[name] = min(best[name], 1000 * (time.perf_counter() - t))
        out[ctx] = best
        print(
            f"{args.seqs} decodes x {ctx} context: ref {best['ref']:.1f} ms, torch {best['torch']:.1f} ms ({best['ref'] / best['torch']:.1f}x)"
        )
    return out


if __name__ == "__main__":
    main()
