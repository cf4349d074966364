"""The step input: one flattened batch plus vLLM's paged-attention metadata, built once per step.

What it is: `ModelInput`, level 0's `FlatBatch` plus what attention over the paged cache
needs, built by `ModelInput.build` from each running sequence's new tokens and its block
table:

    batch: A prefill 5 tokens from 0, table [3, 2]   B decode at 7, table [0, 1]   (block_size 4)
    input_ids        [ a0 a1 a2 a3 a4 | b7 ]
    positions        [  0  1  2  3  4 |  7 ]
    query_start_loc  [ 0, 5, 6 ]          seq_lens [ 5, 8 ]
    block_tables     [[3, 2], [0, 1]]     (a shorter table is padded with 0: never read past seq_len)
    slot_mapping     [12 13 14 15 8 | 7]  slot = table[pos // bs] * bs + pos % bs (slot_mapping.py)
                                          (A's position 4 is in its second block, 2: the engine
                                           grows a table before the step that needs it)
    logits_indices   [ 4, 5 ]

A `ModelInput` is plain CPU tensors with no reference to any request, engine or cache: it can
be pickled and sent to another process, and two workers can run the same one. It also names
the attention backend that runs it (`attention_backend`): level 1's `PagedAttention`, or a
subclass's whose input carries more for the backend to do. Level 3's input adds blocks to copy
before the write, level 4's target and draft run the same input, and level 5 broadcasts it to
its ranks.

What it is not: a batching policy or a worker. Which tokens run is decided before; who runs them, after.

Reference: vLLM V1 `gpu_model_runner.py` (`_prepare_inputs`) and `v1/attention/backends/utils.py`
(`CommonAttentionMetadata`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from level0_naive.model_runner import Chunk, FlatBatch

from .attention_backend import AttentionImpl
from .kv_cache import PagedAttention, PagedKVCache
from .slot_mapping import slot_mapping


@dataclass
class ModelInput(FlatBatch):
    seq_lens: torch.Tensor  # [B] int32: context including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V goes

    @classmethod
    def build(cls, chunks: list[Chunk], tables: list[list[int]], block_size: int, num_logits: list[int]) -> ModelInput:
        """chunks[i] = (new tokens of sequence i, position of the first); tables[i] its blocks,
        covering at least those positions; num_logits[i] how many of its last rows to sample."""
        width = max(len(t) for t in tables)
        # Normal tensors even inside an engine step's inference mode: a normal tensor's version moves when it
        # is written in place, so a backend that checks the metadata once for all of a step's layers (the CPU
        # kernel's) can tell it was not; an inference tensor has no version, and would be checked every layer
        with torch.inference_mode(False):
            return cls(
                **FlatBatch.geometry(chunks, num_logits),
                seq_lens=torch.tensor([start + len(toks) for toks, start in chunks], dtype=torch.int32),  # [B]
                block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),  # [B, W]
                slot_mapping=torch.tensor(slot_mapping(chunks, tables, block_size), dtype=torch.long),  # [T]
            )

    def attention_backend(self, cache: PagedKVCache, impl: AttentionImpl, scale: float) -> PagedAttention:
        """The backend that runs this input over `cache` (this input already on the cache's device)."""
        return PagedAttention(cache, self, impl, scale)


__all__ = ["ModelInput"]
