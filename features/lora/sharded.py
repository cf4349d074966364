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

What it is not: S-LoRA's split (vLLM's `fully_sharded_loras=True`), which shards the rest too: a column
layer's A by ranks (each rank shrinks to R/tp columns, then an all-gather of [T, R]) and a row layer's B
by outputs (an all-reduce of the shrink's [T, R], then each rank expands its outputs only). It holds
1/tp of every adapter per rank, for two more messages per layer; here, where a message costs 1-3 ms
(gloo) and a rank-8 adapter of the built-in model is 0.55 MB, the messages would cost more than the
memory saves. docs/lora.md compares the two.

Reference: Sheng et al., "S-LoRA" (MLSys 2024), section 5; vLLM `vllm/lora/layers/column_parallel_linear.py`
(`MergedQKVParallelLinearWithLoRA.slice_lora_b`), `row_parallel_linear.py` (`RowParallelLinearWithLoRA.slice_lora_a`)
and `fully_sharded_layers.py` (S-LoRA's split).
"""

from __future__ import annotations

from level5_multigpu.layers import _split, kv_heads_of_rank

from .slots import Piece, Target


def stage_targets(stage) -> dict[tuple[int, str], Target]:
    """(layer, fused module) -> Target for each adapted layer of a rank's StageModel (layers numbered as the
    whole model numbers them, which is how an adapter names them)."""
    cfg, tp, r = stage.full_config, stage.topo.tp, stage.topo.tp_rank
    d, h, ff = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    q0, q1 = _split(cfg.num_heads, tp, r)
    k0, k1 = kv_heads_of_rank(cfg.num_kv_heads, tp, r)
    whole_h, heads, ff_r = (0, h), (q0 * d, q1 * d), _split(ff, tp, r)  # heads: q's rows here, o's columns
    out = {}
    for i, layer in zip(stage.layer_ids, stage.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        out[i, "qkv_proj"] = Target(attn, "qkv_proj", (Piece("q_proj", heads, whole_h),
                                                        Piece("k_proj", (k0 * d, k1 * d), whole_h),
                                                        Piece("v_proj", (k0 * d, k1 * d), whole_h)))  # fmt: skip
        out[i, "o_proj"] = Target(attn, "o_proj", (Piece("o_proj", whole_h, heads),), row_parallel=True)
        out[i, "gate_up"] = Target(mlp, "gate_up", (Piece("gate_proj", ff_r, whole_h), Piece("up_proj", ff_r, whole_h)))
        out[i, "down_proj"] = Target(mlp, "down_proj", (Piece("down_proj", whole_h, ff_r),), row_parallel=True)
    return out


__all__ = ["stage_targets"]
