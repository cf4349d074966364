"""`LoRALinear`: a base model's linear layer plus the batch's adapters, read from the device slots.

What it is: the module the LoRA slots (slots.py) put in place of each adapted projection of every
layer (the base `Linear` stays inside it, its weights and ops untouched):

    y = base(x)                                     [T, out], the base model's own
      + slots.add_delta(key, x, y) this step's delta (punica.py: one of the slots' paths, slots.py)

`slots.mapping` [T] is this step's adapter slot per row (-1: the base model), which the manager
sets before the forward (manager.py); with no adapter in the batch the layer is the base layer.

`RowParallelLoRALinear` is the same for level 5's row-parallel layers (o_proj, down_proj), whose
output on each rank is a partial sum: the rank's partial delta (its columns of A) joins it before the
all-reduce, so the adapter costs no message of its own:

    y = all_reduce( x_r W_r^T + scale (x_r A_r^T) B^T ) + bias      (sum over r of x_r A_r^T = x A^T)

A column-parallel layer (qkv, gate_up) needs nothing special: its rows of B give its outputs' delta.

Reference: vLLM `vllm/lora/layers/` (`ColumnParallelLinearWithLoRA`, `RowParallelLinearWithLoRA`: base
layer + punica wrapper).
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
        return self.slots.add_delta(self.key, x, y)  # y + the delta (punica.py), by the slots' path


class RowParallelLoRALinear(LoRALinear):
    """A row-parallel projection (level 5's `RowParallelLinear`: `partial`, then `reduce`) with the delta
    added to the rank's partial output, before the all-reduce sums the ranks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base.partial(x)  # [T, out]: this rank's share (x_r is this rank's columns of the input)
        if self.slots.mapping is not None and self.slots.active:
            y = self.slots.add_delta(self.key, x, y)  # + this rank's share of the delta
        return self.base.reduce(y)


__all__ = ["LoRALinear", "RowParallelLoRALinear"]
