"""The compiled CPU attention backend: ``cpu_attention.cpp`` built once, or one line saying why not.

What this is
    ``paged_attention_cpu`` and ``write_kv_cpu``, the two functions
    ``attention_backend="auto"`` picks on a CPU (level 1's ``attention_impl``, through
    ``ladder/rooms.py``): the C++
    kernel in ``cpu_attention.cpp`` (its header draws the loop nest), reading K and V in
    place through the block tables, for decodes, verifications and prefills, all in one
    call; and the cache write, one call for a step's tokens. Two kinds of query go to
    level 1's ``attention_ref`` SDPA instead: a query of more than ``LONG_QUERY`` tokens over a
    longer cached context (a chunk after a prefix hit: SDPA's blocked matmuls win there,
    measured below), and float16, which the kernel does not take. ``kernel`` alone takes
    every query, which is what ``batch_invariant=True`` uses (one reduction order for all).

    Why compiled: a decode on a CPU is a few microseconds of arithmetic per sequence and
    layer, and the torch backend spends about 20 aten calls per sequence and layer around
    it (a gather, two matmuls, a softmax, a cat). The kernel is one call per layer, and
    it adds every sum in a fixed order, so a row's result never depends on the rest of
    the batch (what ``batch_invariant=True`` builds on).

    How it is built: ``native.py`` compiles it with the system's C++
    compiler (about a second, cached per machine) and loads it with ``ctypes``. If it
    cannot be built (no compiler), ``available()`` is False, the reason is logged once,
    and ``auto`` uses the torch backend: a missing compiler is never an error.
    ``attention_backend="cpu"`` asks for the kernel by name and does raise, with the reason.

What this is not
    Not a GPU path (level 1's ``triton_attention.py`` is), and not the fastest CPU attention there
    is: vLLM's ``csrc/cpu/`` kernels tile queries and use intrinsics. This one is written
    to be read beside the Triton kernel.

Reference
    vLLM ``csrc/cpu/attention.cpp`` (paged attention on the CPU); the loop nest of level 1's
    ``triton_attention.py``; Milakov and Gimelshein, "Online normalizer calculation for softmax" (2018).
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import NamedTuple

import torch

from level1_paged.attention_ref import paged_attention_torch
from level1_paged.kv_cache import write_kv_cache

from .native import NativeLibrary

__all__ = [
    "LIBRARY",
    "LONG_QUERY",
    "attention_functions",
    "available",
    "build_error",
    "kernel",
    "paged_attention_cpu",
    "paged_attention_cpu_8bit",
    "StepPlan",
    "require",
    "write_kv_cpu",
]

# A query of more than LONG_QUERY tokens over a cached context longer than itself goes to SDPA.
# Measured over `benchmarks.attention.decode_batch` (fp32, 4 query / 2 KV heads, D 64, one
# thread): the kernel is 1.7-3.3x the torch backend on decodes, 1.1-2.3x on 5- and 8-token
# queries (verifications of k = 4 or 7 guesses) over 160-1024 keys, 1.1-2x on prefills from the
# start (96 to 2048 tokens); 0.9-1.2x at 12 tokens, 0.86-1.2x at 16, and a 100-token chunk over
# 1100 keys 0.6x: many keys per row is where blocked matmuls win.
LONG_QUERY = 8

SUFFIX = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16"}  # the dtypes the kernel takes
KINDS = {"int8": "i8", "fp8": "f8"}  # the 8-bit caches the kernel reads in place (features/quantization/kv.py)
LIBRARY = NativeLibrary(
    Path(__file__).with_name("cpu_attention.cpp"),
    {f"paged_attention_{s}": "pppppp" + "iiiiii" + "dp" for s in SUFFIX.values()}
    | {f"paged_attention_{s}_{k}": "pppppp" + "iiiiii" + "dddp" for s in SUFFIX.values() for k in KINDS.values()}
    | {f"write_kv_{s}": "ppiipiipp" for s in SUFFIX.values()},
)


def available() -> bool:
    """Whether the compiled kernel can run in this process (builds it on first call)."""
    return LIBRARY.available()


def require():
    """The library, or a RuntimeError saying why it could not be built (`attention_backend="cpu"`)."""
    return LIBRARY.require("attention_backend='cpu'")


def build_error() -> str | None:
    """Why the kernel could not be built, or None (if it was, or has not been tried)."""
    return LIBRARY.error


class _StepMemo(threading.local):
    """What a step's layers share about its metadata, worked out once: checked, converted, routed.

    The C code trusts its metadata, so each call must know the block ids and slots are in range; a
    step calls the kernel once per layer with the same tensors, and the checks (a min and a max
    each), the int32 copies and the routing's `.tolist()` cost 40-60 microseconds a layer in an
    engine's step (measured: 0.6 ms of a 2.6 ms batch-1 decode step of the built-in model, where
    the C code itself takes 0.13). So `get(tensors, limit, make)` returns what `make()` returned for
    the very same tensors, and calls it again for any other.

    "The same" is the very object (a weak reference: a new step's tensor is a new object, even at
    the same address) at the same version (an in-place write bumps it) against a cache of the same
    shape (`limit`). A tensor made in inference mode has no version counter, so a write to it could
    not be seen: it is never remembered, and checked at every call. An engine's step runs in
    inference mode but builds its metadata as normal tensors (level 1's `ModelInput.build`) for this
    reason. One memo per thread: two engines stepping on two threads (two servers in a test) never
    get each other's tensors back."""

    def __init__(self):
        self.refs: tuple = ()
        self.value = None

    def seen(self, tensors: tuple[torch.Tensor, ...], limit: tuple) -> bool:
        return (
            len(self.refs) == len(tensors) + 1
            and self.refs[-1] == limit
            and all(r() is t and v == t._version for (r, v), t in zip(self.refs, tensors))
        )

    def get(self, tensors: tuple[torch.Tensor, ...], limit: tuple, make):
        if self.seen(tensors, limit):
            return self.value
        self.refs, self.value = (), None  # (make() may raise: then nothing is remembered)
        value = make()
        if not any(t.is_inference() for t in tensors):  # (no version to watch: made again next call)
            self.refs, self.value = (*((weakref.ref(t), t._version) for t in tensors), limit), value
        return value


_ATTENTION_META, _SLOTS = _StepMemo(), _StepMemo()


class _Metadata(NamedTuple):
    """One step's attention metadata as the C code takes it, checked: int32 contiguous tensors (kept here
    so their memory outlives the calls) and the arguments made of them."""

    tensors: tuple[torch.Tensor, ...]  # query_start_loc, seq_lens, block_tables
    args: tuple  # their pointers, the number of sequences, the block tables' width
    route: tuple | None  # paged_attention_cpu's split (`_route`), None: every sequence to the kernel


def _checked_metadata(query_start_loc, seq_lens, block_tables, num_blocks: int, block_size: int) -> _Metadata:
    """The step's metadata as int32 contiguous tensors, their ranges checked, and how it is routed."""
    # copies, always: what the C code reads is what was checked, whatever happens to the originals later
    qsl, lens, tables = (t.to(torch.int32, copy=True).contiguous() for t in (query_start_loc, seq_lens, block_tables))
    if tables.numel() and (int(tables.min()) < 0 or int(tables.max()) >= num_blocks):
        raise IndexError(f"block_tables hold block ids outside 0..{num_blocks - 1}")
    if lens.numel() and int(lens.max()) > tables.shape[1] * block_size:
        raise IndexError("a seq_len is longer than its block table covers")
    args = (qsl.data_ptr(), lens.data_ptr(), tables.data_ptr(), len(lens))
    return _Metadata((qsl, lens, tables), args + (tables.shape[1],), _route(query_start_loc, seq_lens))


def _metadata(query_start_loc, seq_lens, block_tables, k_cache) -> _Metadata:
    """The step's `_Metadata`, made once for all its layers (_StepMemo)."""
    shape = k_cache.shape
    return _ATTENTION_META.get((query_start_loc, seq_lens, block_tables), (shape[0], shape[1]),
                               lambda: _checked_metadata(query_start_loc, seq_lens, block_tables, shape[0], shape[1]))  # fmt: skip


def _function(name: str):
    return LIBRARY.function(name, "attention_backend='cpu'")


def kernel(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale: float, kind: str | None = None,
           k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:  # fmt: skip
    """One call of the C++ kernel: the contract of ``attention_ref.paged_attention_ref`` for
    float32, float64 and bfloat16 CPU tensors (the metadata int32 and contiguous, as
    level 1's ``model_input.ModelInput`` builds it; anything else is converted first). `kind`:
    an 8-bit cache of bytes ("int8": [N, bs, Hkv, D + 4], "fp8": [N, bs, Hkv, D] and its layer's
    `k_scale`, `v_scale`), read in place."""
    if q.dtype not in SUFFIX:
        raise TypeError(f"the CPU kernel takes {', '.join(map(str, SUFFIX))}, not {q.dtype}")
    # The C code trusts its metadata: an out-of-range entry would read memory torch indexing would refuse.
    # Checked (and made int32) once for a step's layers (_StepMemo).
    return _launch(q, k_cache, v_cache, _metadata(query_start_loc, seq_lens, block_tables, k_cache), scale, kind,
                   k_scale, v_scale)  # fmt: skip


def _launch(q, k_cache, v_cache, md: _Metadata, scale: float, kind: str | None = None, k_scale: float = 1.0,
            v_scale: float = 1.0) -> torch.Tensor:  # fmt: skip
    """`kernel` once its step's metadata is checked (`md`): the caches checked, and one call of the C code."""
    cache_dtype = q.dtype if kind is None else torch.uint8
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != cache_dtype or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous CPU tensor of {cache_dtype}")
    if kind is not None and (k_cache.shape[1] > 1024 or k_cache.shape[3] != q.shape[2] + (4 if kind == "int8" else 0)):
        raise ValueError(f"an {kind} cache of block_size <= 1024 and {q.shape[2]} values a head, not {tuple(k_cache.shape)}")
    if kind is None:
        return _attend_c(_function(f"paged_attention_{SUFFIX[q.dtype]}"), q, k_cache, v_cache, md, scale)
    fn = _function(f"paged_attention_{SUFFIX[q.dtype]}_{KINDS[kind]}")
    return _attend_c(fn, q, k_cache, v_cache, md, scale, k_scale, v_scale)


def _attend_c(fn, q, k_cache, v_cache, md: _Metadata, scale: float, *scales: float) -> torch.Tensor:
    """One call of a C attention entry point `fn` over checked caches and metadata -> out [T, Hq, D]; `scales`:
    an 8-bit cache's (k_scale, v_scale)."""
    q = q.contiguous()
    out = torch.empty_like(q)  # [T, Hq, D]
    _, block_size, num_kv_heads, _ = k_cache.shape
    qsl, lens, tables, num_seqs, width = md.args
    fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), qsl, lens, tables, num_seqs, q.shape[1], num_kv_heads,
       q.shape[2], block_size, width, scale, *scales, out.data_ptr())  # fmt: skip
    return out


def paged_attention_cpu_8bit(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale: float, kind: str,
                             k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:  # fmt: skip
    """The kernel over an 8-bit cache (features/quantization/kv.py finds it as `paged_attention_cpu.quantized`):
    every query length in one call (no SDPA route for long chunks: SDPA would need the dequantized copy)."""
    return kernel(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, kind, k_scale, v_scale)


def paged_attention_cpu(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale: float) -> torch.Tensor:
    """Same contract and result as ``attention_ref.paged_attention_ref``; CPU tensors only.

    One kernel call for the whole batch unless it holds a chunk over a longer cached context
    (see LONG_QUERY): then those sequences go to SDPA and the rest, gathered, to the kernel.
    """
    if q.dtype not in SUFFIX:  # float16: the torch backend
        return paged_attention_torch(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale)
    md = _metadata(query_start_loc, seq_lens, block_tables, k_cache)
    if md.route is None:  # every decode and verification step, and prefills from the start
        return _launch(q, k_cache, v_cache, md, scale)
    starts, lens, chunk = md.route
    out = torch.empty_like(q)  # [T, Hq, D]
    for group, attend in (([i for i, c in enumerate(chunk) if c], paged_attention_torch),
                          ([i for i, c in enumerate(chunk) if not c and lens[i]], kernel)):  # fmt: skip
        if group:
            rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in group])  # [T_group]
            qsl = torch.zeros(len(group) + 1, dtype=torch.int32)
            qsl[1:] = torch.tensor([lens[i] for i in group]).cumsum(0)
            idx = torch.tensor(group)
            out[rows] = attend(
                q[rows].contiguous(), k_cache, v_cache, qsl, seq_lens[idx], block_tables[idx].contiguous(), scale
            )
    return out


def _route(query_start_loc, seq_lens):
    """None when every sequence goes to the kernel; else (starts, query lengths, which go to SDPA)."""
    starts = query_start_loc.tolist()
    lens = [b - a for a, b in zip(starts, starts[1:])]  # query length per sequence
    if max(lens, default=0) <= LONG_QUERY:
        return None
    chunk = [n > LONG_QUERY and s - n > n for n, s in zip(lens, seq_lens.tolist())]
    return (starts, lens, chunk) if any(chunk) else None


paged_attention_cpu.quantized = paged_attention_cpu_8bit  # what an 8-bit cache's reader asks for (duck-typed)
paged_attention_cpu_8bit.accepts = lambda q, kind: q.dtype in (torch.float32, torch.float64, torch.bfloat16)  # its entry points


def write_kv_cpu(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Level 1's ``kv_cache.write_kv_cache`` in one C++ call: k, v [T, Hkv, D] (each row's Hkv x D
    values contiguous; rows may be further apart) into their slots of [N, bs, Hkv, D]."""
    rows_ok = k.dim() == v.dim() == 3 and k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == k.shape[2]
    if k.dtype not in SUFFIX or not rows_ok or slot_mapping.dtype != torch.int64:
        return write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    _write_c(_function(f"write_kv_{SUFFIX[k.dtype]}"), k, v, k_cache, v_cache, _slots(slot_mapping, k_cache))


def _write_c(fn, k, v, k_cache, v_cache, slots: torch.Tensor) -> None:
    """One call of a C write entry point `fn`: k, v's rows (each row's values contiguous) into checked `slots`."""
    fn(k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), slots.data_ptr(), len(slots),
       k_cache.shape[2] * k_cache.shape[3], k_cache.data_ptr(), v_cache.data_ptr())  # fmt: skip


def _slots(slot_mapping: torch.Tensor, k_cache) -> torch.Tensor:
    """The step's slot mapping, checked against the cache once for all its layers (_StepMemo)."""
    N, bs = k_cache.shape[0], k_cache.shape[1]
    return _SLOTS.get((slot_mapping,), (N, bs), lambda: _checked_slots(slot_mapping, N * bs))


def _checked_slots(slot_mapping: torch.Tensor, num_slots: int) -> torch.Tensor:
    slots = slot_mapping.clone(memory_format=torch.contiguous_format)  # (a copy: what is checked is what is read)
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
        raise IndexError(f"slot_mapping holds slots outside 0..{num_slots - 1}")
    return slots


class StepPlan:
    """Level 1's `AttentionImpl.plan` on a CPU: made once a step, called once a layer.

    Made, it checks the step's metadata and slots and makes them the C code's arguments (the memos
    above); called, `plan(layer, q, k, v)` writes the layer's new K/V and attends as two bare C
    calls: what write_kv_cpu then paged_attention_cpu give, without their Python each layer (about
    0.2 ms of a 2.1 ms batch-1 step of the built-in model, compiled). False (so unused) where a step
    needs those two after all: a dtype the kernel does not take, a chunk the routing sends to SDPA."""

    def __init__(self, cache, meta, scale: float):
        self.cache, self.meta, self.scale = cache, meta, scale
        k0 = cache.k[0]  # [N, bs, Hkv, D], every layer's alike
        suffix = SUFFIX.get(k0.dtype)
        self.ok = suffix is not None and k0.device.type == "cpu" and meta.slot_mapping.dtype == torch.int64
        if self.ok:
            self.md = _metadata(meta.query_start_loc, meta.seq_lens, meta.block_tables, k0)
            self.ok = self.md.route is None
        if not self.ok:
            return
        self.d = k0.shape[3]
        self.slots = _slots(meta.slot_mapping, k0)
        self.write, self.attend = _function(f"write_kv_{suffix}"), _function(f"paged_attention_{suffix}")

    def __bool__(self) -> bool:
        return self.ok

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache, d, m = self.cache.k[layer], self.cache.v[layer], self.d, self.meta
        if not (q.dtype == k.dtype == k_cache.dtype and k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == d
                and k.shape[0] == v.shape[0] == len(self.slots) == q.shape[0] and q.shape[2] == d
                and k_cache.is_contiguous() and v_cache.is_contiguous()):  # fmt: skip
            write_kv_cpu(k, v, k_cache, v_cache, m.slot_mapping)  # (any other layout: the checked functions)
            return paged_attention_cpu(q, k_cache, v_cache, m.query_start_loc, m.seq_lens, m.block_tables, self.scale)
        _write_c(self.write, k, v, k_cache, v_cache, self.slots)
        return _attend_c(self.attend, q, k_cache, v_cache, self.md, self.scale)


def attention_functions(name: str, device: torch.device):
    """`attention_backend` "auto" or "cpu" on a CPU -> (write_kv_cpu, paged_attention_cpu, StepPlan); "auto" where
    the kernel cannot be built -> None (level 1 then uses its torch backend); "cpu" there -> the RuntimeError."""
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on CPU tensors, not {device.type}")
        require()  # built, or a RuntimeError with the reason
    elif not available():
        return None
    return write_kv_cpu, paged_attention_cpu, StepPlan
