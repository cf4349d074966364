"""Room: LoRA. Many fine-tuned adapters over one base model, mixed in one batch.

What it is: what `enable_lora=True` and `lora_request=LoRARequest(...)` ask for (vLLM's names), in
small files:

    request.py   `LoRARequest` (a request's adapter), `LoRAConfig` (max_loras, max_lora_rank, max_cpu_loras)
    adapter.py   a PEFT checkpoint read and checked against the base model
    punica.py    the batch's delta, x A_i^T B_i^T per row i: a loop over the adapters, Punica's gathered
                 way (BGMV), its segments (SGMV), and a stacked dense one (the default)
    layers.py    `LoRALinear`: a projection plus the delta of the step's adapters
    triton_ops.py  the same delta as two Triton kernels (Punica's BGMV: shrink, expand), opt-in: no GPU ran them
    manager.py   `LoRAManager`: device slots, the host cache, the admission rule, each step's mapping
    demo.py      `python -m features.lora.demo`: one prompt, the base model and three built-in adapters, one batch

The seams: level 0's requests carry their `lora_request` (checked by this room's preparer when
added), level 2's scheduler asks `admits` before it admits a request, its engine hands each step's
rows to `prepare_step` before the forward, and level 3 puts the adapter's id into a prompt's first
block name, so two adapters never share KV blocks. A level never imports this room (ladder/rooms.py).

What it is not (yet; issue 54): level 5 over ranks (refused in one line: A and B are not sharded),
or run on a GPU (the kernels are tested under Triton's interpreter and compile ahead of time for
sm_80 and sm_90; no GPU has run them). The built-in adapters are models/tiny-shakespeare-loras/
(models/train_lora.py), the lab is 2c, the simulator's cost is benchmarks/sim/lora_cost.py (and S-LoRA's replay, benchmarks/sim/lora.py). The server's
side (`--enable-lora`, `--lora-modules`, adapters by model name, load and unload at run time) is
level 6's (api_server.py, serving.py).

Reference: vLLM `vllm/lora/`; Punica (MLSys 2024); S-LoRA (MLSys 2024).
"""

from .manager import LoRAManager
from .punica import delta_gathered, delta_loop, delta_segmented, delta_stacked
from .request import LoRAConfig, LoRARequest


def make_manager(model, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None, path: str = "stacked"):
    """The engine's LoRA settings -> a manager installed in `model` (every projection of every layer)."""
    return LoRAManager(model, LoRAConfig(max_loras, max_lora_rank, max_cpu_loras), path)


__all__ = ["LoRAConfig", "LoRARequest", "LoRAManager", "make_manager", "delta_gathered", "delta_loop", "delta_segmented",
           "delta_stacked"]
