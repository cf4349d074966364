"""The KV cache in 8 bits: each block stores a quarter of float32's bytes (half of bfloat16's), so the same
memory holds four (two) times the tokens, and the batch grows with it.

What it is: the two formats `kv_cache_dtype=` takes (vLLM's names), what a block stores and how an
attention backend reads it:

    "fp8"    float8 e4m3 (4 exponent bits, 3 mantissa bits, up to 448), one scale per layer for K
             and one for V: stored = fp8(x / s). s is 1.0 (vLLM's default), or with
             calculate_kv_scales=True the first forward's largest |x| / 448 for that layer (a
             calibration: what that first batch saw fills the format; a later larger value is
             clamped to 448 s). A block: [block_size, Hkv, D] bytes.
    "int8"   symmetric per token and head: s = max_d |x[d]| / 127, q = round(x / s) in [-127, 127],
             and the scale (float32) stored beside its values, in the same block:
             [block_size, Hkv, D + 4] bytes. A block carries its own scales, so whatever moves or
             copies blocks (level 3's copy-on-write, the KV connectors) moves them too.

The cache is bytes (uint8) either way; the write quantizes the step's new K and V into their slots
(`write_kv`). The attention (`attend`) reads them one of two ways:

    in place           a backend that reads 8 bits itself (its attend function has a `quantized`
                       twin, and its `accepts(q, kind)` says it takes this step: the compiled CPU kernel,
                       features/cpu_kernels, and level 1's Triton kernel) gets the bytes and scales
    dequantized copy   any other (torch, ref): the blocks the step's block tables name are
                       dequantized in the model's dtype, the tables renumbered to the copy, and the
                       backend's own attention runs over it

    block tables [[3, 7], [7, 2]]  ->  used blocks [2, 3, 7], dequantized  ->  tables [[1, 2], [2, 0]]

So every backend reads an 8-bit cache, and the two ways agree to rounding (tested).

What it is not: an 8-bit attention (the math runs in the model's dtype, or the kernels' accumulation
dtype), or a quantizing cache write in a kernel (the write is torch's, here).

Reference: vLLM `kv_cache_dtype="fp8"` (docs: quantized KV cache; `calculate_kv_scales`);
Micikevicius et al., "FP8 Formats for Deep Learning" (2022), e4m3; KIVI and KVQuant (2024) on
per-token scales.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


class KVFormat:
    """A cache format: what a head's slot stores (`head_bytes`), and the write and attend that use it."""

    name = ""

    def head_bytes(self, head_dim: int) -> int:
        raise NotImplementedError

    def quantize(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """x [T, Hkv, D] -> [T, Hkv, head_bytes] uint8, for `cache` (one layer's K or V)."""
        raise NotImplementedError

    def dequantize(self, blocks: torch.Tensor, dtype: torch.dtype, cache: torch.Tensor) -> torch.Tensor:
        """blocks [..., head_bytes] uint8 of `cache` -> [..., D] in `dtype`."""
        raise NotImplementedError

    def wrap(self, attend):
        """A backend's attention -> (write_kv, attend) over a cache in this format."""

        def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
            n, bs, h, w = k_cache.shape  # [N, bs, Hkv, head_bytes]
            k_cache.view(n * bs, h, w)[slot_mapping] = self.quantize(k, k_cache)
            v_cache.view(n * bs, h, w)[slot_mapping] = self.quantize(v, v_cache)

        in_place = getattr(attend, "quantized", None)  # a backend that reads 8 bits itself (the compiled CPU kernel)

        def attend_quantized(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale):
            if in_place is not None and in_place.accepts(q, self.name):
                ks, vs = (self.scale(k_cache), self.scale(v_cache)) if self.name == "fp8" else (1.0, 1.0)
                return in_place(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, self.name, ks, vs)
            used, tables = torch.unique(block_tables, return_inverse=True)  # [U]; tables: indices into used
            k = self.dequantize(k_cache[used], q.dtype, k_cache).contiguous()  # [U, bs, Hkv, D]
            v = self.dequantize(v_cache[used], q.dtype, v_cache).contiguous()
            return attend(q, k, v, query_start_loc, seq_lens, tables.to(block_tables.dtype), scale)

        return write_kv, attend_quantized


class Int8KV(KVFormat):
    name = "int8"

    def head_bytes(self, head_dim: int) -> int:
        return head_dim + 4  # the values, then their float32 scale

    def quantize(self, x, cache):
        xw = x if x.dtype == torch.float64 else x.float()  # rounded in float32 at least, never in 16 bits
        s = xw.abs().amax(dim=-1, keepdim=True).float() / 127  # [T, Hkv, 1] float32
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.round(xw / s.to(xw.dtype)).clamp(-127, 127).to(torch.int8)  # [T, Hkv, D]
        return torch.cat([q.view(torch.uint8), s.view(torch.uint8)], dim=-1)  # [T, Hkv, D + 4]

    def dequantize(self, blocks, dtype, cache):
        d = blocks.shape[-1] - 4
        wide = torch.float64 if dtype == torch.float64 else torch.float32  # (multiplied there, then rounded once)
        q = blocks[..., :d].view(torch.int8).to(wide)
        # a copy: a view may sit at an offset a float32 view cannot take
        s = blocks[..., d:].clone(memory_format=torch.contiguous_format).view(torch.float32).to(wide)  # [..., 1]
        return (q * s).to(dtype)


class Fp8KV(KVFormat):
    name = "fp8"

    def __init__(self, calculate_scales: bool = False):
        self.calculate_scales = calculate_scales
        self.scales: dict[int, float] = {}  # a layer's K (or V) cache, by its address -> its scale

    def head_bytes(self, head_dim: int) -> int:
        return head_dim

    def scale(self, cache: torch.Tensor, x: torch.Tensor | None = None) -> float:
        key = cache.data_ptr()  # each layer's K and V are tensors of their own, allocated once
        if key not in self.scales:
            amax = float(x.abs().max()) if x is not None and self.calculate_scales and x.numel() else 0.0
            self.scales[key] = amax / FP8_MAX if amax > 0 else 1.0
        return self.scales[key]

    def quantize(self, x, cache):
        s = self.scale(cache, x)
        return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)

    def dequantize(self, blocks, dtype, cache):
        wide = torch.float64 if dtype == torch.float64 else torch.float32  # (as int8's: multiplied there, rounded once)
        return (blocks.view(FP8).to(wide) * self.scale(cache)).to(dtype)


FORMATS = {"fp8": Fp8KV, "int8": Int8KV}


def kv_format(name: str, calculate_scales: bool = False) -> KVFormat:
    if name not in FORMATS:
        raise ValueError(f"kv_cache_dtype={name!r} is not one of: auto, {', '.join(FORMATS)}")
    return Fp8KV(calculate_scales) if name == "fp8" else Int8KV()


__all__ = ["KVFormat", "Int8KV", "Fp8KV", "FORMATS", "kv_format", "FP8_MAX"]
