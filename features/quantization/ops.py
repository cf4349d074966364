"""`QuantizedOps`: level 0's ops seam with a `linear` that reads a quantized weight.

What it is: a wrapper over whatever ops the model computes with (ops.py's, or the CPU kernels'): a
linear whose weight is an `Int8Weight` or `Int4Weight` (formats.py) runs that weight's matmul, on
its packed kernel or its reference (`use_kernel`); every other op, and every float weight (the LM
head's), goes to the wrapped ops unchanged. (Level 4's draft model keeps the engine's plain ops.)

What it is not: a place that quantizes (install.py does, once, at load).

Reference: vLLM `LinearMethodBase.apply(layer, x, bias)`, the per-layer seam a quantization method plugs into.
"""

from __future__ import annotations

import torch

from .formats import Int4Weight, Int8Weight


class QuantizedOps:
    def __init__(self, base, use_kernel: bool = True):
        self.base, self.use_kernel = base, use_kernel

    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in], weight a quantized [out, in] (or a float one: the wrapped ops'), bias [out] -> [..., out]."""
        if not isinstance(weight, (Int8Weight, Int4Weight)):
            return self.base.linear(x, weight, bias)
        y = weight.matmul(x.reshape(-1, x.shape[-1]), self.use_kernel).reshape(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias

    def __getattr__(self, name: str):  # rms_norm, rope, silu_mul, ...: the wrapped ops'
        return getattr(self.base, name)


__all__ = ["QuantizedOps"]
