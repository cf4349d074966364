"""Which attention backend runs a step: the names `attention_backend=` takes, and the two functions each one is.

What it is: `attention_impl(name, device)`, the choice, and `AttentionImpl`, what a backend is
to the paged cache: the write of a step's new K/V into their slots and the attention over the
cache, two functions with the contracts of kv_cache.py's `write_kv_cache` and attention_ref.py's
`paged_attention_ref`:

    "torch"    write_kv_cache (kv_cache.py)          paged_attention_torch (attention_ref.py): plain torch
    "ref"      write_kv_cache                         paged_attention_ref: the oracle, one sequence at a time
    "triton"   write_kv_cache_triton                  paged_attention_triton (triton_attention.py): the kernel
    "auto"     "triton" on CUDA; on a CPU, "torch" unless a room answers

On a CPU ("auto", "cpu") and for `batch_invariant=True` the registry (ladder/rooms.py) answers with a
room's compiled kernel, and "auto" falls back to "torch" where it cannot be built.

A backend may also `plan` (FlashInfer's plan and run; vLLM builds a step's attention metadata once,
for all layers): `plan(cache, meta, scale)`, made once a step, works out what the step's layers share
(checked metadata, the kernel's arguments), and called as `plan(layer, q, k, v)` must give what write
then attend give; a plan that is false (the step needs the two functions after all) is not used. The
CPU room's does (`StepPlan`: a decode step of the built-in model spends less in Python between its graphs).

What it is not: a backend (the files named above are), or the attention backend object the model
calls per layer (kv_cache.py's `PagedAttention`, which calls these two functions).

Reference: vLLM `vllm/attention/selector.py` (`get_attn_backend`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ladder import rooms

from .kv_cache import write_kv_cache


class AttentionImpl(NamedTuple):
    """One attention backend's two functions (and, if it has one, its plan: see the module docstring)."""

    write_kv: Callable  # (k [T, Hkv, D], v, k_cache [N, bs, Hkv, D], v_cache, slot_mapping [T]) -> None
    attend: Callable  # (q [T, Hq, D], k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale) -> [T, Hq, D]
    plan: Callable | None = None  # (cache, meta, scale) -> plan; plan(layer, q, k, v) -> [T, Hq, D]; false: unused


def attention_impl(name: str, device: torch.device, batch_invariant: bool = False) -> AttentionImpl:
    """'auto' | 'cpu' | 'torch' | 'triton' | 'ref' -> the backend's functions (the module docstring says which)."""
    from .attention_ref import paged_attention_ref, paged_attention_torch  # (a kernel module is imported when chosen)

    if batch_invariant or name == "cpu" or (name == "auto" and device.type == "cpu"):
        found = rooms.attention(name, device, batch_invariant)  # (write_kv, attend[, plan]), or None
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


__all__ = ["AttentionImpl", "attention_impl"]
