"""The worker: what one device needs for a step. It has a model runner, and owns the paged KV cache.

What it is: `Worker`, vLLM's split: a worker *has* a model runner (level 0's `ModelRunner`:
the model's forward, logits where asked; model_runner.py) and owns what the device holds
besides the weights: the paged KV cache (kv_cache.py), the attention backend's functions and
its scale. `execute(model_input)` runs one step's `ModelInput` (model_input.py): the input
moves to the device, names the attention backend that runs it, and the runner's forward
writes the step's K/V into the cache and attends through the block tables.

    engine --ModelInput--> Worker.execute --> ModelRunner.forward(batch, attention backend) --> logits [S, V]
                           (owns the cache)    (owns the model)

It is also the one-process `Executor` (executor.py): `submit` runs the forward at once and
`collect` hands back its logits; level 5 replaces it with an executor over ranks.

What it is not: a batching policy or a sampler. Which tokens run is decided before; what to do
with the logits, after.

Reference: vLLM V1 `v1/worker/gpu_worker.py` (Worker) and `gpu_model_runner.py` (GPUModelRunner).
"""

from __future__ import annotations

import torch

from ladder import rooms
from level0_naive.model import Transformer
from level0_naive.model_runner import ModelRunner

from .attention_backend import AttentionImpl, attention_impl
from .kv_cache import PagedKVCache
from .model_input import ModelInput


class Worker:
    """Has a model runner (the model's forward, logits where asked), and owns the paged KV
    cache, the attention implementation and scale: what one device needs for a step."""

    def __init__(self, model: Transformer, num_blocks: int, block_size: int, attention_backend: str = "auto",
                 batch_invariant: bool = False, compilation=None, kv_cache_dtype: str = "auto",
                 calculate_kv_scales: bool = False):  # fmt: skip
        # `compilation`: None, or a compilation_config that asks for torch.compile: then the runner
        # is the room's compiled one (features/compilation), the same forward through a compiled graph
        self.runner = rooms.model_runner(ModelRunner(model), compilation)
        self.model, self.device = model, self.runner.device
        cfg = model.config
        self.block_size = block_size
        # kv_cache_dtype="fp8" | "int8": the room's 8-bit format (ladder/rooms.py): the cache holds bytes, its write
        # quantizes and its attention dequantizes the step's blocks for the backend's own (features/quantization/kv.py)
        kv_format = rooms.kv_format(kv_cache_dtype, calculate_kv_scales)
        self.cache = PagedKVCache(cfg, num_blocks, block_size, next(model.parameters()).dtype, self.device, kv_format)
        self.impl = attention_impl(attention_backend, self.device, batch_invariant)
        if kv_format is not None:
            self.impl = AttentionImpl(*kv_format.wrap(self.impl.attend))
        self.scale = cfg.head_dim**-0.5
        self._uncollected: list[torch.Tensor] = []  # logits of submits not yet collected, oldest first
        self._num_submitted = 0
        # a KV connector's worker side (features/kv_connectors), set by the level that made one: it
        # moves KV between this cache and what lies outside it, before the forward and after
        self.kv_connector = None

    @torch.inference_mode()
    def execute(self, model_input: ModelInput) -> torch.Tensor:
        """One forward: write this step's K/V into the cache, attend -> logits [S, V]."""
        mi = model_input.to(self.device)
        connector = self.kv_connector
        if connector is not None:
            connector.start_load_kv(self.cache)  # the step's loads are in before anything reads them
        logits = self.runner.forward(mi, mi.attention_backend(self.cache, self.impl, self.scale))
        if connector is not None:
            connector.wait_for_save()
            connector.clear_connector_metadata()
        return logits

    # --- the Executor Protocol (level1_paged/executor.py): one process, nothing runs behind your back ---
    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    def submit(self, model_input: ModelInput) -> int:
        """Run the forward now (one process has nothing to overlap it with); `collect` returns its logits."""
        self._uncollected.append(self.execute(model_input))
        self._num_submitted += 1
        return self._num_submitted - 1

    def collect(self) -> torch.Tensor:
        """The logits [S, V] of the oldest `submit` not yet collected."""
        if not self._uncollected:
            raise RuntimeError("collect() without a submit() in flight")
        return self._uncollected.pop(0)

    def collective_rpc(self, method: str, *args) -> list:
        """`method(*args)` of this worker, the only one: [its answer]."""
        return [getattr(self, method)(*args)]

    def kv_cache_bytes(self) -> int:
        """Bytes of this worker's K and V blocks (a harmless question for `collective_rpc`)."""
        return sum(t.numel() * t.element_size() for t in self.cache.k + self.cache.v)

    def check_health(self) -> None:
        """Nothing to check: the model runs in this process."""

    def shutdown(self) -> None:
        """Nothing to stop: no other process, no process group."""
