"""One rank's part of the model: level 0's Transformer, with modules replaced by sharded ones.

What it is: `StageModel`, built the explicit way. Level 0's `Transformer` is constructed on
the "meta" device (no memory), then this rank keeps only its pipeline stage's layers
and replaces, module by module, what tensor parallelism splits:

    model.embed_tokens      -> VocabParallelEmbedding     (first stage only)
    layers[i].self_attn     -> ParallelAttention           [q|k|v] by heads, o row-parallel
    layers[i].mlp           -> ParallelMLP                 [gate|up] per segment, down row-parallel
                               (a mixture of experts: its room's, `cfg.moe.sharded_mlp`: every
                               expert sliced, or whole experts per rank with `expert_parallel`)
    layers[i].*_layernorm   -> RMSNorm, replicated         (small: every rank of the stage has it)
    model.norm, lm_head     -> RMSNorm, ParallelLMHead     (last stage only)

Each weight is read from the checkpoint slice by slice (`layers.ShardReader`), so no rank
ever holds the whole model. The attention and MLP keep level 0's forward; only their
projections change. `self.config` describes what this rank holds (its layers, its heads),
which is what its KV cache is sized from.

    8 layers, pp 2, tp 2:   rank 0: layers 0-3, heads 0-1 + embedding   rank 1: layers 0-3, heads 2-3 + embedding
                            rank 2: layers 4-7, heads 0-1 + LM head     rank 3: layers 4-7, heads 2-3 + LM head

The sharded linears, the norms and RoPE go through level 0's ops seam like the unsharded ones
(`level0_naive/ops.py`): `StageModel(..., ops=...)` or `set_ops` swaps them all.

What it is not: a forward hook, or a copy of the model: level 0's classes do the math.

Reference: vLLM `model_executor/models/llama.py` (how a model is built from parallel
layers); gpt-fast `tp.py` (sharding an existing model by replacing its linears).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from level0_naive.kv_cache import kv_bytes_per_token
from level0_naive.model import MLP, Attention, ModelConfig, RMSNorm, Transformer, rope_inv_freq
from level0_naive.ops import DEFAULT_OPS, Ops

from .layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    ShardReader,
    VocabParallelEmbedding,
    _split,
    kv_heads_of_rank,
    vocab_shard,
)
from .parallel_state import Comm


def partition_layers(num_layers: int, pp: int, partition: list[int] | None = None) -> list[range]:
    """Contiguous layer ranges, one per stage: `partition` (layers per stage) if given, else as
    even as possible, the first stages taking one more when it does not divide."""
    if partition is None:
        partition = [num_layers // pp + (s < num_layers % pp) for s in range(pp)]
    if len(partition) != pp or sum(partition) != num_layers or min(partition) < 1:
        raise ValueError(
            f"pipeline_partition={partition} must give each of the {pp} stages >= 1 layer, {num_layers} in all"
        )
    starts = [sum(partition[:s]) for s in range(pp)]
    return [range(a, a + n) for a, n in zip(starts, partition)]


class ParallelAttention(Attention):
    """Level 0's attention over this rank's heads: its forward runs unchanged; `qkv` is one sharded matmul."""

    def __init__(self, layer: int, qkv_proj: QKVParallelLinear, o_proj: RowParallelLinear, heads: int, kv_heads: int,
                 head_dim: int, q_norm: RMSNorm | None, k_norm: RMSNorm | None):  # fmt: skip
        nn.Module.__init__(self)  # not Attention.__init__: that would build the full-size projections
        self.layer, self.nh, self.nkv, self.d = layer, heads, kv_heads, head_dim
        self.qkv_proj, self.o_proj = qkv_proj, o_proj
        self.sizes = qkv_proj.sizes  # (kept here: a LoRA room may wrap the projection)
        self.ops: Ops = DEFAULT_OPS  # RoPE's (set_ops replaces it)
        if q_norm is not None:
            self.q_norm, self.k_norm = q_norm, k_norm

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.qkv_proj(x).split(self.sizes, dim=-1)  # q [T, Hq/tp * D], k, v [T, Hkv_r * D]


class ParallelMLP(MLP):
    """SwiGLU over this rank's slice of the intermediate features; `down_proj` all-reduces."""

    def __init__(self, gate_up: MergedColumnParallelLinear, down_proj: RowParallelLinear):
        nn.Module.__init__(self)  # not MLP.__init__: that would build the full-size projections
        self.gate_up, self.down_proj = gate_up, down_proj
        self.ops: Ops = DEFAULT_OPS  # its silu_mul (set_ops replaces it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # [T, ff/tp] each
        return self.down_proj(self.ops.silu_mul(gate, up))


def load_norm(reader: ShardReader, name: str, dim: int, eps: float) -> RMSNorm:
    norm = RMSNorm(dim, eps).to(reader.device)
    norm.weight = nn.Parameter(reader.read(name), requires_grad=False)
    return norm


class StageModel(Transformer):
    """This rank's layers and shards; `forward` takes hidden states instead of ids after stage 0."""

    # a forward all-reduces over the TP group: a compiled runner whose compile fails in its start-up warm-up
    # runs the warm-up's forwards eager all the same, so that the stage's ranks exchange the same messages
    forward_sends_messages = True

    def __init__(self, cfg: ModelConfig, reader: ShardReader, comm: Comm, layers: range, ops: Ops = DEFAULT_OPS,
                 expert_parallel: bool = False):  # fmt: skip
        with torch.device("meta"):
            super().__init__(cfg)  # level 0's modules, allocated nowhere; replaced below
        topo, tp, r = comm.topo, comm.topo.tp, comm.topo.tp_rank
        k0, k1 = kv_heads_of_rank(cfg.num_kv_heads, tp, r)
        self.full_config, self.topo, self.comm = cfg, topo, comm  # (the LoRA room's fully sharded split sends over comm)
        self.layer_ids = list(layers)  # the model's numbers of this stage's layers (an adapter names its layers so)
        self.config = replace(cfg, num_layers=len(layers), num_heads=cfg.num_heads // tp, num_kv_heads=k1 - k0)
        self.first, self.last = topo.is_first_stage, topo.is_last_stage
        self.hidden_in: torch.Tensor | None = None  # a later stage's input this step, [T, d] (RankWorker sets it)
        kept = []
        for local, i in enumerate(layers):
            layer, p, d = self.model.layers[i], f"model.layers.{i}", cfg.hidden_size
            o = RowParallelLinear(reader.read(f"{p}.self_attn.o_proj.weight", cols=_split(cfg.num_heads * cfg.head_dim, tp, r)),
                                  _maybe(reader, f"{p}.self_attn.o_proj.bias"), comm)  # fmt: skip
            qk = (
                [
                    load_norm(reader, f"{p}.self_attn.{n}.weight", cfg.head_dim, cfg.rms_norm_eps)
                    for n in ("q_norm", "k_norm")
                ]
                if cfg.qk_norm
                else [None, None]
            )
            layer.self_attn = ParallelAttention(local, QKVParallelLinear.load(reader, f"{p}.self_attn", cfg, tp, r), o,
                                                cfg.num_heads // tp, k1 - k0, cfg.head_dim, *qk)  # fmt: skip
            if cfg.moe is not None and cfg.moe.is_moe_layer(i):  # experts: sliced, or whole ones per rank
                layer.mlp = cfg.moe.sharded_mlp(cfg, reader, f"{p}.mlp", comm, expert_parallel)
            else:
                down = RowParallelLinear(reader.read(f"{p}.mlp.down_proj.weight", cols=_split(cfg.intermediate_size, tp, r)),
                                         _maybe(reader, f"{p}.mlp.down_proj.bias"), comm)  # fmt: skip
                layer.mlp = ParallelMLP(
                    MergedColumnParallelLinear.load(reader, f"{p}.mlp", cfg.intermediate_size, tp, r), down
                )
            layer.input_layernorm = load_norm(reader, f"{p}.input_layernorm.weight", d, cfg.rms_norm_eps)
            layer.post_attention_layernorm = load_norm(
                reader, f"{p}.post_attention_layernorm.weight", d, cfg.rms_norm_eps
            )
            kept.append(layer)
        self.model.layers = nn.ModuleList(kept)
        embed_name = "model.embed_tokens.weight"
        self.model.embed_tokens = (
            VocabParallelEmbedding(*vocab_shard(reader, embed_name, cfg.vocab_size, tp, r), comm)
            if self.first
            else None
        )
        if self.last:
            self.model.norm = load_norm(reader, "model.norm.weight", cfg.hidden_size, cfg.rms_norm_eps)
            head = self.model.embed_tokens.weight if self.first and cfg.tie_word_embeddings else None
            if head is None:
                name = embed_name if cfg.tie_word_embeddings else "lm_head.weight"
                head = vocab_shard(reader, name, cfg.vocab_size, tp, r)[0]
            self.lm_head = ParallelLMHead(head, cfg.vocab_size, comm)
        else:
            self.model.norm, self.lm_head = None, None
        self.inv_freq = rope_inv_freq(cfg).to(reader.device)
        self.set_ops(ops)  # after the swaps above: the sharded modules are new
        self.eval()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn, hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Stage 0: ids [T] -> hidden [T, d]; later stages: the previous stage's hidden [T, d] -> hidden."""
        x = self.model.embed_tokens(input_ids) if self.first else hidden  # [T, hidden]
        cos, sin = self.rope(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attn)  # level 0's DecoderLayer, with sharded attention and MLP
        return self.model.norm(x) if self.last else x

    def step_inputs(self, n: int | None = None) -> tuple[torch.Tensor, ...]:
        """What the compiled runner passes beside tokens and positions (features/compilation/runner.py): after
        stage 0, the previous stage's hidden states [T, d] (`n`: zeros of n rows, for the start-up compile)."""
        if self.first:
            return ()
        if n is not None:
            return (next(self.parameters()).new_zeros(n, self.full_config.hidden_size),)
        return (self.hidden_in,)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Last stage: logits [N, V] on TP rank 0 (every TP rank must call: it is a gather)."""
        logits = self.lm_head(hidden)
        return None if logits is None else logits.to(torch.promote_types(logits.dtype, torch.float32))


def _maybe(reader: ShardReader, name: str) -> torch.Tensor | None:
    return reader.read(name) if reader.has(name) else None


def kv_bytes_per_token_of_rank(cfg: ModelConfig, tp: int, rank: int, num_layers: int, dtype: torch.dtype,
                               head_bytes: int | None = None) -> int:  # fmt: skip
    """What one token costs in this rank's KV cache: its layers, its KV heads (`head_bytes`: an 8-bit cache's)."""
    k0, k1 = kv_heads_of_rank(cfg.num_kv_heads, tp, rank)
    return kv_bytes_per_token(cfg, dtype, num_layers, k1 - k0, head_bytes)
