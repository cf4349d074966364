# Lab 1: your copy of level1_paged/block_allocator.py.
# Fill in every function that raises NotImplementedError (search for TODO), then run
#     python -m labs check 1 THIS_FILE
# Made by `python -m labs starters` from the reference; everything else is the reference, unchanged.
"""A pool of fixed-size KV blocks: O(1) allocate and free, loud on misuse.

What it is: the physical side of PagedAttention. Block ids 0..num_blocks-1 name slices
of the KV tensors; the allocator only tracks which are free. A free list (a Python list
used as a stack) gives O(1) allocate and free; a boolean array catches double frees.

What it is not: a cache. Level 3 puts freed blocks in an LRU queue and keeps their
contents for reuse; here a freed block is simply empty again.

Reference: vLLM V1 `v1/core/block_pool.py` (BlockPool), without the prefix cache.
"""

from __future__ import annotations


class OutOfBlocks(RuntimeError):
    """Asked for more blocks than are free. The caller decides: wait, preempt or refuse."""


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: the KV budget must hold at least one block")
        self.num_blocks = num_blocks
        # Pop from the end: blocks come out 0, 1, 2, ... which makes pictures readable.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self) -> int:
        # TODO (lab 1): BlockAllocator.allocate
        # Hand out one free block id in O(1), or raise OutOfBlocks (with a message) when none is left.
        # self._free is a stack (pop from the end: blocks come out 0, 1, 2, ...); keep self._is_free in step.
        raise NotImplementedError("lab 1: write BlockAllocator.allocate")

    def free(self, block: int) -> None:
        # TODO (lab 1): BlockAllocator.free
        # Give a block back in O(1). Be loud on misuse, the allocator's whole point:
        #   an id outside 0 .. num_blocks-1 -> ValueError saying it is "not in this pool";
        #   a block that is already free -> ValueError saying "double free".
        # Then mark it free and push it on self._free.
        raise NotImplementedError("lab 1: write BlockAllocator.free")
