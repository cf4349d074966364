"""A KV cache manager with automatic prefix caching: level 2's Protocol over a `BlockPool`.

What it is: `PrefixCachingKVCacheManager`, which implements level 2's `KVCacheManager`
Protocol (it inherits nothing from level 2's simple manager):

  - `get_computed_blocks(req)`: hash the request's full blocks in a chain and walk the
    cache until the first miss. The last token is never taken from the cache (there
    must be something to compute, to get logits to sample from), so a prompt of 32
    tokens with 16-token blocks can reuse one block, not two.
  - `allocate_slots(req, n, computed)`: touch the hit blocks (ref +1, out of
    the free queue), then allocate the rest; all or nothing.
  - `cache_blocks(req, num_tokens)`: after a step, record how full the request's blocks
    are and name every block that became full. Generated tokens count too, so a
    conversation's next turn hits its previous answer. Only the first `num_tokens` are
    named (default `num_computed_tokens`; level 4 names fewer while its second cache lags).

    request tokens:  [ t0 .. t15 | t16 .. t31 | t32 .. t37 ]
    block hashes:      h1=H(-,t0..15)  h2=H(h1,t16..31)   (partial: not cached)

Sharing by reference count also gives the PagedAttention paper's fork (beam search, and
`n` samples of one prompt): `fork(parent, child)` hands the child the parent's blocks,
each one's count +1, and nothing is copied. Whoever then writes into a block someone
else holds gets a copy first (copy-on-write): `allocate_slots` swaps the shared block for
a new one and records (src, dst) for the worker, which copies it before the step writes.

    parent  [ b3 | b8 | b5 (10 of 16) ]      fork        child [ b3 | b8 | b5 ]   b5 ref 2
    child appends a token at position 42 -> b5 is shared -> copy b5 to b11, b5 ref 1:
    parent  [ b3 | b8 | b5 ]   child [ b3 | b8 | b11 (b5's 10 tokens, then its own) ]

Full blocks are never written again, so they stay shared for good; only the last,
partial block is ever copied, and only once per fork.

The names are kept on the request (`req.block_hashes`, computed once each, as vLLM
does), so a preempted request comes back knowing them. On `free`, a request's blocks
go back in reverse order, so when memory is needed its tail (the least shareable part)
is evicted before its head.

What it is not: a cache-aware scheduler (requests are still served in arrival order).

Reference: vLLM `docs/design/prefix_caching.md`, `v1/core/kv_cache_manager.py`.
"""

from __future__ import annotations

from level1_paged.paged_cache import blocks_for
from level2_continuous.request import Request

from .block_pool import BlockPool, KVBlock, hash_block


class PrefixCachingKVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, hash_fn=hash_block):
        self.block_size, self.num_blocks = block_size, num_blocks
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, hash_fn)
        self.req_blocks: dict[int, list[KVBlock]] = {}  # seq_id -> its blocks, logical order
        self.num_named: dict[int, int] = {}  # seq_id -> how many of its blocks are registered
        self.num_filled: dict[int, int] = {}  # seq_id -> tokens of it recorded in its blocks' fill
        self.queries = 0  # tokens looked up at admission (vLLM: prefix_cache_queries); a readmitted
        # preempted request looks up its prompt and its output so far
        self.hits = 0  # of which found in the cache (vLLM: prefix_cache_hits)
        self.block_copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write copies the next step must make
        self.fork_parents: dict[int, Request] = {}  # seq_id of a sample to fork at admission -> its parent
        self.fork_granted: set[int] = set()  # of those, the ones whose last lookup was answered with the fork
        self.forked_tokens = 0  # tokens samples took from their parent at admission instead of computing
        self.num_copied = 0  # copies made since the start (the fork's only cost in memory traffic)

    # --- hashing --------------------------------------------------------------------
    def _hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        """The chained names of the request's first `num_blocks` full blocks (memoised on it)."""
        hashes, bs = req.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(self.pool.hash_fn(hashes[-1] if hashes else None, tuple(req.token_slice(i * bs, bs))))
        return hashes[:num_blocks]

    # --- the Protocol ------------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        self.fork_granted.discard(req.seq_id)
        parent = self.fork_parents.get(req.seq_id)
        if parent is not None and parent.seq_id in self.req_blocks and parent.num_computed_tokens >= req.num_tokens - 1:
            n = req.num_tokens - 1  # a sample forked from its parent: all but its last token, partial block too
            self.fork_granted.add(req.seq_id)
            return self.req_blocks[parent.seq_id][: blocks_for(n, self.block_size)], n
        # A request that wants its prompt's logprobs computes its whole prompt (vLLM V1 does the same:
        # a hit's positions would have no logits); its blocks are still named and shared afterwards.
        if not self.enable_caching or req.params.prompt_logprobs is not None:
            return [], 0
        usable = (req.num_tokens - 1) // self.block_size  # keep the last token to compute
        bs, hit = self.block_size, []
        for i, h in enumerate(self._hashes(req, usable)):
            parent = hit[-1].block_hash if hit else None
            b = self.pool.lookup(h, parent, tuple(req.token_slice(i * bs, bs)))
            if b is None:
                break
            hit.append(b)
        return hit, len(hit) * bs

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: list | None = None,
                       keep_free: int = 0) -> bool:  # fmt: skip
        blocks = self.req_blocks.setdefault(req.seq_id, [])
        computed = computed_blocks or []
        total = req.num_computed_tokens + num_new_tokens
        need = blocks_for(total, self.block_size) - len(blocks) - len(computed)
        shared = self._blocks_to_copy(blocks + computed, len(blocks), req.num_computed_tokens, total)
        idle_hits = sum(b.ref_cnt == 0 for b in computed)  # touching them takes them off the free queue
        if max(need, 0) + len(shared) > self.pool.num_free - idle_hits - keep_free:
            if not blocks:
                del self.req_blocks[req.seq_id]
            return False
        self.pool.touch(computed)  # first, so no allocation below can evict a hit
        blocks.extend(computed)
        if computed_blocks is not None:  # an admission: count the lookup once, when it sticks
            if req.seq_id in self.fork_granted:  # shared with its parent, not looked up
                self.forked_tokens += req.num_computed_tokens
                self.fork_parents.pop(req.seq_id)
                self.fork_granted.discard(req.seq_id)
            else:
                self.queries += req.num_tokens
                self.hits += len(computed) * self.block_size
            self.num_named[req.seq_id] = next(
                (i for i, b in enumerate(computed) if b.block_hash is None), len(computed)
            )
            self.num_filled[req.seq_id] = req.num_computed_tokens  # what the hit (or forked) blocks hold
        for i in shared:
            self._copy_on_write(req, blocks, i)
        blocks.extend(self.pool.allocate(max(need, 0)))
        return True

    def _blocks_to_copy(self, held: list[KVBlock], num_own: int, start: int, end: int) -> list[int]:
        """Indices into `held` of the blocks that positions [start, end) write into and that another
        sequence holds too: each needs a copy of its own first. `held` is the sequence's blocks, then
        (from index `num_own` on) the hit or forked blocks it is about to touch, which count +1 then."""
        bs = self.block_size
        writes = range(start // bs, min(len(held), blocks_for(end, bs)))
        return [i for i in writes if held[i].ref_cnt + (i >= num_own) > 1]

    def _copy_on_write(self, req: Request, blocks: list[KVBlock], i: int) -> None:
        """Swap the shared blocks[i] for a fresh block holding the same tokens: record (old, new) for
        the step's copy, drop this sequence's reference to the old one; the copy has no name."""
        old, (new,) = blocks[i], self.pool.allocate(1)
        self.pool.fill(new, max(0, min(self.block_size, self.num_filled.get(req.seq_id, 0) - i * self.block_size)))
        self.block_copies.append((old.block_id, new.block_id))
        self.num_copied += 1
        blocks[i] = new
        self.pool.free([old])  # still held by the others (ref >= 1)
        self.num_named[req.seq_id] = min(self.num_named.get(req.seq_id, 0), i)  # the copy has no name

    def fork(self, parent: Request, child: Request) -> None:
        """The child starts as the parent: the same blocks (each ref +1), the same bookkeeping.
        Its `num_computed_tokens` must be the parent's (every block and fill count is the parent's, so a
        child with fewer would hold blocks past its end); nothing is copied until one writes."""
        if child.num_computed_tokens != parent.num_computed_tokens:
            raise ValueError(f"fork: the child has {child.num_computed_tokens} computed tokens, the parent "
                             f"{parent.num_computed_tokens}")  # fmt: skip
        if child.seq_id in self.req_blocks:
            raise ValueError(f"sequence {child.seq_id} already holds blocks")
        blocks = list(self.req_blocks[parent.seq_id])
        self.pool.touch(blocks)
        self.req_blocks[child.seq_id] = blocks
        self.num_named[child.seq_id] = self.num_named.get(parent.seq_id, 0)
        self.num_filled[child.seq_id] = self.num_filled.get(parent.seq_id, 0)

    def fork_at_admission(self, child: Request, parent: Request) -> None:
        """When `child` (a fresh sample of the same prompt) is admitted, it takes the blocks of its
        prompt but the last token from `parent`, if the parent still holds them computed (else it
        prefills as usual). Level 3's scheduler calls this for sample j > 0 of an `n` > 1 request."""
        self.fork_parents[child.seq_id] = parent

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The copies recorded since the last call, for the next step's `ModelInput.block_copies`."""
        copies, self.block_copies = self.block_copies, []
        return copies

    def cache_blocks(self, req: Request, num_tokens: int | None = None) -> None:
        n = req.num_computed_tokens if num_tokens is None else num_tokens
        self.record_fill(req)
        if not self.enable_caching:
            return
        full = n // self.block_size
        done = self.num_named.get(req.seq_id, 0)
        if full <= done:
            return
        blocks, bs = self.req_blocks[req.seq_id], self.block_size
        hashes = self._hashes(req, full)
        for i in range(done, full):
            parent = hashes[i - 1] if i else None
            self.pool.register(blocks[i], hashes[i], parent, tuple(req.token_slice(i * bs, bs)))
        self.num_named[req.seq_id] = full

    def record_fill(self, req: Request) -> None:
        """Update the fill of its blocks, from the last recorded count to `num_computed_tokens`
        (`cache_blocks` does it; level 3's beam search, which names no block, calls it alone)."""
        blocks, bs, now = self.req_blocks[req.seq_id], self.block_size, req.num_computed_tokens
        before = self.num_filled.get(req.seq_id, 0)
        lo, hi = min(before, now), max(before, now)
        for i in range(lo // bs, min(len(blocks), blocks_for(hi, bs))):
            self.pool.fill(blocks[i], min(bs, max(0, now - i * bs)))
        self.num_filled[req.seq_id] = now

    def free(self, req: Request) -> None:
        self.fork_parents.pop(req.seq_id, None)
        self.fork_granted.discard(req.seq_id)
        self.pool.free(list(reversed(self.req_blocks.pop(req.seq_id, []))))
        self.num_named.pop(req.seq_id, None)
        self.num_filled.pop(req.seq_id, None)

    def block_table(self, req: Request) -> list[int]:
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

    # --- prefix-cache services -------------------------------------------------------------
    def reset_prefix_cache(self) -> None:
        self.pool.reset()

    def stats(self) -> dict:
        return {
            "prefix_cache_queries": self.queries,
            "prefix_cache_hits": self.hits,
            "prefix_cache_hit_rate": self.hits / self.queries if self.queries else 0.0,
            "cached_blocks": len(self.pool.cached),
            "evictions": self.pool.evictions,
        }
