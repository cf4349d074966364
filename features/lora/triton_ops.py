"""Punica's BGMV as two Triton kernels: the batch's LoRA delta, each row on its own adapter.

What it is: `delta_triton`, the same function as punica.py's `delta_gathered` (x [T, in], A [S, R, in],
B [S, out, R], scale [S], idx [T] with -1 for the base model -> delta [T, out] in x's dtype), in two
launches with the scaled shrink kept in fp32 between them (fp64 for fp64 inputs):

    shrink   shrunk[t, r] = scale[s] * sum_k x[t, k] A[s, r, k]     s = idx[t]; grid (T, R / BLOCK_R)
    expand   delta[t, o]  = sum_r shrunk[t, r] B[s, o, r]                       grid (T, out / BLOCK_OUT)

    one program = one row t x one block of outputs; it reads its row's slot s from idx and walks
    the reduction (in, then R) in blocks, so A[s] and B[s] are read straight from the stacked slots:

        idx     [ 2, -1, 0, 2 ]       row 1 runs the base model: both kernels store zeros for it
        A       [ slot 0 | slot 1 | slot 2 ]   rows 0 and 3 read slot 2's A and B, nothing is gathered
                                               into a [T, R, in] copy (what delta_gathered builds)

The scale is applied in the shrink: R multiplications per row instead of out, and the fp32 sum
loses nothing by it. A rank below max_lora_rank is zero-padded in A and B, so it adds nothing.

What it is not: SGMV (a prefill's rows of one adapter as one tiled matrix product with tl.dot), a
fused shrink + expand, several projections (q, k, v) in one launch, or tuned for any GPU: the
blocks are plain constants. Each row's matrix-vector product is an elementwise product and a
tl.sum, which is what a decode step's BGMV is. Without CUDA it runs under Triton's interpreter.

Reference: Chen et al., "Punica: Multi-Tenant LoRA Serving" (MLSys 2024), the BGMV kernel; vLLM
`vllm/lora/ops/triton_ops/` (lora_shrink_op.py, lora_expand_op.py: the same split and the scale
applied in the shrink).
"""

from __future__ import annotations

import contextlib
import os

import torch

if not torch.cuda.is_available():
    # Before triton's first import in the process: triton chooses its interpreter then.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# A program's outputs and reduction step: the shrink's R block and in step, the expand's out block and
# R step (BLOCK_R, at most, both). Plain constants, untuned.
BLOCK_R, BLOCK_IN, BLOCK_OUT = 16, 64, 64


@triton.jit
def _shrink_kernel(
    shrunk_ptr,  # [T, R] fp32 (fp64 for fp64 inputs), contiguous: the accumulation dtype
    x_ptr,  # [T, in]
    A_ptr,  # [S, R, in]
    scale_ptr,  # [S]
    idx_ptr,  # [T] int64, -1: the base model
    R,
    n_in,
    stride_xt,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    BLOCK_R: tl.constexpr,
    BLOCK_IN: tl.constexpr,
):
    t = tl.program_id(0)  # the row
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R] this program's ranks
    slot = tl.load(idx_ptr + t)
    acc = tl.zeros([BLOCK_R], dtype=shrunk_ptr.dtype.element_ty)  # [BLOCK_R]
    if slot >= 0:  # a base-model row stores its zeros: never read A at slot -1
        for k0 in range(0, n_in, BLOCK_IN):
            k = k0 + tl.arange(0, BLOCK_IN)  # [BLOCK_IN]; the last block is masked (in need not be a multiple)
            xk = tl.load(x_ptr + t * stride_xt + k * stride_xk, mask=k < n_in, other=0.0)  # [BLOCK_IN]
            a_ptrs = A_ptr + slot * stride_as + r[:, None] * stride_ar + k[None, :] * stride_ak  # [BLOCK_R, BLOCK_IN]
            a = tl.load(a_ptrs, mask=(r[:, None] < R) & (k[None, :] < n_in), other=0.0)  # A[slot, r, k]
            acc += tl.sum(a.to(acc.dtype) * xk.to(acc.dtype)[None, :], axis=1)
        acc = acc * tl.load(scale_ptr + slot).to(acc.dtype)
    tl.store(shrunk_ptr + t * R + r, acc, mask=r < R)


@triton.jit
def _expand_kernel(
    out_ptr,  # [T, out] in x's dtype
    shrunk_ptr,  # [T, R] the shrink's, scale applied, contiguous
    B_ptr,  # [S, out, R]
    idx_ptr,  # [T] int64, -1: the base model
    R,
    n_out,
    stride_ot,
    stride_bs,
    stride_bo,
    stride_br,
    BLOCK_R: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
):
    t = tl.program_id(0)  # the row
    o = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)  # [BLOCK_OUT] this program's columns
    slot = tl.load(idx_ptr + t)
    acc = tl.zeros([BLOCK_OUT], dtype=shrunk_ptr.dtype.element_ty)  # [BLOCK_OUT]
    if slot >= 0:  # a base-model row stores zeros, as the shrink did
        for r0 in range(0, R, BLOCK_R):  # R is small (max_lora_rank): usually one block
            r = r0 + tl.arange(0, BLOCK_R)  # [BLOCK_R]
            s = tl.load(shrunk_ptr + t * R + r, mask=r < R, other=0.0)  # [BLOCK_R]
            b_ptrs = B_ptr + slot * stride_bs + o[:, None] * stride_bo + r[None, :] * stride_br  # [BLOCK_OUT, BLOCK_R]
            b = tl.load(b_ptrs, mask=(o[:, None] < n_out) & (r[None, :] < R), other=0.0)  # B[slot, o, r]
            acc += tl.sum(b.to(acc.dtype) * s[None, :], axis=1)
    tl.store(out_ptr + t * stride_ot + o, acc.to(out_ptr.dtype.element_ty), mask=o < n_out)


def interpreted() -> bool:
    """Does this process's triton run kernels in its interpreter (so CPU tensors work)? Chosen at its first import."""
    return type(tl.sum).__name__ == "InterpretedFunction"


def delta_triton(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor, idx: torch.Tensor):
    """x [T, in], A [S, R, in], B [S, out, R], scale [S], idx [T] (-1: none) -> delta [T, out] in x's dtype."""
    (T, n_in), (_, R, _), n_out = x.shape, A.shape, B.shape[1]
    out = torch.empty(T, n_out, dtype=x.dtype, device=x.device)  # [T, out]: every element is stored
    if T == 0:
        return out  # nothing to launch
    if not x.is_cuda and not interpreted():
        raise RuntimeError(
            "delta_triton got CPU tensors but triton was imported without TRITON_INTERPRET=1: "
            "set it in the environment, or use another LoRA path"
        )
    idx, scale = idx.contiguous(), scale.contiguous()  # the kernels read them with stride 1
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    shrunk = torch.empty(T, R, dtype=acc, device=x.device)  # [T, R]: x A^T * scale, between the launches
    block_r = min(BLOCK_R, triton.next_power_of_2(R))  # a rank of 8 needs no 16-wide tile
    # Triton launches on torch's current GPU: make it the tensors' one (cuda:1 is not the current one).
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _shrink_kernel[(T, triton.cdiv(R, block_r))](
            shrunk, x, A, scale, idx, R, n_in, *x.stride(), *A.stride(), BLOCK_R=block_r, BLOCK_IN=BLOCK_IN
        )
        _expand_kernel[(T, triton.cdiv(n_out, BLOCK_OUT))](
            out, shrunk, B, idx, R, n_out, out.stride(0), *B.stride(), BLOCK_R=block_r, BLOCK_OUT=BLOCK_OUT
        )
    return out


__all__ = ["delta_triton", "interpreted"]
