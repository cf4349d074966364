"""Level 1's compiled CPU backend: ``cpu_attention.cpp`` built once, or one line saying why not.

What this is
    ``paged_attention_cpu``, the attention function ``attention_backend="auto"`` picks on
    a CPU (``paged_cache.attention_impl``). Decodes and speculative verifications of
    up to ``LONG_QUERY`` tokens go to the C++ kernel in ``cpu_attention.cpp``, which
    reads K and V in place through the block tables (its header draws the loop nest);
    longer queries (prefill chunks), and float16, go to
    ``attention_ref.paged_attention_torch``.

    Why compiled: a decode on a CPU is a few microseconds of arithmetic per sequence and
    layer, and the torch backend spends about 20 aten calls per sequence and layer around
    it (a gather, two matmuls, a softmax, a cat). The kernel is one call per layer.

    How it is built: the source includes no torch header, so one ``c++ -O3 -shared`` call
    (about a second) makes a shared library, named by a hash of the source, the flags and
    the compiler, in ``$LADDER_CACHE_DIR`` (default ``~/.cache/inference-ladder``). The first
    process that needs it builds it (into a temporary name, then an atomic rename, so two
    processes building at once are harmless); every later one loads it with ``ctypes``.
    ``torch.utils.cpp_extension`` would work too, but compiling against torch's headers
    takes about a minute on 2 cores: too long for a first demo or a test run.

    If it cannot be built (no compiler), ``available()`` is False, the reason is logged
    once, and ``auto`` uses the torch backend: a missing compiler is never an error.
    ``attention_backend="cpu"`` asks for the kernel by name and does raise, with the reason.

What this is not
    Not a GPU path (``triton_attention.py`` is), and not the fastest CPU attention there
    is: vLLM's ``csrc/cpu/`` kernels tile queries and use intrinsics. This one is written
    to be read beside the Triton kernel.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from .attention_ref import paged_attention_torch

__all__ = ["LONG_QUERY", "available", "build_error", "kernel", "paged_attention_cpu", "require"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
# -O3 and -fopenmp-simd let the compiler vectorise the `#pragma omp simd` loops (no OpenMP
# runtime is linked); -march=native uses the building CPU's vector width (the cache is per machine).
CFLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC"]
ENTRY_POINTS = {
    torch.float32: "paged_attention_f32",
    torch.float64: "paged_attention_f64",
    torch.bfloat16: "paged_attention_bf16",
}
# Queries longer than this go to SDPA (attention_ref.paged_attention_torch). Measured with
# `python -m benchmarks.attention --heads 4 2` (2-core EPYC, fp32, D 64, one thread): for
# decodes the kernel is 2.9-3.1x the torch backend at 160 context, 1.4-1.6x at 576, 1.3-1.5x
# at 1024 (16 and 64 sequences); 4-token queries (a verification of 3 guesses) 1.9x at 160,
# 1.0x at 576; one 16-token query over 512 keys 0.4x: each (row, key) is its own dot product,
# and SDPA's matmuls win as soon as there are enough rows to block.
LONG_QUERY = 4

_lock = threading.Lock()
_module = None  # the loaded library, once built
_error: str | None = None  # why it could not be, once tried and failed


def cache_dir() -> Path:
    return Path(os.environ.get("LADDER_CACHE_DIR") or Path.home() / ".cache" / "inference-ladder")


def _build() -> ctypes.CDLL:
    """Compile the library (unless this exact build is cached) and load it; raises on any failure."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler: {cxx!r} is not on PATH")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(CFLAGS), version]).encode()).hexdigest()[:16]
    lib = cache_dir() / f"cpu_attention-{key}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
        os.close(fd)
        try:
            done = subprocess.run([cxx, *CFLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[:500]}")
            os.replace(tmp, lib)  # atomic: another process sees no library or a whole one
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    module = ctypes.CDLL(str(lib))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in ENTRY_POINTS.values():
        fn = getattr(module, name)
        fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_double, ptr]
        fn.restype = None
    return module


def _load():
    """The library, or None (with the reason logged once) if it cannot be built."""
    global _module, _error
    with _lock:  # two threads asking at once build it once
        if _module is None and _error is None:
            try:
                _module = _build()
            except Exception as e:  # noqa: BLE001 -- any build failure means "use the torch path"
                first = str(e).strip().splitlines()
                _error = f"{type(e).__name__}: {first[0] if first else ''}"
                log.warning("compiled CPU paged attention unavailable (%s); using the torch backend", _error)
    return _module


def available() -> bool:
    """Whether the compiled kernel can run in this process (builds it on first call)."""
    return _load() is not None


def require():
    """The library, or a RuntimeError saying why it could not be built (`attention_backend="cpu"`)."""
    module = _load()
    if module is None:
        raise RuntimeError(f"attention_backend='cpu': the compiled kernel could not be built ({_error})")
    return module


def build_error() -> str | None:
    """Why the kernel could not be built, or None (if it was, or has not been tried)."""
    return _error


def kernel(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale: float) -> torch.Tensor:
    """One call of the C++ kernel, every query length (no routing): the contract of
    ``attention_ref.paged_attention_ref`` for float32, float64 and bfloat16 CPU tensors."""
    module = require()
    if q.dtype not in ENTRY_POINTS:
        raise TypeError(f"the CPU kernel takes {', '.join(map(str, ENTRY_POINTS))}, not {q.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous CPU tensor of q's dtype {q.dtype}")
    q = q.contiguous()
    meta = [t.to(torch.int32).contiguous() for t in (query_start_loc, seq_lens, block_tables)]  # [B+1], [B], [B, W]
    out = torch.empty_like(q)  # [T, Hq, D]
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    getattr(module, ENTRY_POINTS[q.dtype])(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), *(m.data_ptr() for m in meta),
        len(meta[1]), num_q_heads, num_kv_heads, head_dim, block_size, meta[2].shape[1], scale, out.data_ptr(),
    )  # fmt: skip
    return out


def paged_attention_cpu(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale: float) -> torch.Tensor:
    """Same contract and result as ``attention_ref.paged_attention_ref``; CPU tensors only.

    One kernel call for the whole batch when every query is at most LONG_QUERY tokens
    (every decode step, every verification); with a long prefill in the batch, the long
    sequences go to SDPA and the rest, gathered, to the kernel.
    """
    if q.dtype not in ENTRY_POINTS:  # float16: the torch backend
        return paged_attention_torch(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale)
    starts = query_start_loc.tolist()
    lens = [b - a for a, b in zip(starts, starts[1:])]  # query length per sequence
    if max(lens, default=0) <= LONG_QUERY:
        return kernel(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale)
    # A long prefill in the batch: SDPA for the long queries, the kernel for the others.
    out = torch.empty_like(q)  # [T, Hq, D]
    long = [i for i, n in enumerate(lens) if n > LONG_QUERY]
    short = [i for i, n in enumerate(lens) if 0 < n <= LONG_QUERY]
    for group, attend in ((long, paged_attention_torch), (short, kernel)):
        if group:
            rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in group])  # [T_group]
            qsl = torch.zeros(len(group) + 1, dtype=torch.int32)
            qsl[1:] = torch.tensor([lens[i] for i in group]).cumsum(0)
            idx = torch.tensor(group)
            out[rows] = attend(
                q[rows].contiguous(), k_cache, v_cache, qsl, seq_lens[idx], block_tables[idx].contiguous(), scale
            )
    return out
