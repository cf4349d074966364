"""Lab 1's own checks: the allocator's order, and `ModelInput.build` on random batches.

What it is: pytest tests that `python -m labs check 1` runs next to level 1's own tests.
The slot mapping is checked against a physical picture built here token by token (which
block, which offset), on batches hypothesis draws: block sizes 1..16, shuffled physical
blocks, decodes and chunks that start anywhere, tables longer than needed.

What it is not: a test of the attention through those slots (level 1's engine tests and
lab 1b are).

Reference: vLLM `tests/v1/worker/test_gpu_input_batch.py` (slot mappings against a reference).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from level1_paged.block_allocator import BlockAllocator, OutOfBlocks
from level1_paged.model_input import ModelInput


def test_allocator_order_and_reuse():
    alloc = BlockAllocator(3)
    got = [alloc.allocate() for _ in range(3)]
    assert got == [0, 1, 2], f"blocks should come out 0, 1, 2 from a fresh pool (pictures depend on it), got {got}"
    assert alloc.num_free == 0 and alloc.num_used == 3
    with pytest.raises(OutOfBlocks):
        alloc.allocate()
    alloc.free(1)
    assert alloc.num_free == 1, f"one block freed, num_free is {alloc.num_free}"
    assert alloc.allocate() == 1, "the only free block must be the next one handed out"
    for b in (0, 1, 2):
        alloc.free(b)
    assert alloc.num_free == 3 and sorted(alloc.allocate() for _ in range(3)) == [0, 1, 2]


@st.composite
def batches(draw):
    bs = draw(st.sampled_from([1, 2, 4, 16]), label="block_size")
    n = draw(st.integers(1, 5), label="sequences")
    shuffle = random.Random(draw(st.integers(0, 2**16), label="physical block order"))
    pool = shuffle.sample(range(1000), 1000)  # physical block ids, shuffled
    chunks, tables, used = [], [], 0
    for _ in range(n):
        start = draw(st.integers(0, 40), label="cached tokens")
        length = draw(st.integers(1, 12), label="new tokens")
        need = -(-(start + length) // bs) + draw(st.integers(0, 2), label="spare blocks")
        tables.append(pool[used : used + need])
        used += need
        chunks.append(([(7 * len(chunks) + j) % 50 for j in range(length)], start))
    num_logits = [draw(st.integers(0, len(toks)), label="logits rows") for toks, _ in chunks]
    return chunks, tables, bs, num_logits


@settings(max_examples=60, deadline=None, derandomize=True)
@given(batch=batches())
def test_model_input_on_random_batches(batch):
    chunks, tables, bs, num_logits = batch
    mi = ModelInput.build(chunks, tables, bs, num_logits)
    want_slots, want_pos = [], []
    for (toks, start), table in zip(chunks, tables):
        for j in range(len(toks)):
            pos = start + j
            block, offset = table[pos // bs], pos % bs  # the picture: which physical block, which offset in it
            want_slots.append(block * bs + offset)
            want_pos.append(pos)
    assert mi.slot_mapping.tolist() == want_slots, f"slot_mapping (block_size {bs}, tables {tables}, chunks {chunks})"
    assert mi.positions.tolist() == want_pos, "positions: each new token's position in its sequence"
    assert mi.input_ids.tolist() == [t for toks, _ in chunks for t in toks]
    assert mi.seq_lens.tolist() == [start + len(toks) for toks, start in chunks], "seq_lens: context incl. new tokens"
    width = max(map(len, tables))
    assert mi.block_tables.tolist() == [t + [0] * (width - len(t)) for t in tables], "block_tables, padded with 0"
    ends = [sum(len(toks) for toks, _ in chunks[: i + 1]) for i in range(len(chunks))]
    assert mi.query_start_loc.tolist() == [0, *ends]
    assert mi.logits_indices.tolist() == [e - j for e, k in zip(ends, num_logits) for j in range(k, 0, -1)]
