"""Weights in 8 and 4 bits: how a matrix is stored, how it comes back, and the matmul that reads it.

What it is: two weight-only formats (the activations stay in the model's dtype), each a small class
holding the integers and their scales, made from a float weight W [out, in] by `quantize`:

    int8   per output channel, symmetric:     s_o = max_i |W[o, i]| / 127
                                              q = round(W / s_o) in [-127, 127]     W ~ q * s_o
    int4   groups of 128 along in, asymmetric (gpt-fast's scheme, torchao's layout):
                                              per group: lo, hi = min, max of its 128 values
                                              s = (hi - lo) / 15,  zero = lo + 8 s
                                              q = round((W - lo) / s) in [0, 15]    W ~ (q - 8) s + zero

The rounding error is at most half a step: |W - W~| <= s / 2 (int8: s per channel; int4: per group),
so a channel (a group) with one large outlier pays for it with a coarse step for all its values:
that is the lesson of scales, and why int4 needs groups.

Each weight multiplies two ways, and the two agree to the activations' rounding (tested):

    reference   dequantize W~ in the model's dtype, then F.linear: any device, any dtype (float64 too,
                which the tests use to compare with Hugging Face on the dequantized weights, bit for bit)
    kernel      PyTorch's packed kernels, which read the integers: `torch._weight_int8pack_mm` and, on a
                CPU, `torch._weight_int4pack_mm_for_cpu` (the weight repacked once by
                `_convert_weight_to_int4pack_for_cpu`). Both take 16-bit activations here (their
                float32 path is several times slower than float32's own matmul on this CPU), so a
                float32 model's rows are rounded to bfloat16 for them. Their shape rules (checked
                before the call: a wrong shape can crash the process, not raise): int8's kernel here
                read past its rows at `in` = 136 or 200 (so: `in` a multiple of 64, where every shape
                probed held), int4's needs `out` a multiple of 16; a weight that breaks them, or a
                device without the kernel, runs the reference.

What it is not: activation quantization (W8A8), AWQ or GPTQ (their calibrated scales; a checkpoint in
those formats is not read), or a GPU kernel (on CUDA both formats run the reference: no GPU has run PyTorch's kernels here).

Reference: gpt-fast `quantize.py` (WeightOnlyInt8QuantHandler; WeightOnlyInt4QuantHandler, groupsize
128, `get_group_qparams`); torchao's int4 layout; Dettmers et al., "LLM.int8()" (2022) on outliers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GROUP = 128  # int4's group along the input dimension (gpt-fast's default)


def wide(w: torch.Tensor) -> torch.Tensor:
    """The weight in float32 (float64 stays): scales and roundings are computed there, never in 16 bits, where
    `w / s` alone would carry 8 significant bits and move a value by more than half a step."""
    return w.detach() if w.dtype == torch.float64 else w.detach().float()


class Int8Weight:
    """q [out, in] int8 and scale [out] (float32): W ~ q * scale[:, None]."""

    bits = 8

    def __init__(self, weight: torch.Tensor):
        self.dtype, self.shape = weight.dtype, tuple(weight.shape)
        w = wide(weight)
        amax = w.abs().amax(dim=1)  # [out]
        self.scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))  # an all-zero row: any scale
        self.q = torch.round(w / self.scale[:, None]).clamp(-127, 127).to(torch.int8)  # [out, in]
        self.kernel = w.device.type == "cpu" and self.shape[1] % 64 == 0 and hasattr(torch, "_weight_int8pack_mm")
        self.scale16 = self.scale.to(torch.bfloat16)  # the kernel's

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        wide = torch.float64 if dtype == torch.float64 else torch.float32  # (multiplied there, then rounded once)
        return (self.q.to(wide) * self.scale.to(wide)[:, None]).to(dtype)  # [out, in]

    def matmul(self, x: torch.Tensor, use_kernel: bool) -> torch.Tensor:
        """x [T, in] -> [T, out] in x's dtype."""
        if use_kernel and self.kernel and x.dtype in (torch.float32, torch.bfloat16):
            return torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.q, self.scale16).to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype))

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()  # a byte a weight, a scale a row


class Int4Weight:
    """Groups of GROUP along in: the integers in [0, 15], two to a byte (`nibbles`; the CPU kernel's own packing
    beside them), scale and zero [out, in/GROUP] (float32): W ~ (q - 8) * scale + zero, group by group."""

    bits = 4

    def __init__(self, weight: torch.Tensor, group: int = GROUP):
        out, n_in = weight.shape
        if n_in % group:
            raise ValueError(f"int4 needs each layer's input size to be a multiple of its group ({group}); "
                             f"a layer here has {n_in}")  # fmt: skip
        self.dtype, self.shape, self.group = weight.dtype, (out, n_in), group
        g = wide(weight).reshape(out, n_in // group, group)  # [out, G, group]
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)  # [out, G]
        self.scale = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(hi))  # a flat group: any scale
        self.zero = lo + 8 * self.scale
        q = torch.round((g - lo[..., None]) / self.scale[..., None]).clamp(0, 15).to(torch.uint8).reshape(out, n_in)
        self.nibbles = q[:, 0::2] | (q[:, 1::2] << 4)  # [out, in/2]: what the reference reads
        self.kernel = weight.device.type == "cpu" and out % 16 == 0 and hasattr(torch, "_weight_int4pack_mm_for_cpu")
        if self.kernel:  # torchao's layout (its own packing), scales and zeros [G, out, 2] in bfloat16
            self.packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            sz = torch.stack([self.scale, self.zero], dim=-1).transpose(0, 1)  # [G, out, 2]
            self.scales_zeros = sz.contiguous().to(torch.bfloat16)

    @property
    def q(self) -> torch.Tensor:
        """The integers [out, in] in [0, 15], unpacked."""
        return torch.stack([self.nibbles & 15, self.nibbles >> 4], dim=-1).reshape(self.shape)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        wide = torch.float64 if dtype == torch.float64 else torch.float32  # (computed there, then rounded once)
        out, n_in = self.shape
        q = self.q.reshape(out, n_in // self.group, self.group).to(wide)
        w = (q - 8) * self.scale.to(wide)[..., None] + self.zero.to(wide)[..., None]
        return w.reshape(out, n_in).to(dtype)

    def matmul(self, x: torch.Tensor, use_kernel: bool) -> torch.Tensor:
        if use_kernel and self.kernel and x.dtype in (torch.float32, torch.bfloat16):
            x16 = x.to(torch.bfloat16).contiguous()
            return torch._weight_int4pack_mm_for_cpu(x16, self.packed, self.group, self.scales_zeros).to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype))

    @property
    def nbytes(self) -> int:
        """What it holds: the reference's nibbles and, with the kernel, its own packing beside them (a byte a
        weight then, not half: keeping one copy is not built), the scales and zeros."""
        held = [self.nibbles, self.scale, self.zero] + ([self.packed, self.scales_zeros] if self.kernel else [])
        return sum(t.numel() * t.element_size() for t in held)


FORMATS = {"int8": Int8Weight, "int4": Int4Weight}

__all__ = ["Int8Weight", "Int4Weight", "FORMATS", "GROUP", "wide"]
