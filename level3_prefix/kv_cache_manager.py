"""A KV cache manager with automatic prefix caching: level 2's Protocol over a `BlockPool`.

What it is: `PrefixCachingKVCacheManager`, which implements level 2's `KVCacheManager`
Protocol (it inherits nothing from level 2's simple manager) and keeps, per request, its
blocks in logical order, how many of them are named, and how many of its tokens they hold.
It composes the three ideas of level 3, each in a file named for it:

    the prefix cache     prefix_cache.py     lookup at admission, naming full blocks after a step
    the fork, and
    copy-on-write        copy_on_write.py    children share their parent's blocks; a write into a
                                             shared block copies it first
    block names          block_hash.py       the chained hash of a full block's tokens

and says, in `allocate_slots`, how one request's token range meets them all (the picture
there). On `free`, a request's blocks go back in reverse order, so when memory is needed its
tail (the least shareable part) is evicted before its head.

What it is not: a cache-aware scheduler (requests are still served in arrival order), or a
policy: when `allocate_slots` says no, the scheduler decides whom to preempt.

Reference: vLLM `docs/design/prefix_caching.md`, `v1/core/kv_cache_manager.py` (`allocate_slots`).
"""

from __future__ import annotations

from level1_paged.block_table import blocks_for

from .block_hash import hash_block
from .block_pool import BlockPool, KVBlock
from .copy_on_write import CopyOnWrite
from .prefix_cache import PrefixCache


class PrefixCachingKVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, hash_fn=hash_block,
                 connector=None):  # fmt: skip
        """`connector`: a KV connector (features/kv_connectors, through ladder/rooms.py) that keeps
        what the pool evicts and hands back a prefix the pool has lost, or None."""
        self.block_size, self.num_blocks = block_size, num_blocks
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, hash_fn)
        self.connector = connector
        self.external: dict[int, int] = {}  # seq_id -> tokens its admission's lookup found in the connector
        if connector is not None:
            self.pool.on_evict = connector.block_evicted
        self.prefix = PrefixCache(self.pool, block_size, enable_caching)
        self.cow = CopyOnWrite(self.pool, block_size)
        self.req_blocks: dict[int, list[KVBlock]] = {}  # seq_id -> its blocks, logical order
        self.num_named: dict[int, int] = {}  # seq_id -> how many of its blocks are registered
        self.num_filled: dict[int, int] = {}  # seq_id -> tokens of it recorded in its blocks' fill

    # --- the Protocol ------------------------------------------------------------------
    def get_computed_blocks(self, req) -> tuple[list[KVBlock], int]:
        forked = self.cow.forked_prefix(req, self.req_blocks)  # a sample forked from its parent's prompt
        if forked is not None:
            self.external.pop(req.seq_id, None)  # (nothing from a connector: the fork's blocks are its parent's)
            return forked
        hit = self.prefix.lookup(req)
        num_hit = len(hit) * self.block_size
        if self.connector is None or not self.enable_caching:
            return hit, num_hit
        # past the pool's hit, the connector's: its tokens count as computed, their blocks are fresh
        # ones allocate_slots takes from the pool, and the worker loads them before the step
        self.external[req.seq_id] = self.connector.get_num_new_matched_tokens(req, num_hit)
        return hit, num_hit + self.external[req.seq_id]

    def allocate_slots(self, req, num_new_tokens: int, computed_blocks: list | None = None,
                       keep_free: int = 0) -> bool:  # fmt: skip
        """Room for the request's positions up to num_computed + num_new_tokens, all or nothing:

            positions 0 .................. num_computed_tokens ........................ total
                      | computed, in its blocks | computed, in the hit (or | new: this step's  |
                      | (`blocks`)              | forked) blocks: touched  | tokens            |
            blocks    [ b3    b8    b5        ] [ b7    b2                ] + `need` from the pool
                                           ^ positions [num_computed, total) write into b5 (and
                                             into a forked block): shared with another sequence,
                                             so copied first, one fresh block each (`shared`)

        `computed_blocks` is given (possibly empty) only at admission, where `num_computed_tokens`
        already counts its tokens. It fits if `need` + the copies <= the free blocks, less the idle
        hit blocks that touching takes off the free queue, less `keep_free`; else False, nothing changed.
        """
        blocks = self.req_blocks.setdefault(req.seq_id, [])
        computed = computed_blocks or []
        total = req.num_computed_tokens + num_new_tokens
        need = max(blocks_for(total, self.block_size) - len(blocks) - len(computed), 0)
        shared = self.cow.blocks_to_copy(blocks + computed, len(blocks), req.num_computed_tokens, total)
        idle_hits = sum(b.ref_cnt == 0 for b in computed)  # touching them takes them off the free queue
        if need + len(shared) > self.pool.num_free - idle_hits - keep_free:
            if not blocks:
                del self.req_blocks[req.seq_id]
            if computed_blocks is not None and self.external.pop(req.seq_id, 0):
                self.connector.update_state_after_alloc(req, [], 0)  # nothing to load: its finds let go now
            return False
        self.pool.touch(computed)  # first, so no allocation below can evict a hit
        blocks.extend(computed)
        if computed_blocks is not None:  # an admission: its lookup counts once, when it sticks
            if not self.cow.took_fork(req):  # (a fork shared its parent's blocks; it looked nothing up)
                self.prefix.count(req, len(computed))
            self.num_named[req.seq_id] = next((i for i, b in enumerate(computed) if b.block_hash is None), len(computed))
            self.num_filled[req.seq_id] = req.num_computed_tokens  # what the hit (or forked) blocks hold
        for i in shared:
            self.cow.copy_block(blocks, i, self.num_filled.get(req.seq_id, 0))
            self.num_named[req.seq_id] = min(self.num_named.get(req.seq_id, 0), i)  # the copy has no name
        blocks.extend(self.pool.allocate(need))
        external = self.external.pop(req.seq_id, 0) if computed_blocks is not None else 0
        if external:  # the blocks after the pool's hit receive the connector's tokens: full ones
            loaded = blocks[len(computed): len(computed) + external // self.block_size]
            self.connector.update_state_after_alloc(req, loaded, external)
            for b in loaded:
                self.pool.fill(b, self.block_size)
        return True

    def waiting_for_kv(self, req) -> bool:
        """The request's KV is on its way from elsewhere (a connector's fetch): not admissible yet."""
        return self.connector is not None and self.connector.is_receiving(req)

    def cache_blocks(self, req, num_tokens: int | None = None) -> None:
        """After a step: record how full its blocks are and name those that became full (up to
        `num_tokens`, default `num_computed_tokens`; level 4 names fewer while its draft's cache lags)."""
        n = req.num_computed_tokens if num_tokens is None else num_tokens
        self.record_fill(req)
        done = self.num_named.get(req.seq_id, 0)
        self.num_named[req.seq_id] = self.prefix.name_full_blocks(req, self.req_blocks[req.seq_id], done, n)

    def record_fill(self, req) -> None:
        """Update the fill of its blocks, from the last recorded count to `num_computed_tokens`
        (`cache_blocks` does it; level 3's beam search, which names no block, calls it alone)."""
        blocks, bs, now = self.req_blocks[req.seq_id], self.block_size, req.num_computed_tokens
        before = self.num_filled.get(req.seq_id, 0)
        lo, hi = min(before, now), max(before, now)
        for i in range(lo // bs, min(len(blocks), blocks_for(hi, bs))):
            self.pool.fill(blocks[i], min(bs, max(0, now - i * bs)))
        self.num_filled[req.seq_id] = now

    def free(self, req) -> None:
        if self.connector is not None:
            self.external.pop(req.seq_id, None)
            self.connector.request_finished(req, self.block_table(req) if req.seq_id in self.req_blocks else [])
        self.cow.forget(req)
        self.pool.free(list(reversed(self.req_blocks.pop(req.seq_id, []))))
        self.num_named.pop(req.seq_id, None)
        self.num_filled.pop(req.seq_id, None)

    def block_table(self, req) -> list[int]:
        return [b.block_id for b in self.req_blocks[req.seq_id]]

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def usage(self) -> tuple[int, int]:
        return self.num_blocks - self.pool.num_free, self.pool.num_stored

    def ref_counts(self) -> list[int]:
        return [b.ref_cnt for b in self.pool.blocks]

    def cached_free_blocks(self) -> list[int]:
        return [b.block_id for b in self.pool.free_queue if b.block_hash is not None]  # LRU: evicted first

    # --- the fork (copy_on_write.py) ----------------------------------------------------------
    def fork(self, parent, child) -> None:
        """The child starts as the parent: the same blocks (each ref +1), the same bookkeeping.
        Its `num_computed_tokens` must be the parent's (every block and fill count is the parent's, so a
        child with fewer would hold blocks past its end); nothing is copied until one writes."""
        if child.num_computed_tokens != parent.num_computed_tokens:
            raise ValueError(f"fork: the child has {child.num_computed_tokens} computed tokens, the parent "
                             f"{parent.num_computed_tokens}")  # fmt: skip
        if child.seq_id in self.req_blocks:
            raise ValueError(f"sequence {child.seq_id} already holds blocks")
        self.req_blocks[child.seq_id] = self.cow.fork(self.req_blocks[parent.seq_id])
        self.num_named[child.seq_id] = self.num_named.get(parent.seq_id, 0)
        self.num_filled[child.seq_id] = self.num_filled.get(parent.seq_id, 0)

    def fork_at_admission(self, child, parent) -> None:
        """Level 3's scheduler asks for sample j > 0 of an `n` > 1 request (copy_on_write.py says what it does)."""
        self.cow.fork_at_admission(child, parent)

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The copies recorded since the last call, for the next step's input."""
        return self.cow.take_block_copies()

    # --- what the engine, its metrics and its readers ask: the parts' counters ---------------------
    queries = property(lambda self: self.prefix.queries)  # tokens looked up at admission
    hits = property(lambda self: self.prefix.hits)  # of which found in the cache
    block_copies = property(lambda self: self.cow.block_copies)  # copies the next step must make
    num_copied = property(lambda self: self.cow.num_copied)
    forked_tokens = property(lambda self: self.cow.forked_tokens)
    fork_parents = property(lambda self: self.cow.parents)

    def reset_prefix_cache(self) -> None:
        self.pool.reset()
        if self.connector is not None:
            self.connector.reset()

    def stats(self) -> dict:
        return self.prefix.stats()
