"""`LoRALinear`: a base model's linear layer plus the batch's adapters, read from the device slots.

What it is: the module the LoRA manager puts in place of each of the seven projections of every
layer (the base `Linear` stays inside it, its weights and ops untouched):

    y = base(x)                                     [T, out], the base model's own
      + slots.add_delta(key, x, y) this step's delta (punica.py: one of the manager's paths)

`slots.mapping` [T] is this step's adapter slot per row (-1: the base model), which the engine
sets before the forward (manager.py); with no adapter in the batch the layer is the base layer.

What it is not: tensor-parallel (a column- or row-sharded A and B, S-LoRA's way, is not built).

Reference: vLLM `vllm/lora/layers/` (`ColumnParallelLinearWithLoRA` and the others: base layer + punica wrapper).
"""

from __future__ import annotations

import torch
from torch import nn


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, key: tuple[int, str], slots):
        super().__init__()
        self.base, self.key, self.slots = base, key, slots

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # [T, out]
        mapping = self.slots.mapping
        if mapping is None or not self.slots.active:
            return y
        return self.slots.add_delta(self.key, x, y)  # y + the delta (punica.py), by the manager's path


__all__ = ["LoRALinear"]
