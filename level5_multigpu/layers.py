"""Tensor-parallel layers, Megatron style, and the reader that loads only this rank's slices.

What it is: the five linear-ish layers a Llama needs to run on `tp` ranks at once, each
holding 1/tp of its weight, and `ShardReader`, which reads a slice of a tensor straight
from the safetensors file (`get_slice`), so no rank ever holds a whole weight.

    ColumnParallelLinear   W [out, in] split by rows (outputs):  y_r = x @ W_r^T   no communication
    RowParallelLinear      W [out, in] split by columns (inputs): y = sum_r x_r @ W_r^T (all-reduce),
                           then + bias, added once (after the sum, not on every rank)

    one MLP on 2 ranks:    x ──> [gate|up]_r (column) ──> silu(gate_r) * up_r ──> down_r (row) ──> all-reduce ──> y
    one attention layer:   x ──> [q|k|v]_r by heads (column) ──> attention over this rank's heads
                                   ──> o_r (row) ──> all-reduce ──> y          (two all-reduces per layer)

  - `QKVParallelLinear`: q, k and v in one matmul; rank r owns query heads
    [r*Hq/tp, (r+1)*Hq/tp) and the KV heads they read. With fewer KV heads than ranks
    each KV head is replicated on tp/Hkv ranks (vLLM's rule), so every rank still has
    the K and V its query heads need.
  - `MergedColumnParallelLinear`: gate and up in one matmul, sharded per segment: rank
    r's weight is [gate rows of r; up rows of r], so silu(gate) * up stays local.
  - `VocabParallelEmbedding`: the vocabulary, padded to a multiple of tp, split in
    ranges; each rank embeds the ids in its range (zeros elsewhere) and an all-reduce
    sums the pieces. `ParallelLMHead`: the same split of the output projection; the
    logits' vocabulary shards are gathered on TP rank 0 only (the sampler's rank).

What it is not: sequence parallelism (the norms run replicated; an exercise), or fused
kernels. Every layer's forward is two lines, and its matmul is `self.ops.linear`: level
0's ops seam (`level0_naive/ops.py`), which `StageModel.set_ops` swaps for every layer.

Reference: Shoeybi et al., "Megatron-LM" (2019), section 3 and figure 3; vLLM
`model_executor/layers/linear.py` and `vocab_parallel_embedding.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from level0_naive.loader import checkpoint_name, tensor_files
from level0_naive.ops import DEFAULT_OPS

from .parallel_state import Comm


class ShardReader:
    """Reads slices of named tensors from a checkpoint's safetensors files (never a whole weight
    unless asked for one)."""

    def __init__(self, path: Path, dtype: torch.dtype, device):
        self.files = tensor_files(path)  # name -> its file
        self.dtype, self.device = dtype, device

        # Names are the model's (level 0's); a checkpoint that names some tensors its own way (Mixtral's
        # experts) is read under its names.
        self.model_type = json.loads((path / "config.json").read_text()).get("model_type", "")

    def has(self, name: str) -> bool:
        return checkpoint_name(name, self.model_type) in self.files

    def read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        name = checkpoint_name(name, self.model_type)
        with safe_open(self.files[name], "pt") as f:
            s = f.get_slice(name)
            if rows is not None:
                t = s[rows[0] : rows[1]]
            elif cols is not None:
                t = s[:, cols[0] : cols[1]]
            else:
                t = s[:]
        return t.to(dtype=self.dtype, device=self.device)


def _split(n: int, tp: int, rank: int) -> tuple[int, int]:
    if n % tp:
        raise ValueError(f"{n} does not divide by tensor_parallel_size={tp}")
    return rank * n // tp, (rank + 1) * n // tp


class ColumnParallelLinear(nn.Module):
    """y_r = x @ W_r^T (+ b_r): this rank's rows (outputs) of W. No communication."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out/tp, in]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.ops = DEFAULT_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias)  # [T, out/tp]


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r @ W_r^T) + b: this rank's columns (inputs) of W; the bias once, after the sum."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in/tp]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.comm, self.ops = comm, DEFAULT_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of y: x_r [T, in/tp] -> [T, out] (a LoRA delta's share joins it here: features/lora)."""
        return self.ops.linear(x, self.weight)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The ranks' shares summed, then the bias once."""
        y = self.comm.all_reduce(y)  # [T, out], summed over ranks
        return y if self.bias is None else y + self.bias


def kv_heads_of_rank(num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """[first, last) KV heads rank `rank` holds: a split when there are enough, else one head,
    replicated on tp / num_kv_heads consecutive ranks."""
    if num_kv_heads >= tp:
        return _split(num_kv_heads, tp, rank)
    if tp % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} must be a multiple of num_key_value_heads={num_kv_heads}")
    head = rank // (tp // num_kv_heads)
    return head, head + 1


class QKVParallelLinear(ColumnParallelLinear):
    """[q | k | v] of this rank's heads in one matmul; `sizes` cut the output back into three."""

    @classmethod
    def load(cls, reader: ShardReader, prefix: str, cfg, tp: int, rank: int) -> QKVParallelLinear:
        d = cfg.head_dim
        q0, q1 = _split(cfg.num_heads, tp, rank)
        k0, k1 = kv_heads_of_rank(cfg.num_kv_heads, tp, rank)
        rows = {"q_proj": (q0 * d, q1 * d), "k_proj": (k0 * d, k1 * d), "v_proj": (k0 * d, k1 * d)}
        weight = torch.cat([reader.read(f"{prefix}.{n}.weight", rows=r) for n, r in rows.items()])
        bias = None
        if reader.has(f"{prefix}.q_proj.bias"):
            bias = torch.cat([reader.read(f"{prefix}.{n}.bias", rows=r) for n, r in rows.items()])
        layer = cls(weight, bias)
        layer.sizes = ((q1 - q0) * d, (k1 - k0) * d, (k1 - k0) * d)  # its output's q, k and v columns
        return layer


class MergedColumnParallelLinear(ColumnParallelLinear):
    """[gate rows of this rank ; up rows of this rank]: sharded per segment, so each rank's half
    of the intermediate features is complete (gate and up for the same features)."""

    @classmethod
    def load(cls, reader: ShardReader, prefix: str, size: int, tp: int, rank: int) -> MergedColumnParallelLinear:
        r = _split(size, tp, rank)
        weight = torch.cat(
            [reader.read(f"{prefix}.gate_proj.weight", rows=r), reader.read(f"{prefix}.up_proj.weight", rows=r)]
        )
        bias = None
        if reader.has(f"{prefix}.gate_proj.bias"):
            bias = torch.cat(
                [reader.read(f"{prefix}.gate_proj.bias", rows=r), reader.read(f"{prefix}.up_proj.bias", rows=r)]
            )
        return cls(weight, bias)  # [2 * size/tp, hidden]


def padded_vocab(vocab: int, tp: int) -> int:
    return -(-vocab // tp) * tp


def vocab_shard(reader: ShardReader, name: str, vocab: int, tp: int, rank: int) -> tuple[torch.Tensor, int, int]:
    """Rows [lo, hi) of the vocabulary padded to a multiple of tp; padding rows are zeros."""
    lo, hi = _split(padded_vocab(vocab, tp), tp, rank)
    hidden = reader.read(name, rows=(0, 1)).shape[1]
    weight = torch.zeros(hi - lo, hidden, dtype=reader.dtype, device=reader.device)  # [Vp/tp, hidden]
    if lo < vocab:
        weight[: min(hi, vocab) - lo] = reader.read(name, rows=(lo, min(hi, vocab)))
    return weight, lo, hi


class VocabParallelEmbedding(nn.Module):
    """Rank r embeds ids in [lo, hi) of the padded vocabulary; the rest are zeros; all-reduce sums."""

    def __init__(self, weight: torch.Tensor, lo: int, hi: int, comm: Comm):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [Vp/tp, hidden]
        self.lo, self.hi, self.comm = lo, hi, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.lo) & (ids < self.hi)  # [T]
        x = nn.functional.embedding((ids - self.lo).clamp(0, self.hi - self.lo - 1), self.weight)  # [T, hidden]
        return self.comm.all_reduce(x * mine[:, None].to(x.dtype))


class ParallelLMHead(nn.Module):
    """Rank r computes the logits of its vocabulary range; TP rank 0 gathers [T, Vp] and drops the padding."""

    def __init__(self, weight: torch.Tensor, vocab: int, comm: Comm):
        super().__init__()
        # a Parameter already when tied to the embedding (the same shard of the same matrix)
        self.weight = (
            weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        )  # [Vp/tp, hidden]
        self.vocab, self.comm, self.ops = vocab, comm, DEFAULT_OPS

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        local = self.ops.linear(hidden, self.weight)  # [N, Vp/tp]
        full = self.comm.gather_to_first(local)  # [N, Vp] on TP rank 0, None elsewhere
        return None if full is None else full[:, : self.vocab]
