"""Paged attention in plain PyTorch: the KV-cache write, the oracle, the CPU backend.

What this is
    Three functions over level 1's paged KV cache:

    * ``write_kv_cache``        -- scatter the new tokens' K/V into their slots;
    * ``paged_attention_ref``   -- the oracle: one sequence at a time, gather its
                                   blocks, repeat KV heads for GQA, mask, softmax.
                                   Written to be read, not to be fast;
    * ``paged_attention_torch`` -- the CPU default backend: the same contract,
                                   with every decode row of the batch done in one
                                   vectorised pass.

    ``level1_paged/triton_attention.py`` holds the Triton kernel; the tests check
    kernel == ref == torch backend, and the ref against dense causal attention.

What this deliberately is not
    Not a fused kernel (that is the Triton file), no sliding windows, ALiBi,
    soft-capping, sinks or quantised KV, and no split-KV ("flash decoding").

The reference it follows
    Kwon et al., "Efficient Memory Management for Large Language Model Serving
    with PagedAttention" (SOSP 2023), section 4.1; the flattened-batch metadata
    (``query_start_loc``, ``seq_lens``, ``block_tables``, ``slot_mapping``) of
    vLLM V1's ``vllm/v1/attention/backends/`` and the cache write of vLLM's
    ``reshape_and_cache_flash``.

The contract shared by all three backends
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
    ``h // (Hq // Hkv)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["write_kv_cache", "paged_attention_ref", "paged_attention_torch"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax precision: float64 stays float64 (the engine's exact-equality
    tests run in float64), everything else is done in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write the new tokens' keys and values into their cache slots, in place.

    k, v: [T, Hkv, D]; k_cache, v_cache: [N, bs, Hkv, D] (contiguous, same dtype
    as k and v); slot_mapping: [T] int64 with every entry in [0, N * bs).
    Only the T named slots change. There is no "-1 means skip" convention
    (vLLM uses one for padded CUDA-graph tokens): a negative slot would wrap
    around in torch indexing, so the caller must not produce one.
    """
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    # A slot is (block, offset) flattened; viewing the cache as one long row of
    # slots turns the scatter into a single indexed copy.
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slot_mapping] = k  # [N*bs, Hkv, D]
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slot_mapping] = v  # [N*bs, Hkv, D]


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


def paged_attention_ref(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                        scale: float) -> torch.Tensor:
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


# Keys per chunk in the decode pass: big enough that each matmul amortises the
# Python and dispatch overhead, small enough that a chunk of gathered K or V
# (B * 128 * Hkv * D values) stays near the CPU caches before it is used.
_DECODE_CHUNK_TOKENS = 128


def _decode_attention(q, k_cache, v_cache, seq_lens, block_tables, scale: float):
    """All decode rows (one query token each) together.

    q: [Bd, Hq, D]; seq_lens: [Bd]; block_tables: [Bd, max_blk]. Returns
    [Bd, Hq, D] in the compute dtype.

    Every sequence is padded to the longest one (Lp keys, a whole number of
    blocks) and the padding is masked out of the softmax. Two passes over the
    keys, in chunks of whole blocks: scores for every chunk, one softmax over
    the whole padded row, then probabilities times values. A chunk is gathered
    with one index_select of whole blocks (bs * Hkv * D contiguous values
    each), which is much cheaper than a per-token gather.
    """
    num_seqs, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    compute = _compute_dtype(q.dtype)
    max_len = int(seq_lens.max())
    num_blocks = -(-max_len // block_size)
    padded_len = num_blocks * block_size  # Lp
    blk = torch.arange(num_blocks, device=q.device)  # [nblk]
    owned = blk[None, :] * block_size < seq_lens[:, None]  # [Bd, nblk] blocks the seq really has
    # Padding entries may hold anything; point them at block 0 so the gather
    # stays in bounds. Their keys are masked below, so block 0's content never
    # reaches the output.
    tables = torch.where(owned, block_tables[:, :num_blocks].long(), 0)  # [Bd, nblk]
    key_pos = torch.arange(padded_len, device=q.device)  # [Lp]
    valid = key_pos[None, :] < seq_lens[:, None]  # [Bd, Lp]; a decode row sees its whole context

    qg = (q.to(compute) * scale).view(num_seqs, num_kv_heads, group, head_dim)  # [Bd, Hkv, G, D]
    scores = torch.empty(num_seqs, num_kv_heads, group, padded_len, dtype=compute, device=q.device)  # [Bd, Hkv, G, Lp]
    chunk = max(1, _DECODE_CHUNK_TOKENS // block_size)  # blocks per chunk
    for j0 in range(0, num_blocks, chunk):
        j1 = min(num_blocks, j0 + chunk)
        n = (j1 - j0) * block_size
        kc = k_cache.index_select(0, tables[:, j0:j1].reshape(-1))  # [Bd*(j1-j0), bs, Hkv, D]
        kc = kc.view(num_seqs, n, num_kv_heads, head_dim).to(compute)  # [Bd, n, Hkv, D]
        torch.matmul(qg, kc.permute(0, 2, 3, 1), out=scores[..., j0 * block_size:j0 * block_size + n])
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [Bd, Hkv, G, Lp]; every row has >= 1 valid key
    out = torch.zeros(num_seqs, num_kv_heads, group, head_dim, dtype=compute, device=q.device)  # [Bd, Hkv, G, D]
    for j0 in range(0, num_blocks, chunk):
        j1 = min(num_blocks, j0 + chunk)
        n = (j1 - j0) * block_size
        vc = v_cache.index_select(0, tables[:, j0:j1].reshape(-1))  # [Bd*(j1-j0), bs, Hkv, D]
        vc = vc.view(num_seqs, n, num_kv_heads, head_dim).to(compute)  # [Bd, n, Hkv, D]
        out += torch.matmul(probs[..., j0 * block_size:j0 * block_size + n], vc.transpose(1, 2))
    return out.view(num_seqs, num_q_heads, head_dim)


def _prefill_attention(q, k, v, context_len: int, scale: float):
    """One sequence's multi-token query (a prefill chunk, a prefix-cache hit,
    a speculative verification) against its gathered context.

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


def paged_attention_torch(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                          scale: float) -> torch.Tensor:
    """The CPU default backend: same contract and result as paged_attention_ref.

    Decode rows (query length 1) of ALL sequences go through one vectorised
    pass (``_decode_attention``); longer queries go one sequence at a time
    through ``scaled_dot_product_attention`` with a causal mask offset by the
    context length. A flattened batch in the engine is mostly decodes, so the
    vectorised pass is where the time goes.
    """
    compute = _compute_dtype(q.dtype)
    out = torch.empty_like(q)  # [T, Hq, D]
    starts = query_start_loc.tolist()
    query_lens = [starts[i + 1] - starts[i] for i in range(len(starts) - 1)]
    decode = [i for i, n in enumerate(query_lens) if n == 1]
    if decode:
        dec = torch.tensor(decode, device=q.device)  # [Bd] sequence ids
        rows = query_start_loc[:-1].long()[dec]  # [Bd] token row of each decode
        out[rows] = _decode_attention(q[rows], k_cache, v_cache, seq_lens[dec],
                                      block_tables[dec], scale).to(q.dtype)
    lens = seq_lens.tolist()
    for i, query_len in enumerate(query_lens):
        if query_len <= 1:
            continue
        k, v = _gather_sequence_kv(k_cache, v_cache, block_tables[i], lens[i])  # [L, Hkv, D]
        qi = q[starts[i]:starts[i + 1]].to(compute)  # [Lq, Hq, D]
        oi = _prefill_attention(qi, k.to(compute), v.to(compute), lens[i] - query_len, scale)
        out[starts[i]:starts[i + 1]] = oi.to(q.dtype)
    return out
