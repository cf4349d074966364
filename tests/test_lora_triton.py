"""The LoRA room's Triton shrink and expand (features/lora/triton_ops.py) against punica.py's torch paths.

What this is
    ``delta_triton`` equals ``delta_loop`` (the readable one) and ``delta_gathered`` (the same BGMV in
    torch) on hypothesis-drawn batches: 1 to 6 rows, each on one of 1 to 3 slots or on the base
    model (-1); ranks 1, 3, 8, 16 and 24 (24 spans two rank blocks); in and out sizes below, at and
    across the 64-wide blocks; strided x and B; float32 and float64. The base model's rows are
    exactly zero, and fp16/bf16 come back in their own dtype, summed in fp32 and rounded once.

What this deliberately is not
    Not a speed test, and not the engine with the Triton path chosen (tests/test_lora.py runs the
    engine). Under the interpreter on a CPU; with CUDA the last test runs the kernels compiled, and
    the CPU-tensor tests skip (unlike tests/test_level1_kernel.py, no child process runs them there).

The reference it follows
    tests/test_level1_kernel.py (the kernel against its torch twins on drawn workloads); vLLM's
    tests/lora/test_punica_ops.py (each op against a torch reference).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    # Before triton's first import: the interpreter must be chosen then.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton", reason="the Triton kernels need triton (Linux); the torch paths are tested elsewhere")

from features.lora.punica import delta_gathered, delta_loop  # noqa: E402
from features.lora.triton_ops import delta_triton  # noqa: E402

pytestmark = pytest.mark.level3  # the room's rung, as tests/test_lora.py

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-12, atol=1e-12)}


def interpreted(test):
    """CPU tensors: marked and skipped as tests/test_level1_kernel.py's are (`-m triton_interpreter`)."""
    skip = pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)")
    return skip(pytest.mark.triton_interpreter(test))


@dataclass
class Batch:
    idx: list[int]  # [T] each row's slot, -1: the base model
    S: int
    R: int
    n_in: int
    n_out: int
    strided: bool  # x a slice of wider rows, B stored [S, R, out] and transposed
    seed: int

    def tensors(self, dtype, device="cpu"):
        """x [T, in], A [S, R, in], B [S, out, R], scale [S], idx [T]: the delta comes out O(1)."""
        g = torch.Generator().manual_seed(self.seed)
        T, pad = len(self.idx), 3 if self.strided else 0

        def draw(*shape, std=1.0):  # drawn in fp64 (the same numbers in every dtype), then cast
            return (torch.randn(*shape, generator=g, dtype=torch.float64) * std).to(dtype=dtype, device=device)

        x = draw(T, self.n_in + pad)[:, : self.n_in]  # [T, in], rows n_in + pad apart when strided
        A = draw(self.S, self.R, self.n_in, std=self.n_in**-0.5)  # [S, R, in]
        B = draw(self.S, self.R, self.n_out, std=self.R**-0.5).transpose(1, 2)  # [S, out, R], r-stride out
        B = B if self.strided else B.contiguous()
        scale = (torch.rand(self.S, generator=g, dtype=torch.float64) + 0.5).to(dtype=dtype, device=device)  # [S]
        return x, A, B, scale, torch.tensor(self.idx, device=device).long()


@st.composite
def batches(draw) -> Batch:
    S = draw(st.integers(1, 3))
    idx = draw(st.lists(st.integers(-1, S - 1), min_size=1, max_size=6))
    sizes = st.sampled_from([1, 5, 64, 100, 129])  # below, at and across a 64-wide block
    return Batch(idx, S, draw(st.sampled_from([1, 3, 8, 16, 24])), draw(sizes), draw(sizes), draw(st.booleans()),
                 draw(st.integers(0, 2**16)))  # fmt: skip


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@settings(max_examples=25, deadline=None)
@given(batch=batches())
@example(batch=Batch([-1], 1, 3, 1, 1, False, 0))  # one row, on the base model alone
@example(batch=Batch([0], 1, 8, 5, 7, False, 1))  # one row, on an adapter
@example(batch=Batch([2, -1, 0, 2, 1, -1], 3, 24, 129, 100, True, 2))  # every slot, two rank blocks, strided
@example(batch=Batch([1, 0, -1, 1], 2, 16, 64, 129, False, 3))  # an exact in block, a ragged out one
def test_triton_equals_the_loop_and_the_gathered(dtype, batch):
    x, A, B, scale, idx = batch.tensors(dtype)
    got = delta_triton(x, A, B, scale, idx)  # [T, out]
    assert got.shape == (len(batch.idx), batch.n_out) and got.dtype == dtype
    torch.testing.assert_close(got, delta_loop(x, A, B, scale, idx), **TOLERANCE[dtype])
    torch.testing.assert_close(got, delta_gathered(x, A, B, scale, idx), **TOLERANCE[dtype])
    assert not got[idx < 0].any()  # the base model's rows: zeros, whatever the slots hold


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_summed_in_fp32_and_rounded_once(dtype):
    x, A, B, scale, idx = Batch([0, -1, 1, 1], 2, 16, 129, 70, False, 4).tensors(dtype)
    got = delta_triton(x, A, B, scale, idx)
    want = delta_loop(*(t.float() for t in (x, A, B, scale)), idx).to(dtype)  # the same inputs, fp32 throughout
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=1.6e-2 if dtype == torch.bfloat16 else 2e-3, atol=1e-3)


def test_an_empty_batch_launches_nothing():
    x, A, B, scale, idx = Batch([0], 2, 4, 6, 5, False, 5).tensors(torch.float32)
    assert delta_triton(x[:0], A, B, scale, idx[:0]).shape == (0, 5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_triton_native_gpu(dtype):
    x, A, B, scale, idx = Batch([2, -1, 0, 2, 1, -1, 0], 3, 24, 2048, 1000, True, 6).tensors(dtype, "cuda")
    got = delta_triton(x, A, B, scale, idx)
    want = delta_gathered(*(t.float() for t in (x, A, B, scale)), idx).to(dtype)
    rtol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-4}[dtype]  # in = 2048 here
    torch.testing.assert_close(got, want, rtol=rtol, atol=1e-3 if dtype != torch.float32 else 1e-4)
