"""The ops seam: the model's matmuls, norms and rotary embedding, behind one small object.

What it is: `Ops`, the computations of `model.py` another kernel may want to do differently:
the two whose result depends on the order of a reduction, `linear` (a sum over the input
features) and `rms_norm` (a mean over the hidden features); `rope`, the rotary embedding of q
and k, which PyTorch spends ten small ops on; and `silu_mul`, SwiGLU's silu(gate) * up, which
PyTorch computes with one function for most elements of a tensor and another for its last few
(docs/batch_invariance.md). Every linear layer (q, k, v, o, gate, up, down, the LM head),
RMSNorm, RoPE and MLP activation calls `self.ops.<op>`, and so do level 5's sharded layers;
`Transformer.set_ops(ops)` hands one object to all of them. As attention goes through the
engine's backend, these go through this seam: other kernels swap in by subclassing `Ops`,
without touching `model.py` (the rooms' compiled CPU and fixed-order kernels do; ladder/rooms.py
maps `ops=` to them):

    class Float64Ops(Ops):
        def linear(self, x, weight, bias=None):
            return super().linear(x.double(), weight.double(), None if bias is None else bias.double()).to(x.dtype)

    model.set_ops(Float64Ops())

`DEFAULT_OPS` is exactly what the model computed before the seam existed (the same torch
calls), so its outputs are bit for bit the same.

What it is not: a kernel library, a dispatcher on device or dtype, or a home for attention (the
backend's job) or for every elementwise op (the residual adds are exact whatever computes them).
The weights stay in the modules, under their checkpoint names; an op receives them as arguments.

Reference: vLLM's `LinearMethodBase.apply(layer, x, bias)` (`model_executor/layers/linear.py`),
the per-layer seam quantisation plugs into; Thinking Machines, "Defeating Nondeterminism in
LLM Inference" (2025), on why matmul and RMSNorm are the kernels whose results move with the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D/2]. HF's "rotate half" layout: pairs are (i, i + D/2)."""
    x1, x2 = x.chunk(2, dim=-1)  # [T, H, D/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D/2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Ops:
    """The default ops: PyTorch's own, bit for bit what `nn.Linear` and HF's RMSNorm, RoPE and MLP compute."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in], weight [out, in], bias [out] or None -> [..., out]."""
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [..., dim], weight [dim] -> [..., dim]: x / rms(x) over the last dimension, times weight."""
        # Normalise in float32, then cast back, exactly as Hugging Face does, even for a float64
        # model: matching the oracle's rounding lets our float64 tests demand identical greedy tokens.
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(dtype)

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [T, Hq, D], k [T, Hkv, D], cos/sin [T, D/2] -> the rotated (q, k), same shapes."""
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up [T, ff] -> silu(gate) * up [T, ff]: SwiGLU between the up and down projections."""
        return F.silu(gate) * up


DEFAULT_OPS = Ops()

__all__ = ["Ops", "DEFAULT_OPS", "apply_rope"]
