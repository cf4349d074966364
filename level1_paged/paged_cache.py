"""The paged KV cache: a pool of blocks, per-sequence block tables, and the batch metadata.

What it is: PagedAttention's memory layout. One K and one V tensor per layer, shaped
`[num_blocks, block_size, num_kv_heads, head_dim]`, sized once from the KV budget. A
sequence's tokens live in whatever blocks it was given, in order, named by its block
table; a new block is taken only when the last one is full:

    sequence 7, 37 tokens, block_size 16          physical K cache of one layer
    logical block:   0    1    2                  block 0 [ ................ ]
    block table:   [ 5 ,  2 ,  9 ]   ------->     block 2 [ tokens 16..31    ]
    tokens:        0-15 16-31 32-36 (11 free)     block 5 [ tokens 0..15     ]
                                                  block 9 [ 32..36 | 11 empty ]

Only the tail of the last block can be wasted: fewer than `block_size` slots per
sequence, versus a whole `max_tokens` reservation at level 0.

`PagedAttention` is the attention backend the model calls for one flattened batch,
described by vLLM's metadata: `query_start_loc [B+1]`, `seq_lens [B]`,
`block_tables [B, max_blocks]`, `slot_mapping [T]`.

What it is not: a scheduler. `BlockTables` grows and frees tables when told to; who
runs, and who is preempted when blocks run out, is the engine's (level 1) or the
scheduler's (level 2) decision.

Reference: Kwon et al., SOSP 2023, section 4.1-4.3; vLLM V1 `v1/core/kv_cache_manager.py`
and `v1/attention/backends/`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from level0_naive.model import ModelConfig

from .block_allocator import BlockAllocator, OutOfBlocks


class PagedKVCache:
    """The physical memory: per layer, k and v of [num_blocks, block_size, Hkv, D]."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device):
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold num_tokens tokens (ceil division)."""
    return -(-num_tokens // block_size)


class BlockTables:
    """Which physical blocks each sequence owns, in logical order."""

    def __init__(self, num_blocks: int, block_size: int):
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.tables: dict[int, list[int]] = {}  # seq_id -> physical block ids

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def missing_blocks(self, seq_id: int, num_tokens: int) -> int:
        """How many more blocks `seq_id` needs to hold `num_tokens` tokens."""
        return max(self.blocks_for(num_tokens) - len(self.tables.get(seq_id, [])), 0)

    def grow(self, seq_id: int, num_tokens: int) -> None:
        """Make the table cover `num_tokens` tokens; all or nothing (raises OutOfBlocks)."""
        need = self.missing_blocks(seq_id, num_tokens)
        if need > self.allocator.num_free:
            raise OutOfBlocks(f"sequence {seq_id} needs {need} blocks, {self.allocator.num_free} free")
        table = self.tables.setdefault(seq_id, [])
        table.extend(self.allocator.allocate() for _ in range(need))

    def free(self, seq_id: int) -> None:
        for block in reversed(self.tables.pop(seq_id, [])):
            self.allocator.free(block)

    def slots(self, seq_id: int, start: int, n: int) -> list[int]:
        """Flat slot (block * block_size + offset) of token positions start .. start+n-1."""
        table, bs = self.tables[seq_id], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, start + n)]


@dataclass
class PagedMetadata:
    """vLLM's names, one flattened batch of B sequences and T new tokens.

        query_start_loc  [0, 5, 6, 9]      seq i's queries are rows qsl[i]:qsl[i+1]
        seq_lens         [5, 8, 5]         context + new tokens, per sequence
        block_tables     [[3, -], [0, 1], [2, -]]   padded with 0 (never read)
        slot_mapping     [48..52, 119, 34..36]      where each new token's k/v goes
    """

    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64

    @classmethod
    def build(cls, tables: list[list[int]], starts: list[int], query_lens: list[int], slots: list[int], device) -> PagedMetadata:
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return cls(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor([s + n for s, n in zip(starts, query_lens)], dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        )


def attention_impl(name: str, device: torch.device):
    """'auto' | 'torch' | 'triton' | 'ref' -> (write_kv, attend) functions."""
    from .attention_ref import paged_attention_ref, paged_attention_torch, write_kv_cache

    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return write_kv_cache, paged_attention_torch
    if name == "ref":
        return write_kv_cache, paged_attention_ref
    if name == "triton":
        from .triton_attention import paged_attention_triton, write_kv_cache_triton

        return write_kv_cache_triton, paged_attention_triton
    raise ValueError(f"attention_backend={name!r} is not one of: auto, torch, triton, ref")


class PagedAttention:
    """The attention backend for one forward: write new k/v to their slots, attend through tables."""

    def __init__(self, cache: PagedKVCache, meta: PagedMetadata, impl, scale: float):
        self.cache, self.meta, self.scale = cache, meta, scale
        self.write_kv, self.attend = impl

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        m = self.meta
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]  # [N, bs, Hkv, D]
        self.write_kv(k, v, k_cache, v_cache, m.slot_mapping)
        return self.attend(q, k_cache, v_cache, m.query_start_loc, m.seq_lens, m.block_tables, self.scale)  # [T, Hq, D]

    def commit(self) -> None:
        """Nothing to do: the block tables already say where everything is."""


__all__ = ["blocks_for", "PagedKVCache", "BlockTables", "PagedMetadata", "PagedAttention", "OutOfBlocks", "attention_impl"]
