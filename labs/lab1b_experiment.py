"""Lab 1b's experiment: what a tile size costs, and what the causal skip saves, under the interpreter.

    python -m labs experiment 1b YOUR_FILE [--tiles 16 32 64] [--block-sizes 1 16] [--contexts 64 256]

What it is: one paged batch (decodes over `--contexts` cached tokens each, plus one prefill
chunk of `--chunk` tokens over `--chunk-context` cached ones) through *your* kernel, for
each tile size and block size: the inner-loop iterations the kernel's grid runs (counted
here from its geometry: programs x tiles each program visits), the same count without
the causal skip, the interpreter's wall time, and the largest difference from the
oracle (`paged_attention_ref`). Under `TRITON_INTERPRET=1` a kernel runs as numpy, so
its time follows the iteration count, not the FLOPs.

What it is not: a GPU benchmark. On a GPU the same file compiles to one kernel, and
`tests/test_level1_kernel.py::time_kernel_vs_torch` times it.

Reference: docs/level1_kernel.md; vLLM's `triton_unified_attention.py` (the grid it follows).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from ladder.cli import LadderParser, nonneg_int, positive_int


def parser() -> argparse.ArgumentParser:
    p = LadderParser(prog="python -m labs experiment 1b YOUR_FILE", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--tiles", type=positive_int, nargs="+", default=[16, 32, 64], help="tile sizes (default 16 32 64)")
    p.add_argument("--block-sizes", type=positive_int, nargs="+", default=[1, 16], help="KV block sizes (default 1 16)")
    p.add_argument("--contexts", type=nonneg_int, nargs="+", default=[64, 256], help="cached tokens of each decode")
    p.add_argument("--chunk", type=positive_int, default=48, help="prefill chunk length (default 48)")
    p.add_argument("--chunk-context", type=nonneg_int, default=96, help="tokens cached before the chunk (default 96)")
    p.add_argument("--heads", type=positive_int, nargs=2, default=[8, 2], metavar=("HQ", "HKV"), help="default 8 2")
    p.add_argument("--head-dim", type=positive_int, default=64, help="default 64")
    return p


def iterations(query_lens, context_lens, hq, hkv, tile, causal_skip=True) -> int:
    """Inner-loop iterations of the kernel's grid: per (q block, KV head), the tiles of keys it walks."""
    group = hq // hkv
    block_m = max(16, 1 << (group - 1).bit_length())
    block_q = block_m // group
    total = 0
    for n, c in zip(query_lens, context_lens):
        for b in range(math.ceil(n / block_q)):
            last = min((b + 1) * block_q, n) - 1
            keys = c + last + 1 if causal_skip else c + n
            total += math.ceil(keys / tile)
    return total * hkv


def main(argv=None) -> list[dict]:
    args = parser().parse_args(argv)
    from labs.lab1b_checks import paged_batch
    from level1_paged.attention_ref import paged_attention_ref
    from level1_paged.triton_attention import _launch

    hq, hkv = args.heads
    query_lens = [1] * len(args.contexts) + [args.chunk]
    context_lens = [*args.contexts, args.chunk_context]
    rows = []
    for bs in args.block_sizes:
        batch = paged_batch(query_lens, context_lens, hq, hkv, args.head_dim, bs, torch.float32, seed=0)
        ref = paged_attention_ref(*batch)
        for tile in args.tiles:
            _launch(*batch, tile_size=tile)  # the interpreter's first call pays for setting itself up
            t0 = time.perf_counter()
            out = _launch(*batch, tile_size=tile)
            ms = 1000 * (time.perf_counter() - t0)
            err = (out - ref).abs().max().item()
            rows.append(dict(block=bs, tile=tile, iters=iterations(query_lens, context_lens, hq, hkv, tile),
                             no_skip=iterations(query_lens, context_lens, hq, hkv, tile, False), ms=ms, err=err))  # fmt: skip
    print(f"decodes over {args.contexts} cached tokens + a {args.chunk}-token chunk over {args.chunk_context}; "
          f"Hq={hq}, Hkv={hkv}, D={args.head_dim}, float32, under the interpreter")  # fmt: skip
    print(f"{'block':>5} {'tile':>5} {'iterations':>10} {'no skip':>8} {'ms':>8} {'ms/iter':>8} {'max error':>10}")
    for r in rows:
        print(f"{r['block']:>5} {r['tile']:>5} {r['iters']:>10} {r['no_skip']:>8} {r['ms']:>8.1f} "
              f"{r['ms'] / r['iters']:>8.2f} {r['err']:>10.2e}")  # fmt: skip
    # where the skip saves: a decode's one query sees every key either way; only the chunk's rows skip tiles
    nd = len(args.contexts)
    parts = dict(decodes=(query_lens[:nd], context_lens[:nd]), chunk=(query_lens[nd:], context_lens[nd:]))
    print("iterations by part (the same for every block size), with the skip / without:")
    for tile in args.tiles:
        by_part = ", ".join(f"{name} {iterations(*ql_cl, hq, hkv, tile)} / {iterations(*ql_cl, hq, hkv, tile, False)}"
                            for name, ql_cl in parts.items())  # fmt: skip
        print(f"  tile {tile:>3}: {by_part}")
    return rows


if __name__ == "__main__":
    main()
