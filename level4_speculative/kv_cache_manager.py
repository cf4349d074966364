"""Level 3's prefix-caching KV manager, for two caches on one set of block tables.

What it is: `DraftAwareKVCacheManager`. With a draft model, every block holds K/V in
two caches (the target's and the draft's, same block ids). A named block may be handed
to another request as a prefix hit, and both models then read it, so a block is named
only when *both* caches hold all its tokens: the target's count is
`num_computed_tokens`, the draft's `draft_num_computed`, and the draft lags behind while
speculation is off (`disable_by_batch_size`), or by one token after a run of guesses is
accepted whole (the last guess is never fed to the draft).

When a request's blocks are freed (preempted, finished, aborted), what the proposer keeps for them
goes too: EAGLE's filed features (`eagle_features`, which the budget counts per token a request holds
in the cache, so they must not outlive its blocks).

What it is not: needed for n-gram proposals, which keep no cache (level 3's manager then).
"""

from __future__ import annotations

from level3_prefix.kv_cache_manager import PrefixCachingKVCacheManager

from .request import SpecRequest


class DraftAwareKVCacheManager(PrefixCachingKVCacheManager):
    def cache_blocks(self, req: SpecRequest, num_tokens: int | None = None) -> None:
        n = req.num_computed_tokens if num_tokens is None else num_tokens
        super().cache_blocks(req, min(n, req.draft_num_computed))

    def free(self, req: SpecRequest) -> None:
        super().free(req)
        req.eagle_features = None  # (a preempted request files afresh when it runs again, from its new count)
