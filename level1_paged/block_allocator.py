"""A pool of fixed-size KV blocks: O(1) allocate and free, loud on misuse.

What it is: the physical side of PagedAttention. Block ids 0..num_blocks-1 name slices
of the KV tensors; the allocator only tracks which are free. A free list (a Python list
used as a stack) gives O(1) allocate and free; a boolean array catches double frees.

What it is not: a cache. Level 3 puts freed blocks in an LRU queue and keeps their
contents for reuse; here a freed block is simply empty again.

Reference: vLLM V1 `v1/core/block_pool.py` (BlockPool), without its cache of freed blocks.
"""

from __future__ import annotations


class OutOfBlocks(RuntimeError):
    """Asked for more blocks than are free. The caller decides: wait, evict someone, or refuse."""


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
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        block = self._free.pop()
        self._is_free[block] = False
        return block

    def free(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block} is not in this pool of {self.num_blocks}")
        if self._is_free[block]:
            raise ValueError(f"double free of block {block}")
        self._is_free[block] = True
        self._free.append(block)
