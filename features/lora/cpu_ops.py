"""The CPU's multi-LoRA delta: Punica's BGMV as one compiled call per projection (cpu_lora.cpp).

What it is: `delta_cpu(x, A, B, scale, idx, out)`, the same delta as punica.py's four, added into
`out` (the base projection's output) by a C++ loop that takes each slot's rows together and
multiplies each row by its own slot's ranks only:

    out[t] += scale[s] * (x[t] A[s]^T) B[s]^T      s = idx[t] >= 0      x [T, in], out [T, out]

It reads the slots where they lie: A [S, W, in] and B's storage [S, W, out] (slots.py keeps B so:
`B.transpose(1, 2)` is contiguous). `available()` says whether it builds here (a C++ compiler,
native.py); the slots' default path is this one where it does and the stacked matmuls where not.

Why on a CPU: PyTorch has no op for "each row its own small matrix", so the torch paths either
multiply every row by every slot (stacked: S times the arithmetic) or gather rows and scatter
results (segmented, gathered). At 8 slots of rank 8 on the built-in model, in a batch of 64, the
stacked deltas took 0.36 s of a 1.6 s run and these 0.17 s, mostly reading the adapters' weights from
memory (docs/lora.md; `python -m benchmarks.lora --paths auto,stacked` compares them).

What it is not: threaded (one core), or for tensors it was not written for: float16 slots, a CPU
without a compiler, or S-LoRA's sharded split ("auto" is then the stacked path), and a projection's
input or output whose rows are not each contiguous (`SlotKernel.takes`: that projection goes the
stacked way, the same delta). In bfloat16 it sums in float32 and rounds once, where the stacked path
rounds its shrink to bfloat16 first, so greedy tokens may differ between the two there (both are
within rounding of the exact delta).

Reference: Chen et al., "Punica" (MLSys 2024), BGMV; vLLM `vllm/lora/ops/torch_ops/lora_ops.py`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from features.cpu_kernels.native import NativeLibrary

SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float64: "f64"}
LIBRARY = NativeLibrary(
    Path(__file__).with_name("cpu_lora.cpp"),
    {f"lora_delta_{s}": "pippppiiiiipi" for s in SUFFIX.values()},
    flags=("-ffp-contract=fast",),  # fused multiply-adds: this kernel promises rounding, not PyTorch's bits
)


def available() -> bool:
    """Does the kernel build here (native.py: a C++ compiler; the reason is logged once if not)?"""
    return LIBRARY.available()


class SlotKernel:
    """The kernel bound to one projection's slots. A [S, W, in], B's storage [S, W, out] and scale [S] never
    move (loading a slot copies into them), so their addresses are taken once; a call passes the step's x,
    mapping and the output to add into: a projection's whole LoRA cost is one C call (at a decode step's
    sizes, the few microseconds of a Python call are a fair part of it)."""

    def __init__(self, A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor):
        """A [S, W, in], B [S, out, W] (a view whose transpose is contiguous), scale [S]: CPU tensors of one dtype."""
        Bt = B.transpose(1, 2)  # [S, W, out]: each rank's outputs side by side, as the kernel reads them
        if A.dtype not in SUFFIX or not (A.is_contiguous() and Bt.is_contiguous() and scale.is_contiguous()):
            raise ValueError(f"the CPU's LoRA kernel: {A.dtype} slots, A and B^T contiguous")
        if A.dim() != 3 or Bt.dim() != 3 or Bt.shape[:2] != A.shape[:2] or scale.shape != A.shape[:1]:
            raise ValueError(f"the CPU's LoRA kernel: A {tuple(A.shape)}, B {tuple(B.shape)} and scale {tuple(scale.shape)} "
                             "do not agree on the slots and their ranks")  # fmt: skip
        if not all(t.dtype == A.dtype and t.device.type == "cpu" for t in (A, Bt, scale)):
            raise ValueError("the CPU's LoRA kernel: CPU tensors of one dtype")
        self.slots, self.width, self.n_in = A.shape
        self.n_out, self.dtype = Bt.shape[2], A.dtype
        self.tensors = (A, Bt, scale)  # kept alive while their addresses are used
        self.addresses = (A.data_ptr(), Bt.data_ptr(), scale.data_ptr())  # fixed: a slot's load copies into them
        self.fn = LIBRARY.function(f"lora_delta_{SUFFIX[A.dtype]}", "the CPU's LoRA kernel")

    def takes(self, x: torch.Tensor, out: torch.Tensor) -> bool:
        """x [T, in] and out [T, out] of the slots' dtype, on the CPU, each row contiguous."""
        return (x.dtype == self.dtype and out.dtype == self.dtype and x.device.type == "cpu" and out.device.type == "cpu"
                and x.dim() == 2 and out.dim() == 2 and x.stride(1) == 1 and out.stride(1) == 1
                and x.shape[1] == self.n_in and out.shape == (x.shape[0], self.n_out))  # fmt: skip

    def __call__(self, x: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """x [T, in], idx [T] int64 contiguous (each row's slot, -1: none), out [T, out] -> out += the delta."""
        if not self.takes(x, out) or idx.dtype != torch.int64 or not idx.is_contiguous() or len(idx) != len(x):
            raise ValueError(f"the CPU's LoRA kernel: x {tuple(x.shape)} {x.dtype}, idx {tuple(idx.shape)} {idx.dtype}, "
                             f"out {tuple(out.shape)} for slots [{self.slots}, {self.width}, {self.n_in} -> {self.n_out}]")  # fmt: skip
        return self.run(x, idx, out)

    def run(self, x: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`__call__` without its checks, for a caller that has made them (the slots: `takes`, and a step's
        mapping, int64 and as long as x)."""
        A, Bt, scale = self.addresses
        self.fn(x.data_ptr(), x.stride(0), A, Bt, scale, idx.data_ptr(), x.shape[0], self.slots, self.width, self.n_in,
                self.n_out, out.data_ptr(), out.stride(0))  # fmt: skip
        return out


def delta_cpu(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor, idx: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [T, in], A [S, R, in], B [S, out, R] (a view whose transpose is contiguous, or any: then copied),
    scale [S], idx [T] (-1: none) -> `out` [T, out] with the delta added in place (a new zero tensor if None)."""
    if not B.transpose(1, 2).is_contiguous():
        B = B.transpose(1, 2).contiguous().transpose(1, 2)
    out = x.new_zeros(x.shape[0], B.shape[1]) if out is None else out
    kernel = SlotKernel(A.contiguous(), B, scale.to(A.dtype).contiguous())
    return kernel(x, idx.to(torch.int64).contiguous(), out)


__all__ = ["delta_cpu", "available", "SlotKernel", "LIBRARY"]
