"""Block tables: which physical blocks each sequence owns, in logical order, and how many blocks a budget holds.

What it is: PagedAttention's bookkeeping. A sequence's tokens live in whatever blocks it was
given, in order, named by its block table; a new block is taken only when the last one is full:

    sequence 7, 37 tokens, block_size 16          physical K cache of one layer (kv_cache.py)
    logical block:   0    1    2                  block 0 [ ................ ]
    block table:   [ 5 ,  2 ,  9 ]   ------->     block 2 [ tokens 16..31    ]
    tokens:        0-15 16-31 32-36 (11 free)     block 5 [ tokens 0..15     ]
                                                  block 9 [ 32..36 | 11 empty ]

Only the tail of the last block can be wasted: fewer than `block_size` slots per sequence,
versus a whole `max_tokens` reservation at level 0. `BlockTables` grows and frees tables when
told to, all or nothing, over a `BlockAllocator`; the helpers say how many blocks tokens and a
byte budget make, and refuse up front a request that could never fit the pool.

What it is not: a policy. Who runs, and who is evicted when blocks run out, is the engine's
decision (from level 2 on, its scheduler's); where a token's K/V goes is the slot mapping
(`slot_mapping.py`).

Reference: Kwon et al., SOSP 2023, sections 4.1-4.3; vLLM V1 `v1/core/kv_cache_manager.py`.
"""

from __future__ import annotations

from .block_allocator import BlockAllocator, OutOfBlocks


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold num_tokens tokens (ceil division)."""
    return -(-num_tokens // block_size)


def blocks_in_budget(kv_budget: int, block_size: int, bytes_per_token: int) -> int:
    """How many whole blocks a KV budget in bytes holds (maybe 0)."""
    return kv_budget // (block_size * bytes_per_token)


def num_blocks_for_budget(kv_budget: int, block_size: int, bytes_per_token: int) -> int:
    """How many whole blocks a KV budget in bytes holds (at least one, or a ValueError)."""
    num_blocks = blocks_in_budget(kv_budget, block_size, bytes_per_token)
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory={kv_budget} bytes holds no block of {block_size} tokens "
            f"({block_size * bytes_per_token} bytes)"
        )
    return num_blocks


def check_fits_in_pool(seq, i: int, num_blocks: int, block_size: int) -> None:
    """ValueError, up front, for prompt i if even alone it may need more blocks than the pool has."""
    need = blocks_for(seq.max_total_tokens, block_size)
    if need > num_blocks:
        raise ValueError(
            f"prompt {i} may need {need} KV blocks (prompt + max_tokens = {seq.max_total_tokens} tokens) "
            f"but the pool has {num_blocks}"
        )


class BlockTables:
    """Which physical blocks each sequence owns, in logical order."""

    def __init__(self, num_blocks: int, block_size: int):
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.tables: dict[int, list[int]] = {}  # seq_id -> physical block ids

    def missing_blocks(self, seq_id: int, num_tokens: int) -> int:
        """How many more blocks `seq_id` needs to hold `num_tokens` tokens."""
        return max(blocks_for(num_tokens, self.block_size) - len(self.tables.get(seq_id, [])), 0)

    def grow(self, seq_id: int, num_tokens: int) -> None:
        """Make the table cover `num_tokens` tokens; all or nothing (raises OutOfBlocks)."""
        need = self.missing_blocks(seq_id, num_tokens)
        if need > self.allocator.num_free:
            raise OutOfBlocks(f"sequence {seq_id} needs {need} blocks, {self.allocator.num_free} free")
        table = self.tables.setdefault(seq_id, [])
        table.extend(self.allocator.allocate() for _ in range(need))

    def free(self, seq_id: int) -> None:
        for block in reversed(self.tables.pop(seq_id, [])):
            self.allocator.free(block)


__all__ = ["blocks_for", "blocks_in_budget", "num_blocks_for_budget", "check_fits_in_pool", "BlockTables",
           "OutOfBlocks"]
