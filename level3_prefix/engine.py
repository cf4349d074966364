"""Level 3: level 2's engine with automatic prefix caching.

What it is: `PrefixCachingEngine` (exported as `LLMEngine`) and `LLM` of level 2 with one part replaced, the KV cache
manager (`kv_cache_manager.PrefixCachingKVCacheManager`), and its requests carrying their block
names (`block_hash.PrefixRequest`). The worker and the attention kernel do not change, nor does
the scheduler but for the samples' fork (below): a prefix hit simply admits a request with
`num_computed_tokens > 0`, and its first chunk is a query of length > 1 over a longer
context, which the paged kernel already handles.

Adds `enable_prefix_caching` (default on), `reset_prefix_cache()`, `prefix_stats()`
and the `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` metrics. The same
reference counts give the PagedAttention paper's fork: `LLM.beam_search` (`beam_search.py`),
whose beams share blocks and copy the last one on write, and `n` > 1 samples, which fork
after their prompt (`scheduler.ForkingScheduler`); a step that must copy blocks first carries
them to the worker in its input (copy_on_write.py: `CopyOnWriteInput`).

What it is not: a cache-aware scheduler, or a cache that outlives the process.

Reference: vLLM V1 automatic prefix caching (`docs/design/prefix_caching.md`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ladder import rooms
from ladder.metrics import Counter, Metric
from level1_paged.engine import PagedCacheConfig
from level1_paged.model_input import ModelInput
from level2_continuous.engine import LLM as ContinuousLLM
from level2_continuous.engine import ContinuousEngine
from level2_continuous.scheduler import SchedulerOutput

from .beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from .block_hash import PrefixRequest, hash_block
from .copy_on_write import CopyOnWriteInput
from .kv_cache_manager import PrefixCachingKVCacheManager
from .scheduler import ForkingScheduler


@dataclass
class PrefixCacheConfig(PagedCacheConfig):
    enable_prefix_caching: bool = True
    # a KV connector (vLLM's names: {"kv_connector": "OffloadingConnector", ...}; features/kv_connectors)
    kv_transfer_config: object = None


class PrefixCachingEngine(ContinuousEngine):
    config_parts = {**ContinuousEngine.config_parts, "cache": PrefixCacheConfig}
    sequence_class = PrefixRequest
    scheduler_class = ForkingScheduler

    fork_samples = True  # n > 1: samples fork after the prompt (level 4 with a draft model: off)
    connector = None  # a KV connector (make_connector), or None

    def make_kv_manager(self) -> PrefixCachingKVCacheManager:
        c = self.config.cache
        return PrefixCachingKVCacheManager(self.num_blocks, c.block_size, c.enable_prefix_caching,
                                           connector=self.make_connector())  # fmt: skip

    def make_connector(self):
        """The KV connector `kv_transfer_config` names (ladder/rooms.py), both its sides wired: the
        worker's cache registered with it, the worker told to run its moves. None without one."""
        c = self.config.cache
        model = os.path.basename(os.path.normpath(self.config.model.model))  # what two engines trading KV compare
        self.connector = rooms.kv_connector(c.kv_transfer_config, c.block_size, hash_block, model)
        if self.connector is not None:
            if not c.enable_prefix_caching:
                raise ValueError("kv_transfer_config needs enable_prefix_caching=True (the connector finds blocks "
                                 "by their prefix-cache names)")  # fmt: skip
            if self.config.lora.enable_lora and getattr(self.connector, "role", "kv_both") != "kv_both":
                raise ValueError("a TCPConnector with enable_lora=True is not built (a transfer does not say which "
                                 "adapter computed its blocks)")  # fmt: skip
            if c.calculate_kv_scales and getattr(self.connector, "role", "kv_both") != "kv_both":
                raise ValueError("a TCPConnector with calculate_kv_scales=True is not built (each engine calibrates "
                                 "its own fp8 scales, so one's blocks would read wrong in the other)")  # fmt: skip
            self.connector.register_kv_caches(self.worker.cache)
            self.worker.kv_connector = self.connector
        return self.connector

    def make_scheduler(self) -> ForkingScheduler:
        scheduler = super().make_scheduler()
        scheduler.fork_samples = self.fork_samples
        return scheduler

    def schedule(self) -> SchedulerOutput:
        """Level 2's, after the connector's worker side says which transfers finished since the last
        step (vLLM's `get_finished`): a request's KV counts as arrived from one step boundary to the
        next, never in the middle of one, so what the scheduler saw is what the step's checks see."""
        if self.connector is not None:
            self.connector.get_finished()
        return super().schedule()

    def prepare_input(self, sched: SchedulerOutput) -> ModelInput:
        """Level 2's input, plus the copies a forked sequence's first write needs (copy-on-write), and
        the connector's moves for this step handed to the worker's side of it (one process: directly;
        vLLM ships them to each worker inside the SchedulerOutput)."""
        self.bind_connector(sched)
        return CopyOnWriteInput.with_copies(super().prepare_input(sched), self.kv.take_block_copies())

    def bind_connector(self, sched: SchedulerOutput | None = None) -> None:
        """Hand the connector's moves since the last step to its worker side, for the next forward
        (every caller of `worker.execute` does this first: the steps here, and beam search's own)."""
        if self.connector is not None:
            self.connector.bind_connector_metadata(self.connector.build_connector_meta(sched))

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (running requests keep their blocks)."""
        self.kv.reset_prefix_cache()

    def prefix_stats(self) -> dict:
        """prefix_cache_queries / prefix_cache_hits (tokens), hit rate, cached blocks, evictions."""
        return self.kv.stats()

    def kv_connector_stats(self) -> dict:
        """The connector's counters (tiers' blocks, hits, bytes moved, seconds); {} without one."""
        return self.connector.stats() if self.connector is not None else {}

    def get_metrics(self) -> list[Metric]:
        return super().get_metrics() + [
            Counter("vllm:prefix_cache_queries", value=self.kv.queries),
            Counter("vllm:prefix_cache_hits", value=self.kv.hits),
        ] + (self.connector.metrics() if self.connector is not None else [])


class LLM(ContinuousLLM):
    """The offline entry point, with prefix caching."""

    engine_class = PrefixCachingEngine

    def reset_prefix_cache(self) -> None:
        self.llm_engine.reset_prefix_cache()

    def prefix_stats(self) -> dict:
        return self.llm_engine.prefix_stats()

    def beam_search(self, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: the `beam_width` best sequences of each prompt, best first;
        beams share their parent's KV blocks and copy the last one on write (`beam_search.py`)."""
        return beam_search(self.llm_engine, prompts, params)


LLMEngine = PrefixCachingEngine  # vLLM's name
