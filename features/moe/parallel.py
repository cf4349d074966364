"""A mixture of experts on several ranks: expert parallelism beside tensor parallelism.

What it is: the two ways to spread `SparseMoE` (layer.py) over one of level 5's TP groups,
chosen by `enable_expert_parallel`. Attention stays tensor-parallel either way, so every rank
enters the MoE block with the same hidden states x [T, d] and must leave it with the same output.

    TensorParallelMoE   every rank holds 1/tp of *every* expert (rows of gate/up, columns of down),
    (the default)       runs every token through its k experts' slices, and one all-reduce sums
                        the partial outputs: moves activations, T*d per layer, whatever the routing.

    ExpertParallelMoE   every rank holds about E/tp *whole* experts. Each rank takes 1/tp of the tokens,
    (enable_expert_     routes them, and sends each (token, expert) row to the rank that owns the
     parallel=True)     expert (all-to-all: dispatch); that rank runs its experts and sends the rows
                        back (all-to-all: combine); the slices are gathered so that every rank has
                        every token again (all-gather) for the next layer's attention. Moves tokens:
                        about 2*k*d numbers per token to other ranks (and k expert ids), plus the gather.

        rank 0 (experts 0-1)                         rank 1 (experts 2-3)
        tokens 0..T/2: route ──┐                 ┌── tokens T/2..T: route
           rows for 0-1 stay   ├── all-to-all ───┤   rows for 2-3 stay
           rows for 2-3 go ────┘   (dispatch)    └── rows for 0-1 go
        experts 0-1 on what arrived                  experts 2-3 on what arrived
           ... all-to-all back (combine), weighted sum per token, all-gather -> [T, d] on both

Which rank holds which experts is `expert_ranges`, vLLM's `determine_expert_map`: contiguous
ranges of E // tp, the first E % tp ranks one more (5 experts on 2 ranks: 0-2 and 3-4), so any
E works on any tp; the per-rank row counts of the all-to-all are unequal anyway (they follow the
routing). With fewer experts than ranks the last ranks hold none, as in vLLM: they only route
their tokens and send them away (refusing would be one line too, but nothing breaks, so we don't).

The sort by expert and its inverse are layer.py's `dispatch` and `combine`; since each rank's
experts are contiguous, rows sorted by expert are rows sorted by destination rank. A shared
expert (Qwen2-MoE) is sliced like a dense MLP under TP, and replicated under EP (each rank runs
it on its own token slice). Every message is counted in `Comm.stats` (all_to_all: the bytes sent
to other ranks; all_gather: this rank's slice, padded, once per other rank), as the all-reduce is.

What it is not: DeepSeek's DP-attention + EP layout (attention here stays TP, so the tokens
are split only inside the MoE block), expert load balancing or redundant experts (EPLB), or a
fused all-to-all kernel (DeepEP, pplx): per layer, one small all-to-all of row counts, three
plain ones (the rows, their expert ids, the answers back) and an `all_gather`.

Reference: vLLM `model_executor/layers/fused_moe/layer.py` (FusedMoE: expert_map, EP vs TP),
`distributed/device_communicators/all2all.py`; Lepikhin et al. 2020, "GShard" (dispatch and
combine as all-to-alls); Fedus et al. 2021, "Switch Transformers".
"""

from __future__ import annotations

import torch
from torch import nn

from level0_naive.model import MLP
from level5_multigpu.layers import ColumnParallelLinear, MergedColumnParallelLinear, ShardReader, _split
from level5_multigpu.parallel_state import Comm

from .layer import combine, dispatch, moe_grouped, route, run_sorted


class ExpertSlice(MLP):
    """One expert's SwiGLU on this rank's slice of its features: the *partial* output (the block
    sums every expert's partials with one all-reduce, not one per expert)."""

    def __init__(self, gate_up: MergedColumnParallelLinear, down: ColumnParallelLinear):
        nn.Module.__init__(self)  # not MLP.__init__: that would build the full-size projections
        self.gate_up, self.down_proj = gate_up, down  # [2 ff/tp, d], [d, ff/tp]
        self.ops = gate_up.ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # [n, ff/tp] each
        return self.down_proj(self.ops.silu_mul(gate, up))  # [n, d], partial


def load_slice(reader: ShardReader, prefix: str, size: int, tp: int, r: int) -> ExpertSlice:
    down = reader.read(f"{prefix}.down_proj.weight", cols=_split(size, tp, r))  # [d, size/tp]
    return ExpertSlice(MergedColumnParallelLinear.load(reader, prefix, size, tp, r), ColumnParallelLinear(down, None))


def load_whole(reader: ShardReader, prefix: str, size: int) -> ExpertSlice:
    """A whole expert (a 1-rank slice of it): what expert parallelism places on a rank."""
    return load_slice(reader, prefix, size, 1, 0)


def replicated(reader: ShardReader, name: str) -> ColumnParallelLinear:
    return ColumnParallelLinear(reader.read(name), None)  # a small matrix every rank holds whole


class TensorParallelMoE(nn.Module):
    """Every expert sliced over the TP ranks; one all-reduce per block."""

    def __init__(self, cfg, reader: ShardReader, prefix: str, comm: Comm):
        super().__init__()
        tp, r = comm.topo.tp, comm.topo.tp_rank
        self.comm, self.top_k, self.normalize = comm, cfg.moe.num_experts_per_tok, cfg.moe.norm_topk_prob
        self.gate = replicated(reader, f"{prefix}.gate.weight")  # the router [E, d], on every rank
        self.experts = nn.ModuleList(load_slice(reader, f"{prefix}.experts.{e}", cfg.moe.moe_intermediate_size, tp, r)
                                     for e in range(cfg.moe.num_experts))  # fmt: skip
        if cfg.moe.shared_expert_intermediate_size:
            self.shared_expert = load_slice(reader, f"{prefix}.shared_expert", cfg.moe.shared_expert_intermediate_size, tp, r)
            self.shared_expert_gate = replicated(reader, f"{prefix}.shared_expert_gate.weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.normalize, x.dtype)  # [T, k] each, the same on every rank
        out = moe_grouped(x, weights, ids, self.experts)  # [T, d], this rank's partial sum
        if hasattr(self, "shared_expert"):  # sigmoid(g) * (sum of partials) = sum of sigmoid(g) * partial
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.comm.all_reduce(out, kind="moe_all_reduce")


def expert_ranges(num_experts: int, ranks: int) -> list[range]:
    """Each EP rank's experts, as vLLM's `determine_expert_map` places them: contiguous ranges of
    E // ranks, the first E % ranks ranks one more. (5, 2) -> [0-2, 3-4]; (8, 3) -> [0-2, 3-5, 6-7];
    (2, 3) -> [0, 1, none]. Contiguous, so experts sorted by id are experts sorted by their rank."""
    sizes = [num_experts // ranks + (q < num_experts % ranks) for q in range(ranks)]
    starts = [sum(sizes[:q]) for q in range(ranks)]
    return [range(s, s + n) for s, n in zip(starts, sizes)]


class ExpertParallelMoE(nn.Module):
    """About E/tp whole experts per rank (`expert_ranges`); tokens go to their experts' ranks and back."""

    def __init__(self, cfg, reader: ShardReader, prefix: str, comm: Comm):
        super().__init__()
        tp, r = comm.topo.tp, comm.topo.tp_rank
        self.comm, self.top_k, self.normalize = comm, cfg.moe.num_experts_per_tok, cfg.moe.norm_topk_prob
        self.num_experts = cfg.moe.num_experts
        self.held = expert_ranges(self.num_experts, tp)  # every rank's experts (each rank knows the whole map)
        self.first = self.held[r].start  # this rank's experts: held[r] = [first, first + len(experts))
        self.gate = replicated(reader, f"{prefix}.gate.weight")
        self.experts = nn.ModuleList(load_whole(reader, f"{prefix}.experts.{e}", cfg.moe.moe_intermediate_size)
                                     for e in self.held[r])  # fmt: skip
        if cfg.moe.shared_expert_intermediate_size:
            self.shared_expert = load_whole(reader, f"{prefix}.shared_expert", cfg.moe.shared_expert_intermediate_size)
            self.shared_expert_gate = replicated(reader, f"{prefix}.shared_expert_gate.weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        comm, tp, r = self.comm, self.comm.topo.tp, self.comm.topo.tp_rank
        T = x.shape[0]
        sizes = [T // tp + (q < T % tp) for q in range(tp)]  # tokens per rank (a decode of 1: [1, 0])
        xs = x[sum(sizes[:r]) : sum(sizes[: r + 1])]  # [t, d], this rank's tokens
        weights, ids = route(self.gate(xs), self.top_k, self.normalize, x.dtype)  # [t, k]
        order, counts = dispatch(ids, self.num_experts)  # slots sorted by expert = by owner rank; counts [E]
        per_rank = [sum(counts[h.start : h.stop]) for h in self.held]  # rows for each rank (0 for one with none)
        rows, experts = xs[order // self.top_k], ids.reshape(-1)[order]  # [t*k, d], [t*k]
        # dispatch: each row to its expert's rank; what arrives is grouped by source rank
        incoming = comm.exchange_counts(per_rank)
        got = comm.all_to_all(list(rows.split(per_rank)), incoming)  # [n, d]
        got_experts = comm.all_to_all(list(experts.split(per_rank)), incoming) - self.first  # [n], local ids
        # this rank's experts, one matmul each, over the rows sorted by (local) expert
        local_order, local_counts = dispatch(got_experts[:, None], len(self.experts))
        out = torch.empty_like(got)  # [n, d], back in arrival order
        out[local_order] = run_sorted(got[local_order], local_counts, self.experts)
        # combine: every row back to the rank it came from, in the order it was sent
        back = comm.all_to_all(list(out.split(incoming)), per_rank)  # [t*k, d], in `order`
        ys = combine(back, order, weights, xs.shape[0])  # [t, d]
        if hasattr(self, "shared_expert"):
            ys = ys + torch.sigmoid(self.shared_expert_gate(xs)) * self.shared_expert(xs)
        return comm.all_gather_rows(ys, sizes)  # [T, d] on every rank
