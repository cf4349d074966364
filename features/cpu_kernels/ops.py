"""The CPU fast path of the ops seam: RMSNorm and RoPE compiled, the matmuls left to PyTorch.

What it is: `CpuOps`, an `Ops` (level0_naive/ops.py) whose `rms_norm` and `rope` are one call each into
`cpu_ops.cpp` (its header says why and how exact), and `resolve_ops(name, device)`, what
an engine's `ops=` setting means:

    "auto"   CpuOps on a CPU when cpu_ops.cpp builds here, else the default Ops (PyTorch)
    "cpu"    CpuOps, or a RuntimeError saying why it cannot be built
    "torch"  the default Ops: PyTorch's own calls, bit for bit what Hugging Face computes

`linear` stays PyTorch's (oneDNN/MKL at these shapes is at the machine's matmul rate:
`python -m benchmarks.profile`), and so does `silu_mul` (PyTorch's vectorised SiLU is
faster than cpu_ops.cpp's beyond one row; the batch-invariant ops (features/batch_invariance)
use the compiled one for its
single code path). What is not float32 or bfloat16, or not laid out as the kernels
expect, goes to the default twin: float64 keeps HF's exact formulas (the equivalence
tests' dtype), float16 and strided tensors are rare here.

What it is not: a GPU path (on CUDA "auto" is the default Ops), or exact for RMSNorm: its
sum of squares runs in a fixed order of its own, so it agrees with the torch formula to a
few units in the last place (tests/test_ops.py); RoPE is bit for bit.

Reference: vLLM's `CustomOp` (`model_executor/custom_op.py`: `forward_native` beside
`forward_cpu`/`forward_cuda`) and its `_custom_ops` RMSNorm and rotary embedding.
"""

from __future__ import annotations

from pathlib import Path

import torch

from level0_naive.config import OPS_NAMES
from level0_naive.ops import DEFAULT_OPS, Ops

from .native import NativeLibrary

SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float64: "f64"}  # what cpu_ops.cpp takes
NORM = {torch.float32, torch.bfloat16}  # CpuOps' compiled norms (float64: the torch formula, HF's bits)
LIBRARY = NativeLibrary(
    Path(__file__).with_name("cpu_ops.cpp"),
    {f"{op}_{s}": codes for s in SUFFIX.values() for op, codes in
     (("rms_norm", "ppiiidp"), ("rope", "pppiiiip"), ("silu_mul", "ppiiiip"))},
)  # fmt: skip


def _row_stride(x: torch.Tensor) -> int | None:
    """How far apart x's rows are, if x [rows, ...] keeps everything past its first dimension
    contiguous (a plain tensor, or a column slice of a wider one, as level 5's q|k|v); else None."""
    if x.is_contiguous():
        return x.shape[1:].numel() if x.dim() > 1 else x.numel()
    return x.stride(0) if x.dim() > 1 and x[0].is_contiguous() else None


class CpuOps(Ops):
    """PyTorch's matmuls, compiled RMSNorm and RoPE (cpu_ops.cpp); the default formulas where they do not apply."""

    norm_dtypes = NORM  # the batch-invariant ops (features/batch_invariance/ops.py) add float64
    # ctypes calls: torch.compile cannot trace them (features/compilation swaps in the torch formulas)
    traceable = False

    def __init__(self, asked_for: str = "ops='cpu'"):
        self.lib = LIBRARY.require(asked_for)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [..., dim], weight [dim] -> [..., dim] (float32, bfloat16; anything else: Ops.rms_norm)."""
        dim = x.shape[-1]
        # rows of `dim` values: all of them if x is contiguous; a 2-D column slice, rows `stride` apart
        stride = dim if x.is_contiguous() else (x.stride(0) if x.dim() == 2 and x.stride(1) == 1 else None)
        if (
            x.dtype not in self.norm_dtypes
            or weight.dtype != x.dtype
            or x.device.type != "cpu"
            or not stride
            or not dim
        ):
            return super().rms_norm(x, weight, eps)
        if weight.numel() != dim:
            raise ValueError(f"rms_norm: weight has {weight.numel()} values for rows of {dim}")
        w = weight.contiguous()  # kept in a name: a temporary's memory could be freed before the call
        out = torch.empty(x.shape, dtype=x.dtype)  # [..., dim]
        getattr(self.lib, f"rms_norm_{SUFFIX[x.dtype]}")(
            x.data_ptr(), w.data_ptr(), x.numel() // dim, dim, stride, eps, out.data_ptr()
        )
        return out

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [T, Hq, D], k [T, Hkv, D], cos/sin [T, D/2] -> rotated copies (level 0's apply_rope's bits)."""
        if q.dtype not in SUFFIX or not all(t.dtype == q.dtype and t.device.type == "cpu" for t in (k, cos, sin)):
            return super().rope(q, k, cos, sin)
        rows = [_row_stride(t) for t in (q, k)]
        if None in rows or not (cos.is_contiguous() and sin.is_contiguous()):
            return super().rope(q, k, cos, sin)
        fn = getattr(self.lib, f"rope_{SUFFIX[q.dtype]}")
        outs = []
        for x, stride in zip((q, k), rows):
            out = torch.empty(x.shape, dtype=x.dtype)  # [T, H, D]
            fn(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.shape[0], x.shape[1], x.shape[2], stride, out.data_ptr())
            outs.append(out)
        return outs[0], outs[1]


def resolve_ops(name: str, device: torch.device) -> Ops:
    """An engine's `ops=` setting -> the Ops object its model computes with (see the module docstring)."""
    if name not in OPS_NAMES:
        raise ValueError(f"ops={name!r} is not one of: {', '.join(OPS_NAMES)}")
    if name == "torch" or (name == "auto" and (device.type != "cpu" or not LIBRARY.available())):
        return DEFAULT_OPS
    if device.type != "cpu":
        raise ValueError(f"ops='cpu' runs on CPU tensors, not {device.type}")
    return CpuOps()


__all__ = ["CpuOps", "resolve_ops", "LIBRARY", "SUFFIX"]
