"""What a checkpoint with experts adds to the model's config, and where each of its layers' MLPs comes from.

What it is: `MoEConfig`, the mixture's hyper-parameters as Mixtral, Qwen2-MoE and Qwen3-MoE
store them in `config.json` (read by `config_from_hf`), carried by level 0's `ModelConfig.moe`.
It is the seam's whole interface: the model asks it for each decoder layer's MLP (`mlp`), level
5 for each rank's share of it (`sharded_mlp`), and the loader for the checkpoint's tensor names
(`our_name`, `checkpoint_name`: Mixtral names its experts w1, w3, w2). Neither the model nor the
loader imports this room: the loader reaches it through `ladder/rooms.py` by the checkpoint's
`model_type` (`ARCHITECTURES`), and the object it builds then answers for the room.

    layer i is MoE if  num_experts > 0, i not in mlp_only_layers, (i + 1) % decoder_sparse_step == 0
    (as transformers' Qwen2MoeDecoderLayer decides); the others keep a dense MLP

What it is not: the layer (`layer.py`) or its parallel forms (`parallel.py`).

Reference: transformers `configuration_mixtral.py`, `configuration_qwen2_moe.py`, `configuration_qwen3_moe.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

# model_type -> what its attention differs in from plain Llama (the loader's own table, for the dense types)
ARCHITECTURES = {"mixtral": {}, "qwen2_moe": {"qkv_bias": True}, "qwen3_moe": {"qk_norm": True}}
# Mixtral names its MoE block and experts its own way; the model uses Qwen-MoE's names.
MIXTRAL_NAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    num_experts_per_tok: int  # k: the experts each token goes through
    moe_intermediate_size: int  # each expert's SwiGLU width
    norm_topk_prob: bool = False  # renormalise the k routing weights to sum to 1 (Mixtral: always)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a shared expert every token takes (0: none)
    decoder_sparse_step: int = 1  # every this-many-th layer is MoE (Qwen's; the others dense)
    mlp_only_layers: tuple[int, ...] = ()  # layers kept dense whatever the step

    def is_moe_layer(self, layer: int) -> bool:
        """As the checkpoints' own code decides it (transformers' Qwen2MoeDecoderLayer)."""
        return self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def mlp(self, cfg, layer: int, mlp: type, linear: type):
        """Layer `layer`'s MLP in level 0's model: a `SparseMoE` (its experts are `mlp`s, its router a
        `linear`: the model's own classes, so every matmul goes through the ops seam), or a dense `mlp`."""
        from .layer import SparseMoE

        return SparseMoE(cfg, mlp, linear) if self.is_moe_layer(layer) else mlp(cfg)

    def sharded_mlp(self, cfg, reader, prefix: str, comm, expert_parallel: bool):
        """A MoE layer's share on one of level 5's tensor-parallel ranks: every expert sliced
        (`TensorParallelMoE`), or whole experts per rank with `expert_parallel` (`ExpertParallelMoE`)."""
        from .parallel import ExpertParallelMoE, TensorParallelMoE

        block = ExpertParallelMoE if expert_parallel and comm.topo.tp > 1 else TensorParallelMoE
        return block(cfg, reader, prefix, comm)


def config_from_hf(hf: dict, model_type: str) -> MoEConfig:
    """A mixture's `config.json` -> its MoEConfig (Mixtral calls the experts `num_local_experts`)."""
    return MoEConfig(
        num_experts=hf.get("num_local_experts") or hf.get("num_experts") or 0,
        num_experts_per_tok=hf.get("num_experts_per_tok") or 0,
        moe_intermediate_size=hf.get("moe_intermediate_size") or hf["intermediate_size"],  # Mixtral: the same
        norm_topk_prob=model_type == "mixtral" or bool(hf.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size") or 0,
        decoder_sparse_step=hf.get("decoder_sparse_step") or 1,
        mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
    )


def our_name(name: str, model_type: str) -> str:
    """A checkpoint's tensor name -> the model's."""
    if model_type == "mixtral" and ".block_sparse_moe." in name:
        for theirs, ours in MIXTRAL_NAMES:
            name = name.replace(theirs, ours)
    return name


def checkpoint_name(name: str, model_type: str) -> str:
    """The model's tensor name -> the checkpoint's (level 5 reads slices by the checkpoint's names)."""
    if model_type == "mixtral" and ".mlp." in name:
        for theirs, ours in MIXTRAL_NAMES:
            name = name.replace(ours, theirs)
    return name


__all__ = ["MoEConfig", "ARCHITECTURES", "config_from_hf", "our_name", "checkpoint_name"]
