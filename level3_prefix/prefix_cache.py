"""Prefix lookup and caching: find a request's prefix among the named blocks, and name its blocks as they fill.

What it is: `PrefixCache`, the two moves of automatic prefix caching over the block pool
(block_pool.py), and their counters:

  - `lookup(req)`, at admission: walk the request's block names (block_hash.py) through the
    pool until the first miss. The last token is never taken from the cache (there must be
    something to compute, to get logits to sample from), so a prompt of 32 tokens with
    16-token blocks can reuse one block, not two. A request that asks for its prompt's
    logprobs computes its whole prompt (vLLM V1 does the same: a hit's positions would have
    no logits); its blocks are still named and shared afterwards.

        request names:  h1 h2 h3 h4        pool: h1 -> b7, h2 -> b2, h3 -> (evicted), h4 -> b9
        lookup:         [b7, b2]           stops at h3: h4's block is not this prefix's (its
                                           parent is h3), and the chain never skips

  - `name_full_blocks(req, blocks, done, num_tokens)`, after a step: every block that became
    full gets its name registered in the pool, so the next request with the same prefix finds
    it. Generated tokens count too, so a conversation's next turn hits its previous answer.

`queries` and `hits` count tokens looked up and found (vLLM's `prefix_cache_queries` and
`prefix_cache_hits`), once per admission that sticks (`count`).

What it is not: the per-request bookkeeping (kv_cache_manager.py), the eviction order
(block_pool.py: LRU), or a cache-aware scheduler (requests are still served in arrival order).

Reference: vLLM `docs/design/prefix_caching.md`; `v1/core/kv_cache_manager.py`
(`get_computed_blocks`) and `v1/core/block_pool.py` (`cache_full_blocks`).
"""

from __future__ import annotations

from .block_hash import block_hashes
from .block_pool import BlockPool, KVBlock


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int, enabled: bool = True):
        self.pool, self.block_size, self.enabled = pool, block_size, enabled
        self.queries = 0  # tokens looked up at admission (a readmitted preempted request looks up its output too)
        self.hits = 0  # of which found in the cache

    def lookup(self, req) -> list[KVBlock]:
        """The cached blocks of `req`'s prefix, in order, up to the first miss (see the module docstring)."""
        if not self.enabled or req.params.prompt_logprobs is not None:
            return []
        bs, hit = self.block_size, []
        usable = (req.num_tokens - 1) // bs  # keep the last token to compute
        for i, h in enumerate(block_hashes(req, usable, bs, self.pool.hash_fn)):
            parent = hit[-1].block_hash if hit else None
            b = self.pool.lookup(h, parent, tuple(req.token_slice(i * bs, bs)))
            if b is None:
                break
            hit.append(b)
        return hit

    def count(self, req, num_hit_blocks: int) -> None:
        """An admission stuck with this lookup: count its tokens asked for and found."""
        self.queries += req.num_tokens
        self.hits += num_hit_blocks * self.block_size

    def name_full_blocks(self, req, blocks: list[KVBlock], done: int, num_tokens: int) -> int:
        """Register the names of `blocks` that `num_tokens` tokens fill, past the first `done` already
        named; returns how many are named now."""
        full = num_tokens // self.block_size
        if not self.enabled or full <= done:
            return done
        bs, hashes = self.block_size, block_hashes(req, full, self.block_size, self.pool.hash_fn)
        for i in range(done, full):
            self.pool.register(blocks[i], hashes[i], hashes[i - 1] if i else None, tuple(req.token_slice(i * bs, bs)))
        return full

    def stats(self) -> dict:
        return {
            "prefix_cache_queries": self.queries,
            "prefix_cache_hits": self.hits,
            "prefix_cache_hit_rate": self.hits / self.queries if self.queries else 0.0,
            "cached_blocks": len(self.pool.cached),
            "evictions": self.pool.evictions,
        }


__all__ = ["PrefixCache"]
