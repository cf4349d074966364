# Lab 5: your copy of level5_multigpu/layers.py.
# Fill in every function that raises NotImplementedError (search for TODO), then run
#     python -m labs check 5 THIS_FILE
# Made by `python -m labs starters` from the reference; everything else is the reference, unchanged.
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

from level0_naive.loader import checkpoint_name
from level0_naive.ops import DEFAULT_OPS

from .parallel_state import Comm


class ShardReader:
    """Reads slices of named tensors from a checkpoint's safetensors files (never a whole weight
    unless asked for one)."""

    def __init__(self, path: Path, dtype: torch.dtype, device):
        index = path / "model.safetensors.index.json"
        if index.is_file():
            self.files = {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            single = path / "model.safetensors"
            with safe_open(single, "pt") as f:
                self.files = dict.fromkeys(f.keys(), single)
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
        # TODO (lab 5): ColumnParallelLinear.forward
        # y_r = x W_r^T (+ b_r): this rank holds rows (outputs) of W and of the bias, so its output is a slice of
        # the full output, and nothing is communicated. [T, in] -> [T, out / tp].
        raise NotImplementedError("lab 5: write ColumnParallelLinear.forward")


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r @ W_r^T) + b: this rank's columns (inputs) of W; the bias once, after the sum."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in/tp]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.comm, self.ops = comm, DEFAULT_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # TODO (lab 5): RowParallelLinear.forward
        # This rank holds columns (inputs) of W, so x W_r^T is a *partial sum* of the full output: all-reduce it
        # (self.comm.all_reduce, a sum over the ranks of the stage). The bias is whole on every rank: add it once,
        # after the sum (added before, it would be counted tp times). [T, in / tp] -> [T, out].
        raise NotImplementedError("lab 5: write RowParallelLinear.forward")


def kv_heads_of_rank(num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """[first, last) KV heads rank `rank` holds: a split when there are enough, else one head,
    replicated on tp / num_kv_heads consecutive ranks."""
    # TODO (lab 5): kv_heads_of_rank
    # [first, last) of the KV heads this rank holds. Enough heads (num_kv_heads >= tp): an even split
    # (_split). Fewer heads than ranks: each head is replicated on tp // num_kv_heads consecutive ranks, and
    # rank r holds the one head r // (tp // num_kv_heads) (a ValueError if tp is not a multiple of
    # num_kv_heads): the KV head its query heads read.
    raise NotImplementedError("lab 5: write kv_heads_of_rank")


class QKVParallelLinear(ColumnParallelLinear):
    """[q | k | v] of this rank's heads in one matmul; `split` cuts the output back into three."""

    @classmethod
    def load(cls, reader: ShardReader, prefix: str, cfg, tp: int, rank: int) -> QKVParallelLinear:
        # TODO (lab 5): QKVParallelLinear.load
        # This rank's q, k and v rows, in one weight [q rows; k rows; v rows] (and the same for the biases, if the
        # checkpoint has q_proj.bias):
        #   q: the rows of its query heads, _split(cfg.num_heads, tp, rank), head_dim rows per head;
        #   k, v: the rows of its KV heads, kv_heads_of_rank(cfg.num_kv_heads, tp, rank).
        # Read them with reader.read(f"{prefix}.q_proj.weight", rows=(first_row, last_row)) and so on (only the
        # slice is read from disk). Build the layer with cls(weight, bias) and set layer.sizes to the three
        # row counts, which split() uses to cut the output back into q, k and v.
        raise NotImplementedError("lab 5: write QKVParallelLinear.load")

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return y.split(self.sizes, dim=-1)  # q [T, Hq/tp * D], k, v [T, Hkv_r * D]


class MergedColumnParallelLinear(ColumnParallelLinear):
    """[gate rows of this rank ; up rows of this rank]: sharded per segment, so each rank's half
    of the intermediate features is complete (gate and up for the same features)."""

    @classmethod
    def load(cls, reader: ShardReader, prefix: str, size: int, tp: int, rank: int) -> MergedColumnParallelLinear:
        # TODO (lab 5): MergedColumnParallelLinear.load
        # gate and up in one matmul, sharded per segment: this rank's weight is [its gate rows; its up rows], the
        # same rows r = _split(size, tp, rank) of both, so silu(gate) * up pairs the same features on every rank
        # (the biases likewise, if the checkpoint has gate_proj.bias).
        raise NotImplementedError("lab 5: write MergedColumnParallelLinear.load")


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
        # TODO (lab 5): VocabParallelEmbedding.forward
        # This rank holds the embedding rows of ids in [self.lo, self.hi). Look up every id clamped into this
        # range (ids - self.lo, clamped to 0 .. hi - lo - 1), zero the rows of ids that are not this rank's,
        # then all-reduce: the sum over ranks is the full embedding. [T] -> [T, hidden].
        raise NotImplementedError("lab 5: write VocabParallelEmbedding.forward")


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
        # TODO (lab 5): ParallelLMHead.forward
        # This rank computes the logits of its vocabulary range (hidden @ weight^T: [N, Vp / tp]); the shards are
        # gathered on TP rank 0 (self.comm.gather_to_first, which returns None on the others), and the padding
        # columns beyond self.vocab are dropped there. Return [N, vocab] or None.
        raise NotImplementedError("lab 5: write ParallelLMHead.forward")
