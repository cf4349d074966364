"""Level 5's part of the engine's config: how the model is split over ranks, and how they talk.

What it is: `ParallelConfig` (`config.parallel`), vLLM's names for `LLM(...)`'s keywords:

    LLM(model, tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="mp")

`tensor_parallel_size` splits every layer's heads and features over that many ranks,
`pipeline_parallel_size` the layers into that many stages; the others say who starts the ranks
(this process, torchrun or Ray), which collective library they use, how the layers are
partitioned, how long a silent rank lives, and whether a mixture's experts are split by
expert (features/moe). A bad value is a `ValueError` naming the keyword.

What it is not: the ranks (executor.py starts them; rank.py is what each one runs).

Reference: vLLM `vllm/config/parallel.py` (`ParallelConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass

from level0_naive.config import Part


@dataclass
class ParallelConfig(Part):
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = (
        None  # "mp" (spawn the ranks here) | "torchrun" (they are started for us) | "ray" (Ray actors: ray_executor.py)
    )
    distributed_backend: str = "auto"  # "auto": nccl on CUDA, gloo on CPU | "gloo" | "nccl"
    pipeline_partition: list[int] | None = None  # layers per stage (default: as even as possible)
    distributed_timeout_s: float = 120.0  # a rank silent for this long is declared dead
    enable_expert_parallel: bool = False  # MoE: whole experts per TP rank, all-to-all (features/moe); else sliced
    oversubscribe_gpus: bool = False  # more ranks than GPUs, several on one (tests; gloo only): else an error

    def __post_init__(self):
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an integer >= 1")
        if self.distributed_executor_backend not in (None, "mp", "torchrun", "ray"):
            raise ValueError(
                f"distributed_executor_backend={self.distributed_executor_backend!r} must be 'mp', 'torchrun' or 'ray'"
            )
        if self.distributed_backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"distributed_backend={self.distributed_backend!r} must be 'auto', 'gloo' or 'nccl'")
        if self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s={self.distributed_timeout_s} must be > 0")


__all__ = ["ParallelConfig"]
