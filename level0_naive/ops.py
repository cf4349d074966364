"""The ops seam: the model's matmuls and norms, behind one small object.

What it is: `Ops`, the two computations of `model.py` whose result depends on the order
of a reduction: `linear` (each output is a sum over the input features) and `rms_norm`
(a mean over the hidden features). Every linear layer (q, k, v, o, gate, up, down, the LM
head) and every RMSNorm calls `self.ops.linear` / `self.ops.rms_norm`, and so do level
5's sharded linears; `Transformer.set_ops(ops)` hands one object to all of them. As
attention goes through the backend the engine passes in, these go through this seam, so
a level can swap other kernels in (fixed reduction order for batch invariance, a CPU
fast path) by subclassing `Ops`, without touching `model.py`:

    class Float64Ops(Ops):
        def linear(self, x, weight, bias=None):
            return super().linear(x.double(), weight.double(), None if bias is None else bias.double()).to(x.dtype)

    model.set_ops(Float64Ops())

`DEFAULT_OPS` is exactly what the model computed before the seam existed (the same torch
calls), so its outputs are bit for bit the same.

What it is not: a kernel library, a dispatcher on device or dtype, or a home for
elementwise ops (SiLU, RoPE, the residual adds: their results do not depend on what else
is in the batch) or for attention (the backend's job). The weights stay in the modules,
under their checkpoint names; an op receives them as arguments.

Reference: vLLM's `LinearMethodBase.apply(layer, x, bias)` (`model_executor/layers/linear.py`),
the per-layer seam quantisation plugs into; Thinking Machines, "Defeating Nondeterminism in
LLM Inference" (2025), on why matmul and RMSNorm are the kernels to make batch-invariant.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Ops:
    """The default ops: PyTorch's own, bit for bit what `nn.Linear` and HF's RMSNorm compute."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in], weight [out, in], bias [out] or None -> [..., out]."""
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [..., dim], weight [dim] -> [..., dim]: x / rms(x) over the last dimension, times weight."""
        # Normalise in float32, then cast back, exactly as Hugging Face does. Even a
        # float64 model normalises in float32 there, and matching the oracle's
        # rounding is what lets our float64 tests demand identical greedy tokens.
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(dtype)


DEFAULT_OPS = Ops()

__all__ = ["Ops", "DEFAULT_OPS"]
