"""The scheduler's view of KV memory: can this request get room for n more tokens?

What it is: `KVCacheManager`, the interface (a Protocol) vLLM V1's scheduler talks to,
keyed by request, and `SimpleKVCacheManager`, level 2's implementation over level 1's
`BlockTables`. Level 3's `PrefixCachingKVCacheManager` implements the same Protocol over a
hash-named block pool (finding cached prefixes, naming full blocks); neither inherits from the other.

  - `get_computed_blocks(req)`: blocks whose K/V already exist for this request's
    prefix (never any here), found before the request is admitted;
  - `allocate_slots(req, n, computed_blocks)`: all-or-nothing room for positions up
    to `num_computed + n`, with the computed blocks as the head of the table;
  - `cache_blocks(req, num_tokens)`: after a step, the request's first `num_tokens`
    tokens (default: `num_computed_tokens`) are in its blocks: count them as stored,
    so `usage()` is a counter, not a walk over every table;
  - `free(req)`, `block_table(req)`, `num_free_blocks`, `usage()`.

What it is not: a policy. It never picks a victim; when `allocate_slots` says no, the
scheduler decides whom to preempt.

Reference: vLLM V1 `v1/core/kv_cache_manager.py`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from level1_paged.block_table import BlockTables

from .request import Request


@runtime_checkable
class KVCacheManager(Protocol):
    block_size: int
    num_blocks: int

    def get_computed_blocks(self, req: Request) -> tuple[list, int]:
        """(cached blocks of the request's prefix, how many tokens they hold)."""
        ...

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: list | None = None,
                       keep_free: int = 0) -> bool:  # fmt: skip
        """Room up to num_computed + num_new, or False and nothing changed.
        `computed_blocks` is given (possibly empty) only when the request is admitted;
        `keep_free`: fail too if fewer than this many blocks would be left free (the
        scheduler's admission headroom)."""
        ...

    def cache_blocks(self, req: Request, num_tokens: int | None = None) -> None:
        """After a step: the first `num_tokens` (default `req.num_computed_tokens`) are stored."""
        ...

    def free(self, req: Request) -> None: ...

    def block_table(self, req: Request) -> list[int]:
        """The request's physical block ids, in logical order."""
        ...

    @property
    def num_free_blocks(self) -> int: ...

    def usage(self) -> tuple[int, int]:
        """(blocks in use, tokens stored in them): shared blocks count once."""
        ...

    def ref_counts(self) -> list[int]:
        """Per physical block, how many requests hold it (0: free); for observers, not the hot path."""
        ...

    def cached_free_blocks(self) -> list[int]:
        """Free blocks that still hold reusable content, in the order they would be evicted."""
        ...


class SimpleKVCacheManager:
    """Level 2: every request owns its blocks; nothing is shared or remembered."""

    def __init__(self, num_blocks: int, block_size: int):
        self.tables = BlockTables(num_blocks, block_size)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.stored: dict[int, int] = {}  # seq_id -> tokens whose K/V are in its blocks
        self.num_stored = 0  # their sum, kept current

    def get_computed_blocks(self, req: Request) -> tuple[list, int]:
        return [], 0

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: list | None = None,
                       keep_free: int = 0) -> bool:  # fmt: skip
        total = req.num_computed_tokens + num_new_tokens
        if self.tables.missing_blocks(req.seq_id, total) > self.tables.allocator.num_free - keep_free:
            return False
        self.tables.grow(req.seq_id, total)
        return True

    def cache_blocks(self, req: Request, num_tokens: int | None = None) -> None:
        n = req.num_computed_tokens if num_tokens is None else num_tokens
        self.num_stored += n - self.stored.get(req.seq_id, 0)
        self.stored[req.seq_id] = n

    def free(self, req: Request) -> None:
        self.tables.free(req.seq_id)
        self.num_stored -= self.stored.pop(req.seq_id, 0)

    def block_table(self, req: Request) -> list[int]:
        return self.tables.tables[req.seq_id]

    @property
    def num_free_blocks(self) -> int:
        return self.tables.allocator.num_free

    def usage(self) -> tuple[int, int]:
        return self.num_blocks - self.num_free_blocks, self.num_stored

    def ref_counts(self) -> list[int]:
        counts = [0] * self.num_blocks
        for table in self.tables.tables.values():
            for b in table:
                counts[b] += 1
        return counts

    def cached_free_blocks(self) -> list[int]:
        return []  # a freed block forgets what it held
