"""Room: mixtures of experts. Mixtral, Qwen2-MoE and Qwen3-MoE: a router sends each token to k of E experts.

What it is: the one place the ladder's mixtures of experts live, and the seams they plug into:

    config.py    `MoEConfig`: a checkpoint's experts (config.json), carried by level 0's
                 `ModelConfig.moe`; it builds each layer's MLP for the model, and each rank's
                 share for level 5; the loader finds it by `model_type` (ladder/rooms.py)
    layer.py     `SparseMoE`: router, top-k, the experts (level 0's SwiGLU MLP), the weighted sum;
                 a naive loop beside the grouped path (one matmul per expert), tested equal
    parallel.py  on level 5's tensor-parallel ranks: every expert sliced (`TensorParallelMoE`, one
                 all-reduce) or whole experts per rank (`ExpertParallelMoE`, all-to-all: expert
                 parallelism, `enable_expert_parallel=True`)
    demo.py      `python -m features.moe.demo` (or `python -m level5_multigpu.demo --moe`): the
                 built-in `tiny-shakespeare-moe` in one process, TP=2 and TP=2 + EP, and its routing

Every matmul of the experts goes through level 0's ops seam, and every other part of the model
(attention, norms, the paged cache, the schedulers) is the levels' own: routing is per token,
so every level serves a mixture unchanged (tests/test_equivalence.py).

What it is not: expert load balancing, capacity limits or fused MoE kernels (docs/moe.md).

Reference: Jiang et al. 2024, "Mixtral of Experts"; Lepikhin et al. 2020, "GShard"; vLLM
`model_executor/layers/fused_moe/`.
"""

from .config import ARCHITECTURES, MoEConfig, checkpoint_name, config_from_hf, our_name


def demo_main(argv=None):
    """The room's demo (demo.py), imported only when run: it starts level 5's ranks."""
    from .demo import main

    return main(argv)


__all__ = ["MoEConfig", "ARCHITECTURES", "config_from_hf", "our_name", "checkpoint_name", "demo_main"]
