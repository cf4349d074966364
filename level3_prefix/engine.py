"""Level 3: level 2's engine with automatic prefix caching.

What it is: `PrefixCachingEngine` (exported as `LLMEngine`) and `LLM` of level 2 with one part replaced, the KV cache
manager (`kv_cache_manager.PrefixCachingKVCacheManager`). The scheduler, the worker and
the attention kernel do not change: a prefix hit simply admits a request with
`num_computed_tokens > 0`, and its first chunk is a query of length > 1 over a longer
context, which the paged kernel already handles.

Adds `enable_prefix_caching` (default on), `reset_prefix_cache()`, `prefix_stats()`
and the `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` metrics.

What it is not: a cache-aware scheduler, or a cache that outlives the process.

Reference: vLLM V1 automatic prefix caching (`docs/design/prefix_caching.md`).
"""

from __future__ import annotations

from dataclasses import dataclass

from level0_naive.metrics import Counter, Metric
from level2_continuous.engine import LLM as ContinuousLLM
from level2_continuous.engine import ContinuousEngine, ContinuousEngineConfig

from .kv_cache_manager import PrefixCachingKVCacheManager


@dataclass
class PrefixEngineConfig(ContinuousEngineConfig):
    enable_prefix_caching: bool = True


class PrefixCachingEngine(ContinuousEngine):
    config_class = PrefixEngineConfig

    def make_kv_manager(self) -> PrefixCachingKVCacheManager:
        return PrefixCachingKVCacheManager(self.num_blocks, self.config.block_size, self.config.enable_prefix_caching)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (running requests keep their blocks)."""
        self.kv.reset_prefix_cache()

    def prefix_stats(self) -> dict:
        """prefix_cache_queries / prefix_cache_hits (tokens), hit rate, cached blocks, evictions."""
        return self.kv.stats()

    def get_metrics(self) -> list[Metric]:
        return super().get_metrics() + [
            Counter("vllm:prefix_cache_queries", value=self.kv.queries),
            Counter("vllm:prefix_cache_hits", value=self.kv.hits),
        ]


class LLM(ContinuousLLM):
    """The offline entry point, with prefix caching."""

    engine_class = PrefixCachingEngine

    def reset_prefix_cache(self) -> None:
        self.llm_engine.reset_prefix_cache()

    def prefix_stats(self) -> dict:
        return self.llm_engine.prefix_stats()


LLMEngine = PrefixCachingEngine  # vLLM's name
