"""Level 0's KV cache: one contiguous slab per request, reserved for its maximum length.

What it is: the way pre-vLLM systems (FasterTransformer, Orca, HF `generate`) hold the cache.
An admitted request reserves `prompt + max_tokens` token slots (capped at `max_model_len`) of a
fixed KV memory budget, used or not; the slab is returned only when the whole static batch ends.

    slab of request A (reserved 12 slots, 5 used so far):
    [ k0 k1 k2 k3 k4 .  .  .  .  .  .  . ]   <- 7 reserved, unused: waste
    slab of request B (finished after 3, held until the batch ends):
    [ k0 k1 k2 .  .  .  .  . ]

`SlabAttention` is the attention backend the model calls: per sequence, write the new
k/v into the slab and attend over the slab's filled prefix with a causal mask.

What it is not: efficient. It loops over sequences in Python. Level 1 replaces this file's
idea with a pool of blocks and one kernel for the whole flattened batch.

Reference: Kwon et al., "Efficient Memory Management for LLM Serving with PagedAttention"
(SOSP 2023), section 2.3 / figure 3 (reservation, internal and external fragmentation).
"""

from __future__ import annotations

import torch

from .model import ModelConfig


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, num_layers: int | None = None,
                       num_kv_heads: int | None = None, head_bytes: int | None = None) -> int:  # fmt: skip
    """K and V, every layer, every KV head (or the `num_layers`, `num_kv_heads` given): one cached token's bytes.
    `head_bytes`: what one head's slot takes where the cache is not `dtype` (level 1's 8-bit formats)."""
    layers = cfg.num_layers if num_layers is None else num_layers
    heads = cfg.num_kv_heads if num_kv_heads is None else num_kv_heads
    per_head = cfg.head_dim * torch.empty(0, dtype=dtype).element_size() if head_bytes is None else head_bytes
    return 2 * layers * heads * per_head


class Slab:
    """One request's contiguous cache: k, v [num_layers, reserved, Hkv, D]."""

    def __init__(self, cfg: ModelConfig, reserved: int, dtype: torch.dtype, device):
        shape = (cfg.num_layers, reserved, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)  # [L, reserved, Hkv, D]
        self.v = torch.empty(shape, dtype=dtype, device=device)  # [L, reserved, Hkv, D]
        self.reserved = reserved
        self.used = 0  # tokens whose k/v are stored (all layers)
        self.finished = False  # its request is done: the slab is held, but holds nothing useful


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int) -> torch.Tensor:
    """Dense attention of new queries over a contiguous context: the plainest correct version.

    q [n, Hq, D] are positions context_len .. context_len+n-1; k, v [context_len+n, Hkv, D].
    Query i sees keys 0 .. context_len+i (causal, offset by what was cached before). Returns [n, Hq, D]."""
    n, Hq, D = q.shape
    S, Hkv = k.shape[0], k.shape[1]
    k = k.repeat_interleave(Hq // Hkv, dim=1)  # [S, Hq, D]  (GQA: each KV head serves Hq/Hkv query heads)
    v = v.repeat_interleave(Hq // Hkv, dim=1)  # [S, Hq, D]
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("nhd,shd->hns", q.to(acc), k.to(acc)) * D**-0.5  # [Hq, n, S]
    q_pos = torch.arange(n, device=q.device)[:, None] + context_len  # [n, 1]
    k_pos = torch.arange(S, device=q.device)[None, :]  # [1, S]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [Hq, n, S]
    return torch.einsum("hns,shd->nhd", probs, v.to(acc)).to(q.dtype)  # [n, Hq, D]


class SlabAttention:
    """The attention backend for one forward over a flattened batch of slab-backed sequences.

    Sequence i owns query rows query_start_loc[i]:query_start_loc[i+1] of q/k/v, and
    those tokens go to slab positions slab.used .. slab.used + n - 1."""

    def __init__(self, slabs: list[Slab], query_start_loc: torch.Tensor):
        self.slabs = slabs
        qsl = query_start_loc.tolist()  # [B+1], read once per forward, not once per layer
        self.spans = list(zip(qsl[:-1], qsl[1:]))

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)  # [T, Hq, D]
        for slab, (s, e) in zip(self.slabs, self.spans):
            ctx, n = slab.used, e - s
            slab.k[layer, ctx : ctx + n] = k[s:e]
            slab.v[layer, ctx : ctx + n] = v[s:e]
            out[s:e] = causal_attention(q[s:e], slab.k[layer, : ctx + n], slab.v[layer, : ctx + n], ctx)
        return out

    def commit(self) -> None:
        """After the forward: the new tokens are now part of every slab's context."""
        for slab, (s, e) in zip(self.slabs, self.spans):
            slab.used += e - s
