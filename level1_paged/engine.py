"""Level 1: level 0's engine with its KV cache swapped for PagedAttention.

What it is: the same static batching as level 0 (a batch runs until its longest request
ends, nobody joins it), so the only difference a reader sees is memory:

  - admission asks for blocks for a request's *current* length, not its maximum;
  - each decode step takes a new block only when a sequence's last block is full;
  - a finished request returns its blocks at once (level 0 held its slab to batch end).

Because requests are admitted on their current size, a batch can outgrow the pool. Then
the youngest request in the batch is evicted: its blocks are freed and it goes back to
the head of the queue, keeping the tokens it generated, to be recomputed (prefilled
again) in a later batch.

The model now runs in a `Worker` (`worker.py`) that owns the paged KV cache; each step
the engine hands it one `ModelInput` built from the block tables.

What it is not: a change to the batching: only the KV methods of `level0_naive.engine.NaiveEngine`
are replaced here. Level 2 turns the emergency exit into a scheduling policy, and level 3
shares blocks between requests with a common prefix.

Reference: Kwon et al., SOSP 2023, sections 4.2 (block table) and 4.5 (recomputation).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ladder import rooms
from level0_naive.config import PARTS, CacheConfig, Part, resolve_device
from level0_naive.engine import NaiveEngine
from level0_naive.kv_cache import kv_bytes_per_token
from level0_naive.llm import LLM as NaiveLLM
from level0_naive.model_runner import Chunk
from level0_naive.outputs import Sequence

from .block_table import BlockTables, check_fits_in_pool, num_blocks_for_budget
from .model_input import ModelInput
from .worker import Worker


@dataclass
class PagedCacheConfig(CacheConfig):
    block_size: int = 16  # tokens per KV block
    attention_backend: str = "auto"  # auto (triton on CUDA, the compiled kernel on CPU, else torch) | cpu | torch | triton | ref
    kv_cache_dtype: str = "auto"  # the model's dtype | "fp8" | "int8": the cache in 8 bits (a room's; vLLM's names)
    calculate_kv_scales: bool = False  # fp8: each layer's scales from the first forward (else 1.0)

    def __post_init__(self):
        super().__post_init__()
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be >= 1")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in (names := rooms.kv_cache_dtypes()):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not one of: auto, {', '.join(names)}")
        if self.calculate_kv_scales and self.kv_cache_dtype != "fp8":
            raise ValueError(f"calculate_kv_scales=True calibrates fp8's per-layer scales; kv_cache_dtype="
                             f"{self.kv_cache_dtype!r} has none to calibrate")  # fmt: skip

    def kv_head_bytes(self, head_dim: int) -> int | None:
        """One KV head's bytes in a token's slot in an 8-bit format (None: the model's dtype decides)."""
        return rooms.kv_head_bytes(self.kv_cache_dtype, head_dim)

    def worker_kwargs(self) -> dict:
        """What a Worker takes of these settings besides the block size and backend."""
        return {"kv_cache_dtype": self.kv_cache_dtype, "calculate_kv_scales": self.calculate_kv_scales}


@dataclass
class CompilationSettings(Part):
    """`compilation_config=`: None (the platform's default, below), 0 (eager), 3 or a dict of vLLM's
    fields (torch.compile: the room features/compilation); `enforce_eager=True`: eager whatever it says.
    `config` is the checked one (None: eager); `asked` says whether the caller chose it.

    The default (compilation_config=None) is level 3 on a CPU, where the compiled step is faster at
    every batch size measured in one process, and at level 5's ranks faster at batch 1 and even at
    batch 32 (docs/compiled_step.md); eager on a GPU (its CUDA-graph path has not run on one yet) and
    with batch_invariant=True, where compilation is not built (nor over ranks on a GPU).
    LADDER_COMPILE_LEVEL=0 makes the default eager (vLLM had
    VLLM_TORCH_COMPILE_LEVEL): what the test suite sets, where a compile per engine would cost minutes."""

    compilation_config: object = None
    enforce_eager: bool = False

    def __post_init__(self):
        self.asked = self.compilation_config is not None
        value = self.compilation_config if self.asked else int(os.environ.get("LADDER_COMPILE_LEVEL", "3"))
        self.config = rooms.compilation_config(value, self.enforce_eager)  # None: eager
        if self.config is not None:
            self.config.by_default = not self.asked  # the room leaves an MoE model eager then (its docstring)


def compilation_for(config, parallel: bool = False) -> object:
    """The engine's checked compilation config (None: eager): the default only where it is built
    (see CompilationSettings), one that was asked for refused with a one-line error where it is not."""
    part, compilation = config.compilation, config.compilation.config
    if compilation is None:
        return None
    if getattr(getattr(config, "lora", None), "enable_lora", False):  # (the adapters' per-step mapping)
        if part.asked:
            raise ValueError("compilation_config with enable_lora=True is not built: use enforce_eager=True")
        return None
    if getattr(config.model, "quantization", None) is not None:  # (quantized weights: objects a graph cannot hold)
        if part.asked:
            raise ValueError("compilation_config with quantization is not built: use enforce_eager=True")
        return None
    if not part.asked:  # the default: compiled on a CPU (every rank its shard), outside the batch-invariant mode
        cpu = resolve_device(config.model.device).type == "cpu"
        return compilation if cpu and not config.model.batch_invariant else None
    if config.model.batch_invariant:
        raise ValueError("compilation_config with batch_invariant=True is not built (Inductor's kernels are "
                         "not fixed-order): use enforce_eager=True")  # fmt: skip
    if parallel and resolve_device(config.model.device).type != "cpu":  # (each rank compiles its shard on a CPU)
        raise ValueError("compilation_config at tensor_parallel_size x pipeline_parallel_size > 1 on a GPU is not "
                         "built (its collectives inside captured CUDA graphs): use enforce_eager=True")  # fmt: skip
    return compilation


class PagedEngine(NaiveEngine):
    config_parts = {**PARTS, "cache": PagedCacheConfig, "compilation": CompilationSettings}

    def kv_bytes_per_token(self) -> int:
        """One token's K and V in the cache's format (`kv_cache_dtype`)."""
        cfg = self.model_config
        return kv_bytes_per_token(cfg, self.dtype, head_bytes=self.config.cache.kv_head_bytes(cfg.head_dim))

    def _init_kv_cache(self) -> None:
        bs = self.config.cache.block_size
        self.num_blocks = num_blocks_for_budget(self.kv_budget, bs, self.bytes_per_token)
        self.worker = Worker(self.loaded.model, self.num_blocks, bs, self.config.cache.attention_backend,
                             self.config.model.batch_invariant, compilation_for(self.config),
                             **self.config.cache.worker_kwargs())  # fmt: skip
        self.blocks = BlockTables(self.num_blocks, bs)
        self.cached: dict[int, int] = {}  # seq_id -> tokens whose k/v are in its blocks

    def check_fits(self, seq: Sequence, i: int) -> None:
        check_fits_in_pool(seq, i, self.num_blocks, self.config.cache.block_size)

    def _admit_one(self, seq: Sequence) -> bool:
        """Admit if the pool holds the request's tokens *now* (its prefill)."""
        if self.blocks.missing_blocks(seq.seq_id, seq.num_tokens) > self.blocks.allocator.num_free:
            return False
        self.blocks.grow(seq.seq_id, seq.num_tokens)
        self.cached[seq.seq_id] = 0
        return True

    def _make_room(self, running: list[Sequence], chunks: list[Chunk]) -> tuple[list[Sequence], list[Chunk]]:
        # Every sequence needs room for its new tokens; evict the youngest until all fit.
        while True:
            short = sum(
                self.blocks.missing_blocks(s.seq_id, pos + len(toks)) for s, (toks, pos) in zip(running, chunks)
            )
            if short <= self.blocks.allocator.num_free:
                break
            victim = running.pop()  # the last admitted
            chunks = chunks[: len(running)]
            self._evict(victim)
        for s, (toks, pos) in zip(running, chunks):
            self.blocks.grow(s.seq_id, pos + len(toks))
            self.cached[s.seq_id] = pos + len(toks)
        return running, chunks

    def _execute(self, running: list[Sequence], chunks: list[Chunk]) -> torch.Tensor:
        tables = [self.blocks.tables[s.seq_id] for s in running]
        return self.worker.execute(ModelInput.build(chunks, tables, self.config.cache.block_size,
                                                    self.num_logits(running, chunks)))  # fmt: skip

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

    def kv_usage(self) -> tuple[int, int]:
        reserved = self.blocks.allocator.num_used * self.config.cache.block_size
        return reserved * self.bytes_per_token, sum(self.cached.values()) * self.bytes_per_token


class LLM(NaiveLLM):
    """Level 0's front end over the paged engine."""

    engine_class = PagedEngine
