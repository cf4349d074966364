# Lab 1: your copy of level1_paged/worker.py.
# Fill in every function that raises NotImplementedError (search for TODO), then run
#     python -m labs check 1 THIS_FILE
# Made by `python -m labs starters` from the reference; everything else is the reference, unchanged.
"""The step input and the worker: what one forward over the paged cache needs, and who runs it.

What it is: `ModelInput`, level 0's `FlatBatch` plus vLLM's paged-attention metadata,
built once per step by `ModelInput.build` (the one place where a token's position
becomes a cache slot), and `Worker`, which has level 0's `ModelRunner` (vLLM's split: a
worker has a model runner) and owns the paged KV cache, the attention implementation
and its scale, and runs one `ModelInput`:

    scheduled: A prefill 5 tokens from 0, table [3, 2]   B decode at 7, table [0, 1]   (block_size 4)
    input_ids        [ a0 a1 a2 a3 a4 | b7 ]
    positions        [  0  1  2  3  4 |  7 ]
    query_start_loc  [ 0, 5, 6 ]          seq_lens [ 5, 8 ]
    block_tables     [[3, 2], [0, 1]]     (a shorter table is padded with 0: never read past seq_len)
    slot_mapping     [12 13 14 15 8 | 7]  slot = table[pos // bs] * bs + pos % bs
                                          (A's position 4 is in its second block, 2: the engine
                                           grows a table before the step that needs it)
    logits_indices   [ 4, 5 ]

A `ModelInput` is plain CPU tensors with no reference to any request, scheduler or
cache: it can be pickled and broadcast to other ranks (level 5), and two workers can
run the same one (level 4's target and draft share block tables and slots).

What it is not: a scheduler or a sampler. Which tokens run is decided before; what to
do with the logits, after.

Reference: vLLM V1 `gpu_model_runner.py` (`_prepare_inputs`, `slot_mapping`) and
`v1/worker/gpu_worker.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from level0_naive.model import Transformer
from level0_naive.worker import Chunk, FlatBatch, ModelRunner

from .paged_cache import PagedAttention, PagedKVCache, attention_impl


@dataclass
class ModelInput(FlatBatch):
    seq_lens: torch.Tensor  # [B] int32: context including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V goes
    block_copies: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 2, dtype=torch.long))
    # [C, 2] long (src, dst): blocks to copy before this step writes (level 3's copy-on-write; empty below)

    @classmethod
    def build(cls, chunks: list[Chunk], tables: list[list[int]], block_size: int, num_logits: list[int],
              block_copies: list[tuple[int, int]] = ()) -> ModelInput:  # fmt: skip
        """chunks[i] = (new tokens of sequence i, position of the first); tables[i] its blocks,
        covering at least those positions; num_logits[i] how many of its last rows to sample;
        block_copies the (src, dst) block pairs to copy first (a forked sequence's shared block)."""
        # TODO (lab 1): ModelInput.build
        # The step's flattened batch with vLLM's paged metadata (read the picture in this file's docstring):
        #   FlatBatch.geometry(chunks, num_logits) gives input_ids, positions, query_start_loc, logits_indices;
        #   seq_lens [B] int32: each sequence's context including this step's tokens (start + len(toks));
        #   block_tables [B, max_blocks] int32: each table padded with 0 to the longest (never read past seq_len);
        #   slot_mapping [T] long: for every new token at position p of a sequence with table t,
        #       slot = t[p // block_size] * block_size + p % block_size
        #   block_copies [C, 2] long: the (src, dst) pairs given, as they are (level 3's copy-on-write; usually none);
        # Return cls(**geometry, seq_lens=..., block_tables=..., slot_mapping=..., block_copies=...).
        raise NotImplementedError("lab 1: write ModelInput.build")


class Worker:
    """Has a model runner (the model's forward, logits where asked), and owns the paged KV
    cache, the attention implementation and scale: what one device needs for a step."""

    def __init__(self, model: Transformer, num_blocks: int, block_size: int, attention_backend: str = "auto",
                 batch_invariant: bool = False):  # fmt: skip
        self.runner = ModelRunner(model)
        self.model, self.device = model, self.runner.device
        cfg = model.config
        self.block_size = block_size
        self.cache = PagedKVCache(cfg, num_blocks, block_size, next(model.parameters()).dtype, self.device)
        self.impl = attention_impl(attention_backend, self.device, batch_invariant)
        self.scale = cfg.head_dim**-0.5
        self._uncollected: list[torch.Tensor] = []  # logits of submits not yet collected, oldest first
        self._num_submitted = 0

    @torch.inference_mode()
    def execute(self, model_input: ModelInput) -> torch.Tensor:
        """One forward: write this step's K/V into the cache, attend -> logits [S, V]."""
        mi = model_input.to(self.device)
        return self.runner.forward(mi, PagedAttention(self.cache, mi, self.impl, self.scale))

    # --- the Executor Protocol (level1_paged/executor.py): one process, nothing runs behind your back ---
    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    def submit(self, model_input: ModelInput) -> int:
        """Run the forward now (one process has nothing to overlap it with); `collect` returns its logits."""
        self._uncollected.append(self.execute(model_input))
        self._num_submitted += 1
        return self._num_submitted - 1

    def collect(self) -> torch.Tensor:
        """The logits [S, V] of the oldest `submit` not yet collected."""
        if not self._uncollected:
            raise RuntimeError("collect() without a submit() in flight")
        return self._uncollected.pop(0)

    def collective_rpc(self, method: str, *args) -> list:
        """`method(*args)` of this worker, the only rank: [its answer]."""
        return [getattr(self, method)(*args)]

    def kv_cache_bytes(self) -> int:
        """Bytes of this worker's K and V blocks (a harmless question for `collective_rpc`)."""
        return sum(t.numel() * t.element_size() for t in self.cache.k + self.cache.v)

    def check_health(self) -> None:
        """Nothing to check: the model runs in this process."""

    def shutdown(self) -> None:
        """Nothing to stop: no other process, no process group."""
