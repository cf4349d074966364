"""The paged KV cache: its memory, where each new token's K and V are written, and the attention over it.

What it is: PagedAttention's memory layout. One K and one V tensor per layer, shaped
`[num_blocks, block_size, num_kv_heads, head_dim]`, sized once from the KV budget
(`PagedKVCache`), and the attention backend the model calls for one flattened batch
(`PagedAttention`), which does two things per layer:

    write   the step's new k, v [T, Hkv, D] into their slots: slot = block * block_size + offset,
            the step's `slot_mapping [T]` (slot_mapping.py), one indexed copy (`write_kv_cache`)
    attend  every query over its sequence's cached keys and values, through `block_tables`
            (attention_ref.py: the plain-torch oracle and CPU backend; triton_attention.py: the kernel)

    k_cache of one layer, viewed as one long row of slots (block_size 4):
    slot   0  1  2  3 | 4  5  6  7 | 8  9 10 11 | ...
    block      0      |     1      |     2      |
    write k[i] to slot_mapping[i]:   [ .. .. k0 k1 | .. .. .. .. | k2 .. .. .. ]

Which two functions (write and attend) a backend uses is `attention_backend.py`'s choice.

What it is not: a block allocator or a block table (`block_table.py`), or a batching policy.

Reference: Kwon et al., SOSP 2023, section 4.1; vLLM V1 `v1/attention/backends/`
(`reshape_and_cache`: the cache write, `forward`: the attention).
"""

from __future__ import annotations

import torch

from level0_naive.model import ModelConfig


class PagedKVCache:
    """The physical memory: per layer, k and v of [num_blocks, block_size, Hkv, D]; in an 8-bit format
    (`kv_format`: kv_cache_dtype="fp8" or "int8", a room's), bytes: [num_blocks, block_size, Hkv, head_bytes]."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device, kv_format=None):
        width = cfg.head_dim if kv_format is None else kv_format.head_bytes(cfg.head_dim)
        dtype = dtype if kv_format is None else torch.uint8
        shape = (num_blocks, block_size, cfg.num_kv_heads, width)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.num_blocks, self.block_size, self.kv_format = num_blocks, block_size, kv_format


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write the new tokens' keys and values into their cache slots, in place.

    k, v: [T, Hkv, D]; k_cache, v_cache: [N, bs, Hkv, D] (contiguous, same dtype
    as k and v); slot_mapping: [T] int64 with every entry in [0, N * bs).
    Only the T named slots change. There is no "-1 means skip" convention
    (vLLM uses one for padded CUDA-graph tokens): a negative slot would wrap
    around in torch indexing, so the caller must not produce one.
    """
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    # A slot is (block, offset) flattened; viewing the cache as one long row of
    # slots turns the scatter into a single indexed copy.
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slot_mapping] = k  # [N*bs, Hkv, D]
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slot_mapping] = v  # [N*bs, Hkv, D]


class PagedAttention:
    """The attention backend for one forward: write new k/v to their slots, attend through tables.

    `meta` is the step's `ModelInput` (model_input.py): query_start_loc, seq_lens, block_tables and
    slot_mapping, already on the cache's device. The same object serves every layer; a level
    whose steps need more around the write overrides `__call__` (level 3: copy-on-write copies)."""

    def __init__(self, cache: PagedKVCache, meta, impl, scale: float):
        """`impl`: the backend's (write_kv, attend) functions (attention_backend.py's AttentionImpl), and its plan,
        if it has one: then the step's layers run what the plan returns (the same result, worked out once)."""
        self.cache, self.meta, self.scale = cache, meta, scale
        self.write_kv, self.attend = impl.write_kv, impl.attend
        self.run = impl.plan(cache, meta, scale) if impl.plan is not None else None
        self.run = self.run or None  # (a plan that is false: this step needs the two functions)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.run is not None:
            return self.run(layer, q, k, v)
        m = self.meta
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]  # [N, bs, Hkv, D]
        self.write_kv(k, v, k_cache, v_cache, m.slot_mapping)  # the new tokens' K/V, into their slots
        return self.attend(q, k_cache, v_cache, m.query_start_loc, m.seq_lens, m.block_tables, self.scale)  # [T, Hq, D]


__all__ = ["PagedKVCache", "PagedAttention", "write_kv_cache"]
