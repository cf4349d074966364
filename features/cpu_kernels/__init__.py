"""Room: the compiled CPU kernels. The default fast path on a CPU, behind the ops seam and the attention backend.

What it is: small C++ files built once with the system's compiler and called through ctypes
(`native.py`: no torch headers, about a second to build, cached per machine), and the two
places the levels call them from:

    ops.py        `CpuOps`: level 0's ops seam (level0_naive/ops.py) with RMSNorm and RoPE
                  compiled (cpu_ops.cpp); what `ops="auto"` means on a CPU
    attention.py  the paged-attention kernel (cpu_attention.cpp) and the cache write: level 1's
                  attention backend on a CPU, what `attention_backend="auto"` means there; its
                  8-bit entry points read a `kv_cache_dtype="fp8" | "int8"` cache in place

A level never imports this room: `ladder/rooms.py` maps `ops=` and `attention_backend=` to it
(`resolve_ops`, `attention_functions`), so a reader of level 0 or 1 sees PyTorch's formulas and
the Triton kernel, and a CPU run still gets the compiled ones by default. Without a compiler
"auto" falls back to the levels' own PyTorch code, and says why once.

What it is not: a GPU path, or a kernel library: each kernel is written to be read beside its
PyTorch twin, and tested equal to it (tests/test_ops.py, tests/test_level1_kernel.py).

Reference: vLLM's `CustomOp` (`forward_native` beside `forward_cpu`) and `csrc/cpu/`.
"""

from .attention import attention_functions
from .ops import CpuOps, resolve_ops

__all__ = ["CpuOps", "resolve_ops", "attention_functions"]
