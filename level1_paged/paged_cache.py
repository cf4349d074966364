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
described by vLLM's metadata (`query_start_loc [B+1]`, `seq_lens [B]`,
`block_tables [B, max_blocks]`, `slot_mapping [T]`), which `worker.ModelInput` builds.

What it is not: a scheduler. `BlockTables` grows and frees tables when told to; who
runs, and who is preempted when blocks run out, is the engine's (level 1) or the
scheduler's (level 2) decision.

Reference: Kwon et al., SOSP 2023, section 4.1-4.3; vLLM V1 `v1/core/kv_cache_manager.py`
and `v1/attention/backends/`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ladder import rooms
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


def blocks_in_budget(kv_budget: int, block_size: int, bytes_per_token: int) -> int:
    """How many whole blocks a KV budget in bytes holds (maybe 0)."""
    return kv_budget // (block_size * bytes_per_token)


def num_blocks_for_budget(kv_budget: int, block_size: int, bytes_per_token: int) -> int:
    """How many whole blocks a KV budget in bytes holds (at least one, or a ValueError)."""
    num_blocks = blocks_in_budget(kv_budget, block_size, bytes_per_token)
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory={kv_budget} bytes holds no block of {block_size} tokens "
            f"({block_size * bytes_per_token} bytes)"
        )
    return num_blocks


def check_fits_in_pool(seq, i: int, num_blocks: int, block_size: int) -> None:
    """ValueError, up front, for prompt i if even alone it may need more blocks than the pool has."""
    need = blocks_for(seq.max_total_tokens, block_size)
    if need > num_blocks:
        raise ValueError(
            f"prompt {i} may need {need} KV blocks (prompt + max_tokens = {seq.max_total_tokens} tokens) "
            f"but the pool has {num_blocks}"
        )


class BlockTables:
    """Which physical blocks each sequence owns, in logical order."""

    def __init__(self, num_blocks: int, block_size: int):
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.tables: dict[int, list[int]] = {}  # seq_id -> physical block ids

    def missing_blocks(self, seq_id: int, num_tokens: int) -> int:
        """How many more blocks `seq_id` needs to hold `num_tokens` tokens."""
        return max(blocks_for(num_tokens, self.block_size) - len(self.tables.get(seq_id, [])), 0)

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


class AttentionImpl(NamedTuple):
    """One attention backend's two functions (attention_ref.py, triton_attention.py)."""

    write_kv: Callable  # (k [T, Hkv, D], v, k_cache [N, bs, Hkv, D], v_cache, slot_mapping [T]) -> None
    attend: Callable  # (q [T, Hq, D], k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale) -> [T, Hq, D]


def attention_impl(name: str, device: torch.device, batch_invariant: bool = False) -> AttentionImpl:
    """'auto' | 'cpu' | 'torch' | 'triton' | 'ref' -> the backend's functions.

    'auto' is the Triton kernel on CUDA; on a CPU, and for 'cpu' or `batch_invariant`, the
    compiled CPU kernel is a room's (ladder/rooms.py), and 'auto' falls back to the torch
    backend where it cannot be built."""
    from .attention_ref import paged_attention_ref, paged_attention_torch, write_kv_cache

    if batch_invariant or name == "cpu" or (name == "auto" and device.type == "cpu"):
        found = rooms.attention(name, device, batch_invariant)  # (write_kv, attend), or None
        if found is not None:
            return AttentionImpl(*found)
        name = "torch"
    if name == "auto":
        name = "triton"  # on CUDA
    if name == "torch":
        return AttentionImpl(write_kv_cache, paged_attention_torch)
    if name == "ref":
        return AttentionImpl(write_kv_cache, paged_attention_ref)
    if name == "triton":
        from .triton_attention import paged_attention_triton, write_kv_cache_triton

        return AttentionImpl(write_kv_cache_triton, paged_attention_triton)
    raise ValueError(f"attention_backend={name!r} is not one of: auto, cpu, torch, triton, ref")


class PagedAttention:
    """The attention backend for one forward: write new k/v to their slots, attend through tables.

    `meta` is the step's `ModelInput` (`worker.py`): query_start_loc, seq_lens,
    block_tables, slot_mapping, already on the cache's device, and block_copies: pairs
    (src, dst) copied in each layer before anything is written (level 3's copy-on-write,
    the PagedAttention paper's fork; empty below level 3). Copying layer by layer here
    means a pipeline stage copies exactly the layers it holds.
    """

    def __init__(self, cache: PagedKVCache, meta, impl: AttentionImpl, scale: float):
        self.cache, self.meta, self.scale = cache, meta, scale
        self.write_kv, self.attend = impl.write_kv, impl.attend

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        m = self.meta
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]  # [N, bs, Hkv, D]
        if m.block_copies.numel():  # copy-on-write (level 3): a forked sequence's own copy of a shared block
            src, dst = m.block_copies[:, 0], m.block_copies[:, 1]  # [C] each; all read before any is written
            k_cache[dst], v_cache[dst] = k_cache[src], v_cache[src]
        self.write_kv(k, v, k_cache, v_cache, m.slot_mapping)
        return self.attend(q, k_cache, v_cache, m.query_start_loc, m.seq_lens, m.block_tables, self.scale)  # [T, Hq, D]


__all__ = [
    "blocks_for",
    "num_blocks_for_budget",
    "blocks_in_budget",
    "check_fits_in_pool",
    "PagedKVCache",
    "BlockTables",
    "PagedAttention",
    "OutOfBlocks",
    "attention_impl",
    "AttentionImpl",
]
