"""Which part of every adapter a level-5 rank holds: the pieces of its fused, sharded layers.

What it is: `stage_targets(stage)`, the adapted layers of a rank's `StageModel` (level5_multigpu/model.py)
and, for each, the base model's projections it computes and the shard of each (slots.py's `Piece`).
Each adapter is split as its layer is (vLLM's default split):

    layer (level 5)   kind              its pieces                    A (shrink)          B (expand)
    qkv_proj          column-parallel   q, k, v: this rank's heads    whole               this rank's rows
    o_proj            row-parallel      o: this rank's head columns   this rank's columns whole
    gate_up           column-parallel   gate, up: this rank's rows    whole               this rank's rows
    down_proj         row-parallel      down: this rank's columns     this rank's columns whole

A column-parallel layer's delta is its outputs' rows: no message. A row-parallel layer's delta is a
partial sum like its output, added to it before the one all-reduce (layers.py). So LoRA adds no
communication at all; the price is that the small A (column layers) and B (row layers) are held whole
on every rank, and the shrink of a column layer is computed on every rank (R columns: cheap).

The KV heads follow level 5's rule (`kv_heads_of_rank`): with fewer KV heads than ranks, a head and its
rows of B_k and B_v are on every rank that holds it.

`fully_sharded_loras=True` (vLLM's name) is S-LoRA's split instead, which shards the rest too, so a
rank holds 1/tp of every adapter:

    layer             A (shrink)                       B (expand)            messages, per layer and step
    qkv, gate_up      this rank's share of the ranks   this rank's rows      an all-gather of the shrink
    o, down           this rank's columns              this rank's outputs   an all-reduce of the shrink

The stacked delta shrinks every slot at once (S of them, each a fused layer's P pieces), so a rank's
shrink is [T, S*P*R/tp] for a column layer (gathered to [T, S*P*R]) and [T, S*R] for a row layer.

A column layer's shrink gives each rank R/tp of each piece's R columns; the all-gather puts them side by
side (ranks in order), and the rank's rows of B expand them. A row layer's shrink is a partial sum over
the input's columns, like its output; the all-reduce completes it (S*R numbers a row, not out), and each
rank expands its own outputs only, added into its slice of the partial output before the layer's
all-reduce, which adds the zero the other ranks put there. So four more messages a layer in every step
that runs an adapter, each S*P*R numbers a row at most; where a message costs 1-3 ms (gloo, this CPU) they cost more
than the memory saves (a rank-8 adapter of the built-in model is 0.55 MB): docs/lora.md compares the two.
Only the stacked delta takes this split (slots.py says which path refuses).

Reference: Sheng et al., "S-LoRA" (MLSys 2024), section 5; vLLM `vllm/lora/layers/column_parallel_linear.py`
(`MergedQKVParallelLinearWithLoRA.slice_lora_b`), `row_parallel_linear.py` (`RowParallelLinearWithLoRA.slice_lora_a`)
and `fully_sharded_layers.py` (S-LoRA's split).
"""

from __future__ import annotations

from level5_multigpu.layers import _split, kv_heads_of_rank

from .slots import Piece, Shard, Target


def stage_targets(stage, fully_sharded: bool = False, max_lora_rank: int = 0) -> dict[tuple[int, str], Target]:
    """(layer, fused module) -> Target for each adapted layer of a rank's StageModel (layers numbered as the
    whole model numbers them, which is how an adapter names them); `fully_sharded`: S-LoRA's split (above)."""
    cfg, tp, r = stage.full_config, stage.topo.tp, stage.topo.tp_rank
    d, h, ff = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    q0, q1 = _split(cfg.num_heads, tp, r)
    k0, k1 = kv_heads_of_rank(cfg.num_kv_heads, tp, r)
    whole_h, heads, ff_r = (0, h), (q0 * d, q1 * d), _split(ff, tp, r)  # heads: q's rows here, o's columns
    full = fully_sharded and tp > 1
    # S-LoRA's split: a column layer's A by ranks (R / tp of each piece's), a row layer's B by outputs
    ranks = Shard(stage.comm, r, tp, max_lora_rank // tp) if full else None
    outs = Shard(stage.comm, r, tp, 0) if full else None
    o_rows = _split(h, tp, r) if full else whole_h  # a row layer's outputs: its B's rows here
    out = {}
    for i, layer in zip(stage.layer_ids, stage.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        out[i, "qkv_proj"] = Target(attn, "qkv_proj", (Piece("q_proj", heads, whole_h),
                                                        Piece("k_proj", (k0 * d, k1 * d), whole_h),
                                                        Piece("v_proj", (k0 * d, k1 * d), whole_h)), by_ranks=ranks)  # fmt: skip
        out[i, "o_proj"] = Target(attn, "o_proj", (Piece("o_proj", o_rows, heads),), row_parallel=True, by_outputs=outs)
        out[i, "gate_up"] = Target(mlp, "gate_up", (Piece("gate_proj", ff_r, whole_h), Piece("up_proj", ff_r, whole_h)),
                                   by_ranks=ranks)  # fmt: skip
        out[i, "down_proj"] = Target(mlp, "down_proj", (Piece("down_proj", o_rows, ff_r),), row_parallel=True,
                                     by_outputs=outs)  # fmt: skip
    return out


__all__ = ["stage_targets"]
