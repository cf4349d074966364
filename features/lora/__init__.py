"""Room: LoRA. Many fine-tuned adapters over one base model, mixed in one batch.

What it is: what `enable_lora=True` and `lora_request=LoRARequest(...)` ask for (vLLM's names), in
small files:

    request.py   `LoRARequest` (a request's adapter), `LoRAConfig` (max_loras, max_lora_rank, max_cpu_loras)
    adapter.py   a PEFT checkpoint read and checked against the base model
    punica.py    the batch's delta, x A_i^T B_i^T per row i: a loop over the adapters, Punica's gathered
                 way (BGMV), its segments (SGMV), and a stacked dense one (the default without a compiler)
    cpu_ops.py   the same delta as one compiled C++ loop per projection (cpu_lora.cpp): the CPU's default
    layers.py    `LoRALinear`: a projection plus the delta of the step's adapters (a row-parallel one: before
                 its all-reduce)
    triton_ops.py  the same delta as two Triton kernels (Punica's BGMV: shrink, expand), opt-in: no GPU ran them
    slots.py     `LoRASlots`: every adapted layer's stacked A and B, fused and sharded layers' included
    sharded.py   which shard of each adapter's A and B a level-5 rank holds (S-LoRA's and vLLM's split)
    manager.py   `LoRAManager`: the host cache, the admission rule, which adapter is in which slot, each
                 step's mapping (the slots', or over ranks a record every rank carries out)
    demo.py      `python -m features.lora.demo`: one prompt, the base model and three built-in adapters, one batch

The seams: level 0's requests carry their `lora_request` (checked by this room's preparer when
added), level 2's scheduler asks `admits` before it admits a request, its engine hands each step's
rows to `prepare_step` before the forward, and level 3 puts the adapter's id into a prompt's first
block name, so two adapters never share KV blocks. A level never imports this room (ladder/rooms.py).

What it is not (yet; issue 54): run on a GPU (the kernels are tested under Triton's interpreter and compile ahead of time for
sm_80 and sm_90; no GPU has run them). The built-in adapters are models/tiny-shakespeare-loras/
(models/train_lora.py), the lab is 2c, the simulator's cost is benchmarks/sim/lora_cost.py (and S-LoRA's replay, benchmarks/sim/lora.py). The server's
side (`--enable-lora`, `--lora-modules`, adapters by model name, load and unload at run time) is
level 6's (api_server.py, serving.py).

Reference: vLLM `vllm/lora/`; Punica (MLSys 2024); S-LoRA (MLSys 2024).
"""

from .manager import LoRAManager
from .punica import delta_gathered, delta_loop, delta_segmented, delta_stacked
from .request import LoRAConfig, LoRARequest
from .slots import LoRASlots, LoRAStep


def make_manager(model, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None, path: str = "auto"):
    """The engine's LoRA settings -> a manager with its slots installed in `model` (every adapted projection)."""
    config = LoRAConfig(max_loras, max_lora_rank, max_cpu_loras)
    return LoRAManager(model.config, config, next(model.parameters()).dtype, LoRASlots(model, config, path))


def make_books(model_config, dtype, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None):
    """A manager without slots (level 5's driver: the ranks hold them and carry out each step's `LoRAStep`)."""
    return LoRAManager(model_config, LoRAConfig(max_loras, max_lora_rank, max_cpu_loras), dtype)


def make_slots(stage, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None, fully_sharded: bool = False):
    """A rank's slots, installed in its stage's fused, sharded layers (level 5): vLLM's default split, or
    S-LoRA's (`fully_sharded`: sharded.py)."""
    from .sharded import stage_targets  # (imports level 5's layers: only where there are ranks)

    config = LoRAConfig(max_loras, max_lora_rank, max_cpu_loras)
    return LoRASlots(stage, config, targets=stage_targets(stage, fully_sharded, max_lora_rank))


__all__ = ["LoRAConfig", "LoRARequest", "LoRAManager", "LoRASlots", "LoRAStep", "make_manager", "make_books", "make_slots", "delta_gathered", "delta_loop", "delta_segmented",
           "delta_stacked"]
