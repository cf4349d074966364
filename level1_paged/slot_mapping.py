"""The slot mapping: where a token's position in its sequence becomes a slot in the paged cache.

What it is: `slot_mapping(chunks, tables, block_size)`, the one place the ladder turns a
position into a cache slot. A sequence's position p lives in its block table's entry
p // block_size, at offset p % block_size inside that block; a slot numbers every (block,
offset) of the pool in one row, so

    slot = table[p // block_size] * block_size + p % block_size

    block_size 4, table [3, 2]:  positions 0 1 2 3 | 4 5 6 7
                                 slots    12 13 14 15 | 8 9 10 11
    a chunk of positions 2..4 writes slots [14, 15, 8]

Every new token of a step gets one, in batch order: the `slot_mapping [T]` of the step's
`ModelInput` (model_input.py), which the attention backend's cache write follows (kv_cache.py).
A position is the token's place in the whole sequence, not in the step's tokens: a prefill and
a decode index their tables the same way, whatever position a step's tokens start at.

What it is not: an allocator. The table must already cover every position (the engine grows it
before the step that needs it); a position past its table is an IndexError, never a wrong slot.

Reference: Kwon et al., SOSP 2023, section 4.2 (block table translation); vLLM V1
`v1/worker/block_table.py` (`compute_slot_mapping`).
"""

from __future__ import annotations

from level0_naive.model_runner import Chunk


def slot_mapping(chunks: list[Chunk], tables: list[list[int]], block_size: int) -> list[int]:
    """chunks[i] = (new tokens of sequence i, position of the first); tables[i] its blocks -> one slot per new token."""
    bs = block_size
    return [t[p // bs] * bs + p % bs for (toks, start), t in zip(chunks, tables) for p in range(start, start + len(toks))]


__all__ = ["slot_mapping"]
