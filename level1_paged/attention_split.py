"""Split-KV attention with a fixed split size: the reduction batch invariance needs, in plain torch.

What it is: `paged_attention_split`, attention over the paged cache (the contract of
`attention_ref.py`) computed the way a GPU kernel computes a long decode ("flash decoding",
split-KV): each query row's keys are cut into splits, each split gives a partial result
(its max score m, its sum of exp(s - m), its exp-weighted sum of values), and the partial
results are merged into the row's output:

    keys of row r:   [ 0 ........ S-1 | S ........ 2S-1 | 2S .. n-1 ]     n = context_len + r + 1
    splits:              split 0           split 1         split 2        (S = `split_size`)
    partial j:       m_j = max s,   l_j = sum exp(s - m_j),   a_j = sum exp(s - m_j) v
    merge, left to right:   m = max(m, m_j);  l = l e^(m_old - m) + l_j e^(m_j - m);  a likewise
    out[r] = a / l

Why the split size is fixed: a kernel that picks the number of splits by the work at hand
(more splits for a lone decode, to keep the GPU busy; fewer in a big batch) cuts the same
row's keys differently in different batches, and floating-point addition is not
associative, so the row's bits change with the batch. Cut at fixed key positions (0, S,
2S, ...) and merged in order, a row's result depends only on its own query and keys: a
row at a given position reduces over the same splits in the same order, whether it is a
decode or one row of a longer query. (The Thinking Machines kernels fix the split size
for exactly this; cpu_attention.cpp has no splits at all: one sequential pass per row.)

Every torch op here has shapes that depend only on the row's position and the split size,
so the same row computes the same bits whatever else is in the call.

What it is not: fast (a Python loop over sequences, rows and splits: a reference to read
and test, as `paged_attention_ref` is), or a backend the engine uses.

Reference: Dao et al., "Flash-Decoding for long-context inference" (2023); He, "Defeating
Nondeterminism in LLM Inference" (Thinking Machines, 2025), "fixed split-size strategy".
"""

from __future__ import annotations

import torch

from .attention_ref import _compute_dtype, _gather_sequence_kv

SPLIT_SIZE = 16  # keys per split: fixed, whatever the query length or the batch


def split_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """One split's partial result. q [Hq, D]; k, v [S', Hq, D] (GQA already expanded)
    -> m [Hq], l [Hq], a [Hq, D]: max score, sum of exp(score - m), sum of exp(score - m) * v."""
    s = (q[None] * k).sum(-1).T * scale  # [Hq, S']
    m = s.max(-1).values  # [Hq]
    e = torch.exp(s - m[:, None])  # [Hq, S']
    return m, e.sum(-1), (e[:, :, None] * v.transpose(0, 1)).sum(1)  # [Hq], [Hq], [Hq, D]


def attend_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_keys: int, scale: float, split_size: int):
    """One query row [Hq, D] against its first `num_keys` keys k, v [L, Hq, D] -> [Hq, D]:
    splits of `split_size` keys at fixed positions (0, S, 2S, ...), merged left to right."""
    m = torch.full(q.shape[:1], float("-inf"), dtype=q.dtype)  # [Hq] running max
    l = torch.zeros(q.shape[:1], dtype=q.dtype)  # [Hq] running sum of exp(score - m)
    a = torch.zeros_like(q)  # [Hq, D] running sum of exp(score - m) * v
    for start in range(0, num_keys, split_size):
        end = min(start + split_size, num_keys)
        m_j, l_j, a_j = split_partial(q, k[start:end], v[start:end], scale)
        m_new = torch.maximum(m, m_j)
        old, new = torch.exp(m - m_new), torch.exp(m_j - m_new)  # rescale both to the new max
        l = l * old + l_j * new
        a = a * old[:, None] + a_j * new[:, None]
        m = m_new
    return a / l[:, None]


def paged_attention_split(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale: float,
                          split_size: int = SPLIT_SIZE) -> torch.Tensor:  # fmt: skip
    """The contract of `attention_ref.paged_attention_ref`: q [T, Hq, D] -> [T, Hq, D] in q's dtype."""
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    compute = _compute_dtype(q.dtype)
    out = torch.empty_like(q)  # [T, Hq, D]
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_start, query_len = starts[i], starts[i + 1] - starts[i]
        context_len = seq_len - query_len
        k, v = _gather_sequence_kv(k_cache, v_cache, block_tables[i], seq_len)  # [L, Hkv, D]
        k = k.to(compute).repeat_interleave(num_q_heads // num_kv_heads, dim=1)  # [L, Hq, D]
        v = v.to(compute).repeat_interleave(num_q_heads // num_kv_heads, dim=1)
        for r in range(query_len):  # row r sees keys 0 .. context_len + r
            row = q[q_start + r].to(compute)  # [Hq, D]
            out[q_start + r] = attend_row(row, k, v, context_len + r + 1, scale, split_size).to(q.dtype)
    return out


__all__ = ["SPLIT_SIZE", "attend_row", "paged_attention_split", "split_partial"]
