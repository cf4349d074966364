"""Room: LoRA. Many fine-tuned adapters over one base model, mixed in one batch.

What it is: what `enable_lora=True` and `lora_request=LoRARequest(...)` ask for (vLLM's names), in
small files:

    request.py   `LoRARequest` (a request's adapter), `LoRAConfig` (max_loras, max_lora_rank, max_cpu_loras)
    adapter.py   a PEFT checkpoint read and checked against the base model
    punica.py    the batch's delta, x A_i^T B_i^T per row i: a loop over the adapters, Punica's gathered
                 way, and a stacked dense one (the CPU's default)
    layers.py    `LoRALinear`: a projection plus the delta of the step's adapters
    manager.py   `LoRAManager`: device slots, the host cache, the admission rule, each step's mapping

The seams: level 0's requests carry their `lora_request` (checked by this room's preparer when
added), level 2's scheduler asks `admits` before it admits a request, its engine hands each step's
rows to `prepare_step` before the forward, and level 3 puts the adapter's id into a prompt's first
block name, so two adapters never share KV blocks. A level never imports this room (ladder/rooms.py).

What it is not (yet; issue 54): level 5 over ranks (refused in one line), a GPU kernel, the
built-in adapters, the demo, the lab step and the simulator's cost. The server's
side (`--enable-lora`, `--lora-modules`, adapters by model name, load and unload at run time) is
level 6's (api_server.py, serving.py).

Reference: vLLM `vllm/lora/`; Punica (MLSys 2024); S-LoRA (MLSys 2024).
"""

from .manager import LoRAManager
from .punica import delta_gathered, delta_loop, delta_stacked
from .request import LoRAConfig, LoRARequest


def make_manager(model, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None, path: str = "stacked"):
    """The engine's LoRA settings -> a manager installed in `model` (every projection of every layer)."""
    return LoRAManager(model, LoRAConfig(max_loras, max_lora_rank, max_cpu_loras), path)


__all__ = ["LoRAConfig", "LoRARequest", "LoRAManager", "make_manager", "delta_gathered", "delta_loop", "delta_stacked"]
