"""The scheduler's view of KV memory: can this request get room for n more tokens?

What it is: a thin layer over level 1's `BlockTables` with the interface vLLM V1's
scheduler uses, keyed by request. Three of its methods are hooks that do nothing here
and that level 3 (prefix caching) overrides:

  - `get_computed_blocks(req)`: blocks whose K/V already exist for this request's
    prefix (none at level 2), found before the request is admitted;
  - `allocate_slots(req, n, computed)`: all-or-nothing room for n new tokens, taking
    the computed blocks as its first blocks;
  - `cache_blocks(req)`: after a step, name the request's newly full blocks.

What it is not: a policy. It never picks a victim; when `allocate_slots` says no, the
scheduler decides whom to preempt.

Reference: vLLM V1 `v1/core/kv_cache_manager.py`.
"""

from __future__ import annotations

from level1_paged.paged_cache import BlockTables

from .request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.tables = BlockTables(num_blocks, block_size)
        self.block_size, self.num_blocks = block_size, num_blocks

    # --- hooks level 3 replaces ------------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """(cached blocks of the request's prefix, how many tokens they hold). None here."""
        return [], 0

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: list | None = None) -> bool:
        """Room for tokens up to num_computed + num_new, or False and nothing changed.

        `computed_blocks` is given (possibly empty) when the request is being admitted:
        the blocks `get_computed_blocks` found, to become the head of its table.
        """
        total = req.num_computed_tokens + num_new_tokens
        if self.tables.missing_blocks(req.seq_id, total) > self.tables.allocator.num_free:
            return False
        self.tables.grow(req.seq_id, total)
        return True

    def cache_blocks(self, req: Request) -> None:
        """Nothing to remember at level 2."""

    def free(self, req: Request) -> None:
        self.tables.free(req.seq_id)

    # --- queries -------------------------------------------------------------------
    def block_table(self, req: Request) -> list[int]:
        return self.tables.tables[req.seq_id]

    def slots(self, req: Request, start: int, n: int) -> list[int]:
        return self.tables.slots(req.seq_id, start, n)

    @property
    def num_free_blocks(self) -> int:
        return self.tables.allocator.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks
