"""Batch-invariant ops: every row's result depends on that row alone, never on the batch.

What it is: `InvariantOps`, the ops (level0_naive/ops.py's seam) that `batch_invariant=True` gives the model,
each beside its default twin and named for what it fixes:

    linear     invariant_ops.cpp: each output one sum over k = 0 .. K-1 in order, with the
               weight packed once per matrix; PyTorch's matmul changes its algorithm (and
               so its order of additions) with the number of rows
    rms_norm   features/cpu_kernels' cpu_ops.cpp: a fixed order of its own for the sum of squares,
               in every dtype
    silu_mul   cpu_ops.cpp: one code path for every element; PyTorch computes a tensor's
               last few elements with a scalar SiLU that rounds differently from its vector one
    rope       CpuOps' (cpu_ops.cpp), bit for bit PyTorch's: elementwise and already invariant

Attention is the backend's part (the mode asks the engine for one that adds every sum in a
fixed order), and the sampler's: a row's probabilities come from its own logits, and with
the mode a sampled token is argmax(log p + noise keyed by the request's seed and the
token's position) (sampler.py: `KeyedSampler`).

Why: a request's tokens and logprobs should not depend on what else the server is doing.
docs/batch_invariance.md has the worked example, the measured cost and what it does not
promise (other machines, dtypes, tensor-parallel layouts).

What it is not: a GPU path (vLLM's VLLM_BATCH_INVARIANT=1 has Triton kernels for that),
threaded, or as fast as oneDNN for large batches.

Reference: He, "Defeating Nondeterminism in LLM Inference" (Thinking Machines, 2025);
vLLM `model_executor/layers/batch_invariant.py`.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import torch

from features.cpu_kernels.native import NativeLibrary
from features.cpu_kernels.ops import SUFFIX, CpuOps

LIBRARY = NativeLibrary(
    Path(__file__).with_name("invariant_ops.cpp"),
    {f"{op}_{s}": codes for s in SUFFIX.values() for op, codes in
     (("panel_width", "->i"), ("pack", "piip"), ("linear", "pppiiip"))},
    flags=("-ffp-contract=fast",),  # one fused multiply-add per product where the CPU has them
)  # fmt: skip
ACCUMULATOR = {torch.float32: torch.float32, torch.bfloat16: torch.float32, torch.float64: torch.float64}


class InvariantOps(CpuOps):
    """Fixed-order linear, norm and SwiGLU (see the module docstring); float32, bfloat16, float64 on a CPU."""

    norm_dtypes = set(SUFFIX)  # float64 too: its default twin is not row-invariant by construction

    def __init__(self):
        super().__init__("batch_invariant=True")
        self.matmul = LIBRARY.require("batch_invariant=True")
        # id(weight) -> (the weight, its version and address when packed, its panels); an entry goes
        # with its weight, and a weight changed in place (its version counter moved) is packed again
        self._packed: dict[int, tuple[weakref.ref, tuple[int, int], torch.Tensor]] = {}

    def panels(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [N, K] -> its packed panels, made on first use (then reused: weights do not change)."""
        ref, stamp, packed = self._packed.get(id(weight), (None, None, None))
        if ref is None or ref() is not weight or stamp != (weight._version, weight.data_ptr()):
            s = SUFFIX[weight.dtype]
            width = getattr(self.matmul, f"panel_width_{s}")()
            N, K = weight.shape
            w = weight.detach().contiguous()
            packed = torch.empty(-(-N // width) * K * width, dtype=ACCUMULATOR[weight.dtype])
            getattr(self.matmul, f"pack_{s}")(w.data_ptr(), N, K, packed.data_ptr())
            key, entries = id(weight), self._packed
            self._packed[key] = (weakref.ref(weight, lambda _: entries.pop(key, None)), (weight._version, weight.data_ptr()),
                                 packed)  # fmt: skip
        return packed

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K], weight [N, K], bias [N] or None -> [..., N]; row i of the result depends on row i of x alone."""
        self._check(x, weight, bias)
        N, K = weight.shape
        rows = x.reshape(-1, K).contiguous()  # [M, K]
        out = torch.empty(rows.shape[0], N, dtype=x.dtype)  # [M, N]
        if rows.shape[0] and N:
            b = None if bias is None else bias.contiguous()  # kept in a name until the call returns
            if b is not None and b.numel() != N:
                raise ValueError(f"linear: bias has {b.numel()} values for {N} outputs")
            getattr(self.matmul, f"linear_{SUFFIX[x.dtype]}")(
                rows.data_ptr(), self.panels(weight).data_ptr(), None if b is None else b.data_ptr(), rows.shape[0], N,
                K, out.data_ptr(),
            )  # fmt: skip
        return out.view(*x.shape[:-1], N)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """CpuOps' compiled norm (a fixed order per row) for every layout: a strided x is copied first."""
        self._check(x, weight)
        return super().rms_norm(x if x.is_contiguous() else x.contiguous(), weight, eps)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up [T, ff] (rows may be slices of one [T, 2 ff] tensor) -> silu(gate) * up, one code path."""
        self._check(gate, up)
        g, u = (t if t.dim() == 2 and t.stride(1) == 1 else t.reshape(-1, t.shape[-1]).contiguous() for t in (gate, up))
        out = torch.empty(g.shape, dtype=g.dtype)  # [T, ff]
        getattr(self.lib, f"silu_mul_{SUFFIX[g.dtype]}")(
            g.data_ptr(), u.data_ptr(), g.shape[0], g.shape[1], g.stride(0), u.stride(0), out.data_ptr()
        )
        return out.view(gate.shape)

    @staticmethod
    def _check(x: torch.Tensor, *others: torch.Tensor | None) -> None:
        """No silent fallback here: a default twin would break the promise, so anything else is an error."""
        for t in (x, *others):
            if t is not None and (t.dtype != x.dtype or t.device.type != "cpu" or x.dtype not in SUFFIX):
                raise ValueError(
                    f"batch_invariant=True computes float32, bfloat16 or float64 CPU tensors, not {t.dtype} on {t.device}"
                )


def invariant_ops(device: torch.device, dtype: torch.dtype) -> InvariantOps:
    """The ops of `batch_invariant=True`, or a ValueError saying why they cannot run here."""
    if device.type != "cpu":
        raise ValueError(
            f"batch_invariant=True runs on the CPU (its fixed-order kernels are C++), not {device.type}: "
            "on GPUs, vLLM's VLLM_BATCH_INVARIANT=1 has the Triton kernels"
        )
    if dtype not in SUFFIX:
        raise ValueError(f"batch_invariant=True computes in float32, bfloat16 or float64, not {dtype}")
    return InvariantOps()


__all__ = ["InvariantOps", "LIBRARY", "invariant_ops"]
