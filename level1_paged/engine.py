"""Level 1: level 0's engine with its KV cache swapped for PagedAttention.

What it is: the same static batching as level 0 (a batch runs until its longest request
ends, nobody joins it), so the only difference a reader sees is memory:

  - admission asks for blocks for a request's *current* length, not its maximum;
  - each decode step takes a new block only when a sequence's last block is full;
  - a finished request returns its blocks at once (level 0 held its slab to batch end).

Because requests are admitted on their current size, a batch can outgrow the pool. Then
the youngest request in the batch is evicted: its blocks are freed and it goes back to
the head of the queue, keeping the tokens it generated, to be recomputed (prefilled
again) in a later batch. Level 2 turns this emergency exit into a scheduling policy.

What it is not: continuous batching (level 2) or prefix sharing (level 3). Only the
hooks of `level0_naive.engine.LLM` that touch the KV cache are replaced here.

Reference: Kwon et al., SOSP 2023, sections 4.2 (block table) and 4.5 (recomputation).
"""

from __future__ import annotations

from dataclasses import dataclass

from level0_naive.config import EngineConfig
from level0_naive.engine import LLM as NaiveLLM
from level0_naive.outputs import Sequence

from .paged_cache import BlockTables, PagedAttention, PagedKVCache, PagedMetadata, attention_impl, blocks_for


@dataclass
class PagedEngineConfig(EngineConfig):
    block_size: int = 16  # tokens per KV block
    attention_backend: str = "auto"  # auto (triton on CUDA, torch on CPU) | torch | triton | ref

    def __post_init__(self):
        super().__post_init__()
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be >= 1")


class LLM(NaiveLLM):
    config_class = PagedEngineConfig

    def _init_kv_cache(self) -> None:
        bs = self.config.block_size
        self.num_blocks = self.kv_budget // (bs * self.bytes_per_token)
        if self.num_blocks < 1:
            raise ValueError(f"kv_cache_memory={self.kv_budget} bytes holds no block of {bs} tokens ({bs * self.bytes_per_token} bytes)")
        self.cache = PagedKVCache(self.model_config, self.num_blocks, bs, self.dtype, self.device)
        self.blocks = BlockTables(self.num_blocks, bs)
        self.impl = attention_impl(self.config.attention_backend, self.device)
        self.scale = self.model_config.head_dim**-0.5
        self.cached: dict[int, int] = {}  # seq_id -> tokens whose k/v are in its blocks

    def _fits(self, seq: Sequence, i: int) -> None:
        need = blocks_for(seq.max_total_tokens, self.config.block_size)
        if need > self.num_blocks:
            raise ValueError(f"prompt {i} may need {need} KV blocks (prompt + max_tokens = {seq.max_total_tokens} tokens) but the pool has {self.num_blocks}")

    def _admit_one(self, seq: Sequence) -> bool:
        """Admit if the pool holds the request's tokens *now* (its prefill)."""
        if self.blocks.missing_blocks(seq.seq_id, seq.num_tokens) > self.blocks.allocator.num_free:
            return False
        self.blocks.grow(seq.seq_id, seq.num_tokens)
        self.cached[seq.seq_id] = 0
        return True

    def _attention(self, running: list[Sequence], chunks):
        # Every sequence needs room for its new tokens; evict the youngest until all fit.
        while True:
            short = sum(self.blocks.missing_blocks(s.seq_id, pos + len(toks)) for s, (toks, pos) in zip(running, chunks))
            if short <= self.blocks.allocator.num_free:
                break
            victim = running.pop()  # the last admitted
            chunks = chunks[: len(running)]
            self._evict(victim)
        for s, (toks, pos) in zip(running, chunks):
            self.blocks.grow(s.seq_id, pos + len(toks))
            self.cached[s.seq_id] = pos + len(toks)
        slots = [slot for s, (toks, pos) in zip(running, chunks) for slot in self.blocks.slots(s.seq_id, pos, len(toks))]
        meta = PagedMetadata.build(
            [self.blocks.tables[s.seq_id] for s in running], [pos for _, pos in chunks], [len(t) for t, _ in chunks], slots, self.device
        )
        return PagedAttention(self.cache, meta, self.impl, self.scale), running, chunks

    def _evict(self, seq: Sequence) -> None:
        """Free a running request's blocks and requeue it at the head; it keeps its tokens."""
        self._on_finish(seq)
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    def _on_finish(self, seq: Sequence) -> None:
        self.blocks.free(seq.seq_id)
        self.cached.pop(seq.seq_id, None)

    def _end_batch(self, batch: list[Sequence]) -> None:
        """Nothing left to free: blocks went back as each request finished."""

    def _kv_usage(self) -> tuple[int, int]:
        reserved = self.blocks.allocator.num_used * self.config.block_size
        return reserved * self.bytes_per_token, sum(self.cached.values()) * self.bytes_per_token
