"""The attention of `batch_invariant=True`: the compiled CPU kernel for every query, one order of additions.

What it is: `invariant_attention`, what level 1's attention backend becomes under the mode:
`features/cpu_kernels`' paged-attention kernel (`kernel`), which adds every sum of a row in
a fixed order whatever else is in the batch, for *every* query. The default CPU backend
(`paged_attention_cpu`) sends a long chunk over a longer context to SDPA instead, whose
blocked matmuls add in an order chosen by the shapes: fast, but not invariant.

What it is not: a GPU kernel (vLLM's VLLM_BATCH_INVARIANT=1 has Triton ones), or a new one:
the same C++ as the default path, called without the routing.

Reference: vLLM `model_executor/layers/batch_invariant.py` (fixed-order attention under VLLM_BATCH_INVARIANT=1).
"""

from __future__ import annotations

import torch

from features.cpu_kernels import attention as cpu_attention


def invariant_attention(name: str, device: torch.device):
    """`attention_backend` ("auto" or "cpu") under the mode -> (write_kv, attend), or a ValueError saying why not."""
    if name not in ("auto", "cpu") or device.type != "cpu":
        raise ValueError(
            f"batch_invariant=True attends with the compiled CPU kernel (attention_backend 'auto' or 'cpu' on a "
            f"CPU), not attention_backend={name!r} on {device.type}"
        )
    cpu_attention.LIBRARY.require("batch_invariant=True")
    return cpu_attention.write_kv_cpu, cpu_attention.kernel


__all__ = ["invariant_attention"]
