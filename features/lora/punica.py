"""A batch where every row may run a different adapter: `x W^T + scale_i (x A_i^T) B_i^T`, four ways.

What it is: the one computation LoRA serving adds to a linear layer, for T rows whose adapters are
`idx` [T] (a device slot, or -1 for the base model alone), with every slot's A and B stacked:

    A [S, R, in]   B [S, out, R]   scale [S]   (S slots; R = max_lora_rank: a smaller rank is
                                                zero-padded, and zero rows add nothing)

    delta_loop      the readable one: for each slot present in the batch, its rows x_s, then
                    (x_s A_s^T) B_s^T * scale_s, written back into those rows: one shrink and one
                    expand per adapter in the batch
    delta_gathered  Punica's: each row gathers its own A and B, and two batched matmuls do every row
                    at once (BGMV: "batched gather matrix-vector"; for a decode step, one row per
                    request, exactly Punica's kernel); rows of the base model gather slot 0 and are
                    multiplied by a zero scale

    shrink   [T, in] x [T, in, R] -> [T, R]      expand   [T, R] x [T, R, out] -> [T, out]

`delta_segmented` is SGMV's idea ("segmented gather matrix-vector", Punica's prefill kernel): the
rows grouped by slot, each group one segment (a prefill's rows of one adapter are one), the segments
padded to one length and multiplied in two batched matmuls over the slots present, so each slot's A
and B are read once and every row meets only its own.

`delta_stacked` is a fourth way, what PyTorch's ops do best on a CPU at small ranks: every slot's
shrink for every row in one dense matmul, the other slots' columns zeroed, one dense expand (S times
the multiplications, no gather). (cpu_ops.py's compiled loop, the CPU's default, does better than all
four: the multiplications each row needs and no copies, which no torch op expresses.) The four agree to rounding (tested); the gathered one copies
T x R x (in + out) weights (each row's own A and B), which a GPU kernel (Punica's BGMV, S-LoRA's
MBGMM, triton_ops.py) avoids by reading each row's slot's A and B where they lie.

What it is not: a kernel (triton_ops.py is a GPU's: BGMV's shrink and expand, reading each row's slot
in place instead of gathering copies; cpu_ops.py a CPU's; SGMV as a kernel, tiling each segment with
tl.dot, is not built).

Reference: Chen et al., "Punica: Multi-Tenant LoRA Serving" (MLSys 2024), BGMV and SGMV; Sheng et
al., "S-LoRA" (MLSys 2024); vLLM `vllm/lora/ops/torch_ops/lora_ops.py` (bgmv_shrink, bgmv_expand).
"""

from __future__ import annotations

import torch


def delta_loop(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor, idx: torch.Tensor):
    """x [T, in], A [S, R, in], B [S, out, R], scale [S], idx [T] (-1: none) -> delta [T, out]."""
    out = x.new_zeros(x.shape[0], B.shape[1])
    for s in torch.unique(idx).tolist():
        if s < 0:
            continue
        rows = idx == s  # [T] bool: this adapter's rows
        out[rows] = (x[rows] @ A[s].T) @ B[s].T * scale[s]  # [n, in] -> [n, R] -> [n, out]
    return out


def delta_gathered(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor, idx: torch.Tensor):
    """The same delta, every row at once: each row's own A and B gathered, two batched matmuls."""
    slot = idx.clamp(min=0)  # [T]: the base model's rows read slot 0 ...
    s = torch.where(idx >= 0, scale[slot], torch.zeros_like(scale[slot]))  # [T] ... and scale it by 0
    shrunk = torch.bmm(A[slot], x.unsqueeze(-1)).squeeze(-1)  # [T, R, in] x [T, in, 1] -> [T, R]
    return torch.bmm(B[slot], shrunk.unsqueeze(-1)).squeeze(-1) * s[:, None]  # [T, out, R] x [T, R, 1] -> [T, out]


def delta_stacked(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor, idx: torch.Tensor):
    """The same delta as two dense matmuls over every slot at once, each row keeping only its own slot's
    R columns in between: wasted multiplications (S x R columns where R are used), no gather, no loop.
    What a CPU does best at a small rank and few slots; a GPU kernel gathers instead (BGMV)."""
    S, R, n_in = A.shape
    shrunk = x @ A.reshape(S * R, n_in).T  # [T, in] x [in, S*R] -> [T, S*R]: every slot's shrink
    keep = torch.zeros(x.shape[0], S, dtype=x.dtype, device=x.device)  # [T, S]: the row's slot, times its scale
    rows = torch.nonzero(idx >= 0).squeeze(-1)
    keep[rows, idx[rows]] = scale[idx[rows]]
    shrunk = (shrunk.view(-1, S, R) * keep[:, :, None]).view(-1, S * R)  # other slots' columns zeroed
    return shrunk @ B.permute(1, 0, 2).reshape(B.shape[1], S * R).T  # [T, S*R] x [S*R, out] -> [T, out]


def segments(idx: torch.Tensor, scale: torch.Tensor):
    """idx [T], scale [S] -> the rows grouped by slot, each group padded to the largest (G rows): (slots [U],
    the slots present; rows [U, G], each group's row numbers, a pad repeating its group's first; weight
    [U, G, 1], each row's slot's scale, 0 for a pad). Once per step."""
    on = torch.nonzero(idx >= 0).squeeze(-1)  # [n] rows on some adapter
    slots, counts = torch.unique(idx[on], return_counts=True)  # [U], [U]
    order = on[torch.argsort(idx[on], stable=True)]  # [n] the rows, slot by slot
    G = int(counts.max()) if len(slots) else 0
    start = torch.cumsum(counts, 0) - counts  # [U] where each slot's rows begin in `order`
    pos = torch.arange(G, device=idx.device)  # [G]
    real = pos[None, :] < counts[:, None]  # [U, G]
    rows = order[start[:, None] + torch.where(real, pos[None, :], 0)]  # [U, G]: a pad repeats the first row
    return slots, rows, (scale[slots][:, None] * real)[..., None]


def delta_segmented(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor, idx: torch.Tensor,
                    segs=None, out: torch.Tensor | None = None):  # fmt: skip
    """The same delta with each slot's rows as one segment (SGMV's idea): the segments padded to one length
    and multiplied in two batched matmuls over the slots present, so each row meets only its own slot's
    A and B (no S-fold waste, as stacked has) and each slot's weights are read once (no per-row copy, as
    gathered makes); the results added back into their rows. `segs`: segments(idx, scale), if already
    made; `out` [T, out]: added into (the base projection's output), else a new zero tensor."""
    slots, rows, weight = segments(idx, scale) if segs is None else segs
    out = x.new_zeros(x.shape[0], B.shape[1]) if out is None else out
    if len(slots) == 0:
        return out
    if len(slots) < A.shape[0]:  # only the slots present (with every slot in the step, no gather)
        A, B = A[slots], B[slots]  # [U, R, in], [U, out, R]
    shrunk = torch.bmm(x[rows], A.transpose(1, 2)).mul_(weight)  # [U, G, in] x [U, in, R] -> [U, G, R]
    full = torch.bmm(shrunk, B.transpose(1, 2))  # [U, G, R] x [U, R, out] -> [U, G, out]
    return out.index_add_(0, rows.flatten(), full.flatten(0, 1))  # back into their rows (a pad adds its zeros)


__all__ = ["delta_loop", "delta_gathered", "delta_stacked", "delta_segmented", "segments"]
