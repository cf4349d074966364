"""`LoRARequest` and `LoRAConfig`: which adapter a request runs with, and how many an engine holds.

What it is: vLLM's names. A request names its adapter by a `LoRARequest(lora_name, lora_int_id,
lora_path)` (the id is the adapter's identity: two requests with one id share its slot and its
prefix-cache blocks; the path is a PEFT checkpoint folder); an engine made with
`enable_lora=True` holds up to `max_loras` adapters in its device slots at once (the most distinct
adapters one step may run), `max_cpu_loras` more in host memory, each of rank at most
`max_lora_rank`.

What it is not: the adapters' weights (adapter.py) or where they live (manager.py).

Reference: vLLM `vllm/lora/request.py` (`LoRARequest`) and `vllm/config/lora.py` (`LoRAConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int  # >= 1: the adapter's identity (0 is the base model in vLLM's mappings)
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id={self.lora_int_id!r} must be an integer >= 1")


@dataclass
class LoRAConfig:
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def __post_init__(self):
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        self.max_cpu_loras = self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras={self.max_loras}")


__all__ = ["LoRARequest", "LoRAConfig"]
