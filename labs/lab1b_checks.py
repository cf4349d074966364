"""Lab 1b's own checks: the Triton kernel on fixed paged batches, against the oracle.

What it is: pytest tests that `python -m labs check 1b` runs next to level 1's kernel
tests. Each builds a paged batch whose blocks are shuffled over the pool and whose every
cache slot that no sequence owns holds NaN, so a kernel that reads one key too many (or a
padding entry of a block table) poisons its output; then compares the student's kernel
with `paged_attention_ref`. The batches are small: under the interpreter a kernel costs
about a millisecond per (program, tile).

What it is not: the hypothesis sweep (tests/test_level1_kernel.py has it, and it is slow
under the interpreter).

Reference: tests/test_level1_kernel.py (`make_workload`, the same construction).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import

from level1_paged.attention_ref import paged_attention_ref  # noqa: E402
from level1_paged.attention_split import paged_attention_split  # noqa: E402
from level1_paged.triton_attention import _launch  # noqa: E402

TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def paged_batch(query_lens, context_lens, hq, hkv, d, bs, dtype, seed):
    """q [T, Hq, D] and a NaN-poisoned paged cache holding context + query keys of each sequence."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    per_seq = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(per_seq) + 2
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.randint(0, num_blocks, (len(seq_lens), max(per_seq) + 1), generator=g, dtype=torch.int32)
    k_cache = torch.full((num_blocks, bs, hkv, d), float("nan"), dtype=dtype)  # [N, bs, Hkv, D]
    v_cache = torch.full((num_blocks, bs, hkv, d), float("nan"), dtype=dtype)
    used = 0
    for i, (s, nb) in enumerate(zip(seq_lens, per_seq)):
        tables[i, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
        pos = torch.arange(s)
        slots = tables[i, pos // bs].long() * bs + pos % bs
        k_cache.view(-1, hkv, d)[slots] = torch.randn(s, hkv, d, generator=g).to(dtype)
        v_cache.view(-1, hkv, d)[slots] = torch.randn(s, hkv, d, generator=g).to(dtype)
    q = torch.randn(sum(query_lens), hq, d, generator=g).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, qsl, torch.tensor(seq_lens, dtype=torch.int32), tables, d**-0.5


def compare(args, tile=32, what=""):
    out = _launch(*args, tile_size=tile)
    ref = paged_attention_ref(*args)
    dtype = args[0].dtype
    assert out.shape == ref.shape and out.dtype == dtype, f"{what}: output {tuple(out.shape)} {out.dtype}"
    assert torch.isfinite(out).all(), f"{what}: NaN in the output: a key outside the sequence (or padding) was read"
    err = (out.double() - ref.double()).abs().max().item()
    assert err <= TOL[dtype] * (1 + ref.double().abs().max().item()), f"{what}: max error {err:.3g} against the oracle"


def test_decodes():
    args = paged_batch([1, 1, 1], [4, 39, 70], 8, 2, 16, 16, torch.float32, seed=1)
    compare(args, what="3 decodes, contexts 5/40/71, GQA 8/2, block 16")


def test_prefill_chunk_over_a_cached_context():
    args = paged_batch([20, 1], [33, 12], 4, 2, 16, 8, torch.float64, seed=2)
    compare(args, tile=16, what="a 20-token chunk over 33 cached tokens and a decode, tile 16, block 8")


def test_tiles_and_blocks_are_independent():
    compare(paged_batch([3, 1], [20, 9], 4, 4, 16, 1, torch.float64, seed=3), tile=16, what="block size 1")
    compare(paged_batch([5, 1], [40, 30], 6, 2, 80, 32, torch.float64, seed=4), tile=16,
            what="block 32 split over tiles of 16, head dim 80, group 3")  # fmt: skip


def test_half_precision_inputs():
    compare(paged_batch([4, 1], [10, 25], 4, 2, 16, 8, torch.float16, seed=5), what="float16")


# --- step 2: split-KV attention with a fixed split size (level1_paged/attention_split.py) -----------------
def test_split_attention_equals_the_oracle():
    for split in (1, 5, 16, 1000):
        args = paged_batch([1, 6, 1], [30, 17, 2], 4, 2, 16, 8, torch.float64, seed=6)
        out, ref = paged_attention_split(*args, split_size=split), paged_attention_ref(*args)
        assert torch.isfinite(out).all(), f"split {split}: NaN: a key outside the sequence was read"
        err = (out - ref).abs().max().item()
        assert err <= 1e-10, f"split {split}: max error {err:.3g} against the oracle (rescale before merging?)"


def test_split_attention_is_batch_invariant():
    """One sequence's last 6 positions: as a 6-token chunk, as 6 decodes, and beside other sequences."""
    q, k, v, qsl, lens, tables, scale = paged_batch([6, 3, 9], [41, 12, 70], 4, 2, 16, 8, torch.float32, seed=7)
    chunk = paged_attention_split(q[:6], k, v, qsl[:2], lens[:1], tables[:1], scale)
    for r in range(6):
        one = paged_attention_split(q[r : r + 1], k, v, torch.tensor([0, 1], dtype=torch.int32),
                                    torch.tensor([41 + r + 1], dtype=torch.int32), tables[:1], scale)  # fmt: skip
        assert torch.equal(one[0], chunk[r]), f"row {r} of the chunk and the same position as a decode differ"
    batch = paged_attention_split(q, k, v, qsl, lens, tables, scale)
    assert torch.equal(batch[:6], chunk), "the chunk's rows changed when other sequences joined the batch"
