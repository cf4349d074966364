"""Paged attention in plain PyTorch: the oracle and the CPU backend.

What this is
    Two functions over level 1's paged KV cache (the cache write that comes before them is
    ``kv_cache.write_kv_cache``):

    * ``paged_attention_ref``   -- the oracle: one sequence at a time, gather its
                                   blocks, repeat KV heads for GQA, mask, softmax.
                                   Written to be read, not to be fast;
    * ``paged_attention_torch`` -- the CPU default backend: the same contract,
                                   about 3x faster (a cache-friendly gather, no
                                   GQA copies, SDPA for multi-token queries).

    ``level1_paged/triton_attention.py`` holds the Triton kernel; the tests check
    kernel == ref == torch backend, and the ref against dense causal attention.

What this deliberately is not
    Not a fused kernel (that is the Triton file), no sliding windows, ALiBi,
    soft-capping, sinks or quantised KV, and no split-KV ("flash decoding").

The reference it follows
    Kwon et al., "Efficient Memory Management for Large Language Model Serving
    with PagedAttention" (SOSP 2023), section 4.1; the flattened-batch metadata
    (``query_start_loc``, ``seq_lens``, ``block_tables``, ``slot_mapping``) of
    vLLM V1's ``vllm/v1/attention/backends/``.

The contract shared by every backend
    B sequences, T query tokens in all, cache ``[N, bs, Hkv, D]`` per layer::

        q               [T, Hq, D]    queries of every sequence, concatenated
        query_start_loc [B+1] int32   seq i's queries are rows qsl[i]:qsl[i+1]
        seq_lens        [B] int32     context INCLUDING the new query tokens,
                                      whose K/V are already in the cache
        block_tables    [B, max_blk]  logical block j of seq i is physical block
                        int32         block_tables[i, j]; entries past the end
                                      of a sequence are padding, never keys
        slot_mapping    [T] int64     flat slot (block * bs + offset) per token

    Causal rule: with ``context_len = seq_len - query_len``, query token
    ``q_pos`` (0-based within its sequence's query) sees key positions
    ``k_pos <= context_len + q_pos``. GQA: query head ``h`` reads KV head
    ``h // (Hq // Hkv)``. A query of any length may follow any context:
    levels 2 to 4 send prefill chunks, prefix-cache hits and verifications.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["paged_attention_ref", "paged_attention_torch"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax precision: float64 stays float64 (the engine's exact-equality
    tests run in float64), everything else is done in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _gather_sequence_kv(k_cache, v_cache, table_row, seq_len: int):
    """The first seq_len keys and values of one sequence, in logical order.

    table_row: [max_blk] physical block ids. Returns k, v: [seq_len, Hkv, D].
    Only the ceil(seq_len / bs) blocks the sequence owns are read, so padding
    entries in the table are never touched.
    """
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_blocks = -(-seq_len // block_size)
    blocks = table_row[:num_blocks].long()  # [nblk]
    k = k_cache[blocks].reshape(num_blocks * block_size, num_kv_heads, head_dim)[:seq_len]  # [L, Hkv, D]
    v = v_cache[blocks].reshape(num_blocks * block_size, num_kv_heads, head_dim)[:seq_len]  # [L, Hkv, D]
    return k, v


def paged_attention_ref(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale: float) -> torch.Tensor:
    """The oracle: attention over the paged cache, one sequence at a time.

    Same contract as the module docstring; returns [T, Hq, D] in q.dtype.
    Softmax in float32 (float64 for float64 inputs).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads  # query heads per KV head
    compute = _compute_dtype(q.dtype)
    out = torch.empty_like(q)  # [T, Hq, D]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i in range(len(lens)):
        q_start, q_end = starts[i], starts[i + 1]
        query_len, seq_len = q_end - q_start, lens[i]
        if query_len == 0:
            continue
        context_len = seq_len - query_len  # keys that were cached before this step
        k, v = _gather_sequence_kv(k_cache, v_cache, block_tables[i], seq_len)  # [L, Hkv, D]
        k = k.to(compute).repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.to(compute).repeat_interleave(group, dim=1)  # [L, Hq, D]
        qi = q[q_start:q_end].to(compute)  # [Lq, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale  # [Hq, Lq, L]
        q_pos = torch.arange(query_len, device=q.device)[:, None]  # [Lq, 1]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]  # [1, L]
        visible = k_pos <= context_len + q_pos  # [Lq, L]; row r sees r + context_len + 1 keys
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [Hq, Lq, L]
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)  # [Lq, Hq, D]
    return out


def _decode_attention(q, k, v, scale: float):
    """One sequence's single query token against its gathered context.

    q: [Hq, D]; k, v: [L, Hkv, D] (in the compute dtype). Returns [Hq, D].
    A decode token is the last position, so it sees every key: no mask.

    The GQA grouping is a view, not a copy: q becomes [Hkv, G, D] and k is
    read through the strided view [Hkv, D, L], which BLAS takes as a
    transposed matrix with leading dimension Hkv * D. (repeat_interleave, as
    in the oracle, would copy K and V G times.)
    """
    num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    qg = q.reshape(num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # [Hkv, G, D]
    scores = torch.matmul(qg, k.permute(1, 2, 0)) * scale  # [Hkv, G, L]
    probs = torch.softmax(scores, dim=-1)  # [Hkv, G, L]
    return torch.matmul(probs, v.transpose(0, 1)).reshape(num_q_heads, head_dim)  # [Hq, D]


SHORT_QUERY = 16  # queries up to this long skip SDPA (its fixed cost dominates them)


def _short_query_attention(q, k, v, context_len: int, scale: float):
    """A few query tokens (up to SHORT_QUERY) against the context that precedes them.

    q: [Lq, Hq, D]; k, v: [L, Hkv, D] (compute dtype). Returns [Lq, Hq, D]. The decode
    path's copy-free GQA matmuls with Lq * G rows per KV head instead of G, and an explicit
    causal mask offset by the context. Measured here (2-core EPYC, fp32, 6M model), SDPA
    with a boolean mask cost about 3x this for 5 query tokens: for short queries its fixed
    cost dominates.
    """
    query_len, num_q_heads, head_dim = q.shape
    seq_len, num_kv_heads, _ = k.shape
    G = num_q_heads // num_kv_heads
    qg = q.reshape(query_len, num_kv_heads, G, head_dim).transpose(0, 1).reshape(num_kv_heads, query_len * G, head_dim)  # [Hkv, Lq*G, D]
    scores = torch.matmul(qg, k.permute(1, 2, 0)) * scale  # [Hkv, Lq*G, L]
    q_pos = torch.arange(query_len, device=q.device).repeat_interleave(G)[:, None]  # [Lq*G, 1]: row r is query r // G
    hidden = torch.arange(seq_len, device=q.device)[None, :] > context_len + q_pos  # [Lq*G, L]: keys in the future
    probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)  # [Hkv, Lq*G, L]
    out = torch.matmul(probs, v.transpose(0, 1))  # [Hkv, Lq*G, D]
    return out.reshape(num_kv_heads, query_len, G, head_dim).transpose(0, 1).reshape(query_len, num_q_heads, head_dim)


def _prefill_attention(q, k, v, context_len: int, scale: float):
    """One sequence's multi-token query against its gathered context (which
    may hold keys before the query's first position).

    q: [Lq, Hq, D]; k, v: [L, Hkv, D] (already in the compute dtype).
    Returns [Lq, Hq, D].

    SDPA's own ``is_causal`` aligns the mask top-left (query row r sees keys
    0..r), which is only right when L == Lq; our query sits at the END of the
    context, so the mask is built explicitly, offset by context_len.
    """
    query_len, num_q_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    q_pos = torch.arange(query_len, device=q.device)[:, None]  # [Lq, 1]
    k_pos = torch.arange(seq_len, device=q.device)[None, :]  # [1, L]
    visible = k_pos <= context_len + q_pos  # [Lq, L]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),  # [Hq, Lq, D]
        k.transpose(0, 1),  # [Hkv, L, D]
        v.transpose(0, 1),  # [Hkv, L, D]
        attn_mask=visible,
        scale=scale,
        enable_gqa=num_q_heads != num_kv_heads,
    )  # [Hq, Lq, D]
    return out.transpose(0, 1)


def paged_attention_torch(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale: float) -> torch.Tensor:
    """The CPU default backend: same contract and result as paged_attention_ref.

    One pass per sequence: gather its blocks with one index_select (whole
    blocks, bs * Hkv * D contiguous values each), then a decode (query length
    1) goes through two copy-free matmuls, a short query (up to SHORT_QUERY
    tokens) through the same matmuls with a causal mask, and a longer one
    through scaled_dot_product_attention with a causal mask offset by the
    context.

    Why a loop and not one padded batch for all decodes: measured on a 2-core
    EPYC (docs/level1_kernel.md), gathering every decode's context into one
    [B, max_ctx, Hkv, D] tensor writes and re-reads tens of megabytes through
    DRAM, while one sequence's K and V (L * Hkv * D values, ~600 KB at
    L = 600, Hkv = 4, D = 64, fp32) stay in L2 between the gather and the
    matmuls. The loop was 2x faster than the best vectorised variant at every
    size tried (16..256 sequences, 100..2000 context), and the gather itself,
    reading the cache from memory once, is most of what is left.
    """
    compute = _compute_dtype(q.dtype)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    block_size = k_cache.shape[1]
    # Per-call overhead is what a CPU pays here (a decode is a few microseconds of math),
    # so: host lists once, no dtype casts that would be no-ops, outputs concatenated once.
    cast = (lambda x: x) if compute == q.dtype else (lambda x: x.to(compute))
    tables = block_tables.long()
    starts = query_start_loc.tolist()
    pieces = []
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[i], starts[i + 1]
        query_len = q_end - q_start
        if query_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = tables[i, :num_blocks]  # [nblk]; padding entries never read
        k = cast(
            k_cache.index_select(0, blocks).view(num_blocks * block_size, num_kv_heads, head_dim)[:seq_len]
        )  # [L, Hkv, D]
        v = cast(
            v_cache.index_select(0, blocks).view(num_blocks * block_size, num_kv_heads, head_dim)[:seq_len]
        )  # [L, Hkv, D]
        if query_len == 1:
            pieces.append(_decode_attention(cast(q[q_start]), k, v, scale)[None])  # [1, Hq, D]
        elif query_len <= SHORT_QUERY:
            pieces.append(_short_query_attention(cast(q[q_start:q_end]), k, v, seq_len - query_len, scale))  # [Lq, Hq, D]
        else:
            pieces.append(_prefill_attention(cast(q[q_start:q_end]), k, v, seq_len - query_len, scale))  # [Lq, Hq, D]
    if not pieces:
        return torch.empty_like(q)
    return torch.cat(pieces).to(q.dtype)  # [T, Hq, D]
