"""PagedAttention as one Triton kernel for prefill and decode alike.

What this is
    ``paged_attention_triton`` runs one "unified" kernel over a flattened batch
    (vLLM V1 style): every sequence brings 1..n new query tokens (a decode, a
    prefill; levels 2-4 add prefill chunks, prefix-cache hits and speculative
    verifications) and attends causally to its whole context, read from the
    paged KV cache through its block table. ``write_kv_cache_triton`` is the tiny kernel that puts new
    tokens' K/V into their slots first. Same contract as
    ``level1_paged/attention_ref.py`` (read its docstring for the metadata).

    The block table, for sequence i with block_size 4 and seq_len 10::

        key position      0 1 2 3   4 5 6 7   8 9 . .
                          '-------' '-------' '-------'
        logical block j       0         1         2         3
        block_tables[i]   [   7     ,   2     ,   5     ,  garbage ]  (padding:
                                                                    never read)
        k_cache, physical [N, bs, Hkv, D]:
          | blk 0 | blk 1 | blk 2 | blk 3 | blk 4 | blk 5 | blk 6 | blk 7 |
                          keys 4-7                keys 8,9        keys 0-3

        key k_pos lives at  k_cache[block_tables[i, k_pos // bs], k_pos % bs]

    The launch grid, one program per (query block, KV head)::

        axis 0: q-block slots, numbered across the whole batch; sequence i's
                slots start at query_start_loc[i] // BLOCK_Q + i. With BLOCK_Q = 16:
                seq 0: rows  0..39  (40 tokens) -> slots 0 1 2
                seq 1: row  40      (a decode)  -> slot  3
                seq 2: rows 41..70  (30 tokens) -> slots 4 5, spare 6 (returns)
                seq 3: row  71      (a decode)  -> slot  7
                T // BLOCK_Q + B = 72 // 16 + 4 = 8 slots: always enough
        axis 1: KV head 0 .. Hkv-1

        one program's tile: BLOCK_M rows (G = Hq // Hkv query heads per KV
        head; BLOCK_M = max(16, next_pow2(G)), BLOCK_Q = BLOCK_M // G)
            row r  ->  query token  q_block * BLOCK_Q + r // G
                       query head   kv_head * G + r % G
        so the G query heads that share a KV head share every K/V load.

    Each program walks its sequence's keys in tiles of TILE_SIZE positions,
    looks up each key's physical block, and keeps an online softmax (running
    max m, running sum l, accumulator acc) in fp32, or fp64 for fp64 inputs.

What this deliberately is not
    No split-KV "flash decoding" (vLLM's 3D kernel; an exercise in
    docs/level1_kernel.md), no sliding window, ALiBi, soft-cap, sinks, or
    autotuning, and not tuned for any particular GPU. An 8-bit cache
    (KV_QUANT, kv_cache_dtype="fp8" or "int8") is read in 8 bits and scaled
    after the load; the cache write stays the quantization room's (torch).

The reference it follows
    vLLM's ``vllm/v1/attention/ops/triton_unified_attention.py`` (the 2D
    kernel: q-block numbering with a binary search over query_start_loc, GQA
    rows packed into one tile, per-key block-table lookup); FlashAttention-2
    (Dao, 2023) for the online softmax; Kwon et al. (SOSP 2023) for paging.

Running without a GPU
    Without CUDA this module sets ``TRITON_INTERPRET=1`` before importing
    triton, and the kernels run on CPU tensors through Triton's interpreter
    (numpy; slow, but exact enough to test against). The switch only works if
    it comes before triton's FIRST import anywhere in the process: triton
    decides at import time whether its own helpers (tl.sum, tl.max...) are
    compiled or interpreted. If something imported triton earlier, set
    ``TRITON_INTERPRET=1`` in the environment yourself; the kernels raise a
    RuntimeError that says so otherwise.
"""

from __future__ import annotations

import contextlib
import os

import torch

if not torch.cuda.is_available():
    # Must precede the first `import triton` in the process (see docstring).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from .kv_cache import write_kv_cache  # noqa: E402

__all__ = ["paged_attention_triton", "paged_attention_triton_8bit", "write_kv_cache_triton"]


def _check_can_run(t: torch.Tensor) -> None:
    """A clear error instead of the interpreter's obscure one."""
    if t.is_cuda:
        return
    if type(tl.sum).__name__ != "InterpretedFunction":
        raise RuntimeError(
            "paged_attention_triton got CPU tensors but triton was imported without "
            "TRITON_INTERPRET=1 (something imported triton before level1_paged."
            "triton_attention could switch the interpreter on). Run with "
            "TRITON_INTERPRET=1 in the environment, or use the 'torch' backend."
        )


def _on_device_of(t: torch.Tensor):
    """Launch on the tensors' GPU, not the current one.

    Triton launches on torch's *current* device; with ``device="cuda:1"`` the
    tensors live on GPU 1 while the current device is still GPU 0, and the
    kernel would read GPU 0's addresses. CPU tensors (the interpreter) need no guard.
    """
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@triton.jit
def _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence that owns global q block `q_block`.

    Sequence i's q blocks are numbered from query_start_loc[i] // BLOCK_Q + i
    (its first token's block, plus one spare slot per earlier sequence so a
    sequence never has to share a q block with its neighbour). That start is
    non-decreasing in i, so a binary search finds the last i with start <= q_block.
    """
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _kv_scale(cache_ptr, scale_ptr, phys, slot, k_ok, kv_head, stride_blk, stride_slot, stride_head,
              HEAD_DIM: tl.constexpr, KV_QUANT: tl.constexpr, ACC_DTYPE: tl.constexpr):  # fmt: skip
    """The scale of each key of a tile [TILE] in an 8-bit cache, whose loads already gave the raw values.

    fp8: one scale for the whole layer. int8: each slot's head is D values and then its float32
    scale, [.., Hkv, D + 4] bytes, so the scale is 4 bytes at byte D of the head's slot.
    """
    if KV_QUANT == 1:
        return tl.full(phys.shape, 1.0, ACC_DTYPE) * tl.load(scale_ptr).to(ACC_DTYPE)
    at = cache_ptr + phys * stride_blk + slot * stride_slot + kv_head * stride_head + HEAD_DIM  # [TILE] byte pointers
    return tl.load(at.to(tl.pointer_type(tl.float32), bitcast=True), mask=k_ok, other=1.0).to(ACC_DTYPE)


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, Hq, D]
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [N, bs, Hkv, D]
    v_cache_ptr,  # [N, bs, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B+1] int32
    scale_ptr,  # [1] in the accumulation dtype (a float arg would be fp32)
    k_scale_ptr,  # [1] as scale_ptr: an fp8 cache's K scale (KV_QUANT 1; unread otherwise)
    v_scale_ptr,  # [1] as scale_ptr: its V scale
    num_seqs,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_k_blk,
    stride_k_slot,
    stride_k_head,
    stride_v_blk,
    stride_v_slot,
    stride_v_head,
    stride_bt_seq,
    QUERIES_PER_KV: tl.constexpr,  # G = Hq // Hkv
    BLOCK_SIZE: tl.constexpr,  # keys per cache block
    TILE_SIZE: tl.constexpr,  # keys per inner-loop step (independent of BLOCK_SIZE)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,  # next power of two >= HEAD_DIM, >= 16
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # tile rows, >= BLOCK_Q * G, power of two, >= 16
    ACC_DTYPE: tl.constexpr,  # tl.float32, or tl.float64 for fp64 inputs
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32/fp64, "tf32" for upcast fp16/bf16
    KV_QUANT: tl.constexpr = 0,  # the cache: 0 the model's dtype, 1 fp8 (per-tensor scales), 2 int8 (per-slot scales)
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)

    # --- which sequence, which part of its query ----------------------------
    seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= query_len:
        return  # a spare slot: this sequence needed fewer q blocks
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len  # keys cached before this step

    # --- the query tile: BLOCK_M rows = (token, head-in-group) pairs --------
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_d = tl.arange(0, HEAD_DIM_PADDED)  # [D_PAD]
    offs_t = tl.arange(0, TILE_SIZE)  # [TILE]
    q_pos = q_block_local * BLOCK_Q + offs_m // QUERIES_PER_KV  # [BLOCK_M] position in the query
    q_head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV  # [BLOCK_M]
    # A row is real if it is inside this program's BLOCK_Q tokens (BLOCK_M may
    # exceed BLOCK_Q * G when G is not a power of two) and inside the query.
    row_ok = (offs_m < BLOCK_Q * QUERIES_PER_KV) & (q_pos < query_len)  # [BLOCK_M]
    dim_ok = offs_d < HEAD_DIM  # [D_PAD]; padded dims load 0 and add 0 to q.k
    q_tok = (q_start + q_pos).to(tl.int64)  # [BLOCK_M] row in the flattened batch
    q_offs = q_tok[:, None] * stride_q_tok + q_head[:, None] * stride_q_head + offs_d[None, :]
    Q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    Q = Q.to(ACC_DTYPE)  # [BLOCK_M, D_PAD]
    scale = tl.load(scale_ptr).to(ACC_DTYPE)

    # --- online softmax state -------------------------------------------------
    # Invariant after each tile: m = max score seen so far per row,
    # l = sum of exp(score - m), acc = sum of exp(score - m) * v.
    m = tl.full([BLOCK_M], float("-inf"), ACC_DTYPE)  # [BLOCK_M]
    l = tl.zeros([BLOCK_M], ACC_DTYPE)  # [BLOCK_M]
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], ACC_DTYPE)  # [BLOCK_M, D_PAD]

    # Causal skip: the last real token of this q block sees keys
    # 0 .. context_len + last_q_pos, so later tiles are never visited.
    last_q_pos = tl.minimum((q_block_local + 1) * BLOCK_Q, query_len) - 1
    num_keys = context_len + last_q_pos + 1
    for tile in range(0, tl.cdiv(num_keys, TILE_SIZE)):
        k_pos = tile * TILE_SIZE + offs_t  # [TILE] logical key positions
        k_ok = k_pos < num_keys  # [TILE]
        # Per-key table lookup: a tile may span several blocks (bs < TILE) or
        # part of one (bs > TILE). Masked lanes never read the table, so padding
        # entries, whatever they hold, are never used as keys.
        phys = tl.load(block_tables_ptr + seq * stride_bt_seq + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(
            tl.int64
        )  # [TILE]; int64: big caches overflow int32
        slot = k_pos % BLOCK_SIZE  # [TILE]
        k_offs = (
            phys[None, :] * stride_k_blk + slot[None, :] * stride_k_slot + kv_head * stride_k_head + offs_d[:, None]
        )  # [D_PAD, TILE]
        K = tl.load(k_cache_ptr + k_offs, mask=dim_ok[:, None] & k_ok[None, :], other=0.0)
        v_offs = (
            phys[:, None] * stride_v_blk + slot[:, None] * stride_v_slot + kv_head * stride_v_head + offs_d[None, :]
        )  # [TILE, D_PAD]
        V = tl.load(v_cache_ptr + v_offs, mask=k_ok[:, None] & dim_ok[None, :], other=0.0)
        if KV_QUANT == 0:
            K = K.to(ACC_DTYPE)  # [D_PAD, TILE], already transposed for Q @ K
            V = V.to(ACC_DTYPE)  # [TILE, D_PAD]
        else:  # an 8-bit cache (features/quantization/kv.py): the values (widened through float32) times their scale
            K = K.to(tl.float32).to(ACC_DTYPE) * _kv_scale(k_cache_ptr, k_scale_ptr, phys, slot, k_ok, kv_head,
                stride_k_blk, stride_k_slot, stride_k_head, HEAD_DIM, KV_QUANT, ACC_DTYPE)[None, :]  # fmt: skip
            V = V.to(tl.float32).to(ACC_DTYPE) * _kv_scale(v_cache_ptr, v_scale_ptr, phys, slot, k_ok, kv_head,
                stride_v_blk, stride_v_slot, stride_v_head, HEAD_DIM, KV_QUANT, ACC_DTYPE)[:, None]  # fmt: skip

        S = tl.dot(Q, K, input_precision=DOT_PRECISION) * scale  # [BLOCK_M, TILE]
        # The causal rule; for a real row it also excludes k_pos >= num_keys.
        visible = row_ok[:, None] & (k_pos[None, :] <= context_len + q_pos[:, None])
        S = tl.where(visible, S, float("-inf"))

        m_new = tl.maximum(m, tl.max(S, axis=1))  # [BLOCK_M]
        # Key 0 is visible to every real row, so m_new is finite for real rows
        # from the first tile on; padding rows stay at -inf, and subtracting
        # 0 instead keeps them at exp(-inf) = 0 rather than NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        P = tl.exp(S - m_ref[:, None])  # [BLOCK_M, TILE]
        alpha = tl.exp(m - m_ref)  # [BLOCK_M] rescales what was summed under the old max
        l = l * alpha + tl.sum(P, axis=1)
        acc = acc * alpha[:, None] + tl.dot(P, V, input_precision=DOT_PRECISION)
        m = m_new

    l = tl.where(l == 0.0, 1.0, l)  # padding rows only; they are not stored
    out = acc / l[:, None]  # [BLOCK_M, D_PAD]
    o_offs = q_tok[:, None] * stride_o_tok + q_head[:, None] * stride_o_head + offs_d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _kernel_constexprs(
    group: int, block_size: int, head_dim: int, dtype: torch.dtype, tile_size: int = 32, kv_quant: int = 0
) -> dict:
    """The attention kernel's constexprs for these shapes: what `_launch` passes, and
    what benchmarks/kernel_compile.py compiles ahead of time for each GPU."""
    # tl.dot needs every dimension >= 16: pad the rows and the head dim.
    block_m = max(16, _next_pow2(group))
    fp64 = dtype == torch.float64
    return dict(
        QUERIES_PER_KV=group,
        BLOCK_SIZE=block_size,
        TILE_SIZE=tile_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=max(16, _next_pow2(head_dim)),
        BLOCK_Q=block_m // group,  # query tokens per program
        BLOCK_M=block_m,
        ACC_DTYPE=tl.float64 if fp64 else tl.float32,
        # fp16/bf16 values upcast to fp32 fit tf32 exactly (10-bit mantissa),
        # so tensor cores lose nothing on Q.K; fp32 and fp64 inputs need IEEE. (An
        # 8-bit cache's values times their float32 scale do not fit tf32 exactly: its
        # rounding, before tl.dot, is still finer than bf16's copy of the same values.)
        DOT_PRECISION="ieee" if dtype in (torch.float32, torch.float64) else "tf32",
        KV_QUANT=kv_quant,
    )


FP64_DOT_TRITON = (3, 5)  # the first Triton whose tl.dot takes fp64 ("Unsupported lhs dtype fp64" before)


def _check_fp64_supported() -> None:
    """Compiling fp64 needs Triton >= 3.5: a one-line error instead of a compiler assertion.
    (The interpreter on CPU is not affected; it is only asked on a GPU.)"""
    installed = tuple(int(part) for part in triton.__version__.split(".")[:2])
    if installed < FP64_DOT_TRITON:
        need = ".".join(map(str, FP64_DOT_TRITON))
        raise RuntimeError(f"fp64 paged attention on a GPU needs triton>={need} (installed: {triton.__version__})")


KV_QUANT = {"fp8": 1, "int8": 2}  # kv_cache_dtype -> the kernel's KV_QUANT
FP8_CAPABILITY = (8, 9)  # the first GPUs (Ada, Hopper) whose Triton converts float8 e4m3 ("fp8e4nv")
FP8_IN_TRITON = hasattr(tl, "float8e4nv")  # a Triton that knows the type at all (2.2 and later)


def _launch(
    q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale: float, tile_size: int = 32,
    kv_quant: int = 0, k_scale: float = 1.0, v_scale: float = 1.0,
) -> torch.Tensor:  # fmt: skip
    """paged_attention_triton with the tile size and the cache's format exposed (the tests vary them).

    kv_quant 1: the caches are float8 e4m3 (viewed so), K and V times k_scale and v_scale; 2: int8 values
    with each head's float32 scale after them, [N, bs, Hkv, D + 4] bytes (features/quantization/kv.py).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    assert num_q_heads % num_kv_heads == 0, "GQA needs Hq to be a multiple of Hkv"
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "head_dim must be contiguous"
    if q.stride(2) != 1:
        q = q.contiguous()  # the kernel reads a row of D values with stride 1
    assert tile_size >= 16 and tile_size == _next_pow2(tile_size), "tl.dot wants >= 16, pow2"
    out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=q.dtype, device=q.device)  # [T, Hq, D]
    if num_tokens == 0 or num_seqs == 0:
        return out  # nothing to launch, so nothing to check: an empty batch works on any device
    _check_can_run(q)
    meta = _kernel_constexprs(num_q_heads // num_kv_heads, block_size, head_dim, q.dtype, tile_size, kv_quant)
    fp64 = q.dtype == torch.float64
    if fp64 and q.is_cuda:
        _check_fp64_supported()
    if kv_quant == 1 and (why := _fp8_refused(q)):
        raise RuntimeError(f"an fp8 KV cache read by the Triton kernel needs {why}; use kv_cache_dtype='int8'")
    scale_t = torch.full((1,), scale, dtype=torch.float64 if fp64 else torch.float32, device=q.device)
    # fp8's K and V scales, each [1] (torch.full: filled on the device, no copy from the host, so no wait for it)
    k_scale_t, v_scale_t = (
        (torch.full((1,), s, dtype=scale_t.dtype, device=q.device) for s in (k_scale, v_scale))
        if kv_quant == 1 else (scale_t, scale_t)
    )  # fmt: skip
    grid = (num_tokens // meta["BLOCK_Q"] + num_seqs, num_kv_heads)
    with _on_device_of(q):
        _paged_attention_kernel[grid](
            out,
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale_t,
            k_scale_t,
            v_scale_t,
            num_seqs,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            block_tables.stride(0),
            **meta,
        )
    return out


def paged_attention_triton(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale: float) -> torch.Tensor:
    """Paged attention over a flattened batch; returns [T, Hq, D] in q.dtype.

    Same contract and result as level1_paged.attention_ref.paged_attention_ref:
    q [T, Hq, D], caches [N, bs, Hkv, D], query_start_loc [B+1] int32,
    seq_lens [B] int32 (context including the new tokens), block_tables
    [B, max_blocks] int32. No host synchronisation: the grid comes from the
    tensors' shapes alone (T // BLOCK_Q + B q-block slots).
    """
    return _launch(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale)


def paged_attention_triton_8bit(
    q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale: float, kind: str,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> torch.Tensor:  # fmt: skip
    """paged_attention_triton over an 8-bit cache (uint8 [N, bs, Hkv, head_bytes], `kind` "fp8" or "int8"),
    read in place: each tile is loaded in 8 bits and multiplied by its scale in the accumulation dtype.
    features/quantization/kv.py finds it as `paged_attention_triton.quantized`."""
    view = torch.float8_e4m3fn if kind == "fp8" else torch.int8
    k, v = k_cache.view(view), v_cache.view(view)
    return _launch(q, k, v, query_start_loc, seq_lens, block_tables, scale, 32, KV_QUANT[kind], k_scale, v_scale)


def _fp8_refused(q: torch.Tensor) -> str | None:
    """What this GPU and Triton lack to read an fp8 cache (None: nothing; the interpreter converts on any CPU)."""
    if not q.is_cuda:
        return None
    if not FP8_IN_TRITON:
        return f"a Triton with float8e4nv (installed: {triton.__version__})"
    if torch.cuda.get_device_capability(q.device) < FP8_CAPABILITY:
        return f"a GPU of compute capability >= 8.9 (this one: {torch.cuda.get_device_name(q.device)})"
    return None


def reads_in_place(q: torch.Tensor, kind: str) -> bool:
    """Whether paged_attention_triton_8bit takes this step: any dtype, but fp8 only where Triton converts e4m3
    (not on an A100, nor with a Triton too old to know the type: there an fp8 cache goes through the
    dequantized copy, features/quantization/kv.py)."""
    return kind != "fp8" or _fp8_refused(q) is None


paged_attention_triton.quantized = paged_attention_triton_8bit  # what an 8-bit cache's reader asks for (duck-typed)
paged_attention_triton_8bit.accepts = reads_in_place


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,
    v_cache_ptr,  # [N, bs, Hkv, D], contiguous: slot s starts at s * Hkv * D
    slot_mapping_ptr,  # [T] int64
    stride_k_tok,
    stride_v_tok,
    ROW: tl.constexpr,  # Hkv * D: one token's K (or V), contiguous in the cache
    ROW_PADDED: tl.constexpr,  # next power of two
):
    tok = tl.program_id(0)  # one program per new token
    slot = tl.load(slot_mapping_ptr + tok)  # int64
    offs = tl.arange(0, ROW_PADDED)  # [ROW_PADDED]
    ok = offs < ROW
    # k[tok] is [Hkv, D] with D contiguous and heads D apart (checked by the
    # caller), so one token's K is ROW values in a line, in k and in the cache.
    # No upcast after these loads: nothing is computed, and the interpreter
    # moves fp16/bf16 bits unchanged (the tests check bit-exactness).
    k = tl.load(k_ptr + tok * stride_k_tok + offs, mask=ok)
    v = tl.load(v_ptr + tok * stride_v_tok + offs, mask=ok)
    tl.store(k_cache_ptr + slot * ROW + offs, k, mask=ok)
    tl.store(v_cache_ptr + slot * ROW + offs, v, mask=ok)


def write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Same as kv_cache.write_kv_cache, as a one-program-per-token kernel
    (vLLM's reshape_and_cache_flash, minus quantisation and slot -1 skipping).

    Pure data movement: values are stored with the cache's dtype, never
    converted to fp32 in between. Falls back to the torch version when a
    token's [Hkv, D] is not contiguous (e.g. k sliced out of a fused qkv).
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    packed = all(t.stride(2) == 1 and t.stride(1) == head_dim for t in (k, v))
    if not packed or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
        return
    _check_can_run(k)
    with _on_device_of(k):
        _write_kv_kernel[(num_tokens,)](
            k,
            v,
            k_cache,
            v_cache,
            slot_mapping,
            k.stride(0),
            v.stride(0),
            ROW=row,
            ROW_PADDED=_next_pow2(row),
        )
