"""A sparse mixture of experts: the MLP of Mixtral, Qwen2-MoE and Qwen3-MoE.

What it is: `SparseMoE`, the block that replaces a layer's MLP in those checkpoints,

    x [T, d] ──> router (gate: d -> E logits) ──> softmax ──> top-k experts per token, their weights
             ──> each token through its k experts (SwiGLU MLPs of their own) ──> the weighted sum
             (+ Qwen2-MoE: a shared expert every token takes, scaled by sigmoid(shared_expert_gate(x)))

and the two ways of running the experts, kept side by side and tested equal:

    moe_naive     for every token, for each of its k experts: one tiny matmul (T*k of them)
    moe_grouped   the T*k (token, expert) slots sorted by expert (`dispatch`), one matmul per
                  expert over its contiguous rows, then each row weighted and added back to its
                  token (`combine`): E matmuls whatever T is

`dispatch` and `combine` are also what expert parallelism sends over the network (level 5's
ranks: `parallel.py`): rows sorted by expert are rows sorted by the rank that owns it.

Routing follows the checkpoints' own code (transformers' `*TopKRouter`): the softmax and the
top-k in float32 whatever the model's dtype, the k weights renormalised to sum to 1 when the
checkpoint says so (`norm_topk_prob`; Mixtral always does), then cast to the model's dtype.
`torch.topk` breaks ties as Hugging Face's does, because it is the same call on the same values.

What it is not: an expert-capacity limit or token dropping (training-time devices: at inference
every token reaches its k experts), a load-balancing loss, or a fused kernel.

Reference: Shazeer et al. 2017 (sparsely-gated MoE); Jiang et al. 2024, "Mixtral of Experts";
transformers `modeling_mixtral.py`, `modeling_qwen2_moe.py`, `modeling_qwen3_moe.py`; vLLM
`model_executor/layers/fused_moe` (moe_align_block_size: the same sort by expert).
"""

from __future__ import annotations

import torch
from torch import nn


def route(logits: torch.Tensor, k: int, normalize: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> weights [T, k] (in `dtype`), expert ids [T, k]: each token's k experts."""
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E], float32 as the checkpoints' code does
    weights, ids = torch.topk(probs, k, dim=-1)  # [T, k] each, the most probable first
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


def dispatch(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """ids [T, k] -> order [T*k], counts [E]: the slots (token t's j-th choice is slot t*k + j) sorted
    by expert, and how many each expert gets. Slot order[i] is the i-th row of the sorted batch;
    its token is order[i] // k. Stable: within one expert, tokens keep their order."""
    flat = ids.reshape(-1)  # [T*k]
    order = torch.argsort(flat, stable=True)  # [T*k]
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # [E]
    return order, counts


def combine(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """rows [T*k, d] (the experts' outputs, in `order`'s sorted order) -> out [T, d]: each row scaled by
    its slot's weight and added to its token (the inverse of `dispatch`)."""
    k = weights.shape[1]
    scaled = rows * weights.reshape(-1)[order].unsqueeze(1)  # [T*k, d]
    out = torch.zeros(num_tokens, rows.shape[1], dtype=rows.dtype, device=rows.device)  # [T, d]
    return out.index_add_(0, order // k, scaled)


def run_sorted(rows: torch.Tensor, counts: list[int], experts: nn.ModuleList) -> torch.Tensor:
    """rows [n, d] sorted by expert (counts[e] of them for expert e, in order) -> each through its expert:
    one matmul per expert over contiguous rows (level 5's expert parallelism runs its own experts so too)."""
    out = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n:  # an expert no token chose costs nothing
            out[start : start + n] = experts[e](rows[start : start + n])
            start += n
    return out


def moe_grouped(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
    """x [T, d], weights/ids [T, k] -> [T, d]: one matmul per expert over its rows."""
    order, counts = dispatch(ids, len(experts))
    rows = x[order // ids.shape[1]]  # [T*k, d], sorted by expert
    return combine(run_sorted(rows, counts, experts), order, weights, x.shape[0])


def moe_naive(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
    """The same sum, one token and one expert at a time: the definition, for the tests and the benchmark."""
    out = torch.zeros_like(x)  # [T, d]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            out[t] += weights[t, j] * experts[int(ids[t, j])](x[t : t + 1])[0]
    return out


class SparseMoE(nn.Module):
    """The MoE block; parameter names are Qwen-MoE's (the loader renames Mixtral's w1/w3/w2 to them)."""

    def __init__(self, cfg, expert_mlp: type, linear: type):
        """`cfg`: level 0's ModelConfig, its mixture in `cfg.moe` (config.py); `expert_mlp(cfg, intermediate_size)`
        and `linear(in, out, bias)`: model.py's MLP and Linear, so that every matmul goes through the ops seam
        as the rest of the model's do."""
        super().__init__()
        m = cfg.moe
        self.num_experts, self.top_k, self.normalize = m.num_experts, m.num_experts_per_tok, m.norm_topk_prob
        self.gate = linear(cfg.hidden_size, m.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(expert_mlp(cfg, m.moe_intermediate_size) for _ in range(m.num_experts))
        if m.shared_expert_intermediate_size:  # Qwen2-MoE: one more expert that every token takes
            self.shared_expert = expert_mlp(cfg, m.shared_expert_intermediate_size)
            self.shared_expert_gate = linear(cfg.hidden_size, 1, bias=False)
        self.grouped = True  # False: moe_naive (the benchmark compares the two)
        self.last_ids: torch.Tensor | None = None  # the last forward's routing [T, k], for the routing picture

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] -> weights [T, k], ids [T, k]."""
        return route(self.gate(x), self.top_k, self.normalize, x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)  # [T, k] each
        self.last_ids = ids
        out = (moe_grouped if self.grouped else moe_naive)(x, weights, ids, self.experts)  # [T, d]
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
