"""`quantize(model, method)`: every projection of a loaded model stored in 8 or 4 bits, in place.

What it is: the step after loading. Each module that computes through the ops seam (it has `ops`)
with a 2-D weight is a projection (level 0's q, k, v, o, gate, up, down; level 5's fused and sharded
ones); its float weight is replaced by the quantized one (formats.py) and freed, and the model's ops
become `QuantizedOps` over the ones it had. Left in the model's dtype: the embeddings, the norms,
and the LM head (a tied head is the embedding; gpt-fast and vLLM keep it too by default).

What it is not: a format (formats.py), or reversible (the float weights are gone; reload to undo).
"""

from __future__ import annotations

import torch
from torch import nn

from .formats import FORMATS, GROUP, Int4Weight, Int8Weight
from .ops import QuantizedOps

METHODS = tuple(FORMATS)  # "int8", "int4"


def quantize(model: nn.Module, method: str, use_kernel: bool = True) -> int:
    """Quantize `model`'s projections with `method` ("int8" | "int4"); returns how many. One-line errors
    for what is not built (a mixture of experts) or a shape the format cannot take."""
    if method not in FORMATS:
        raise ValueError(f"quantization={method!r} is not one of: {', '.join(FORMATS)}")
    if getattr(getattr(model, "config", None), "moe", None) is not None:
        raise ValueError(f"quantization={method!r} with a mixture-of-experts model is not built (its experts' linears)")
    targets = [(name, m) for name, m in model.named_modules()
               if hasattr(m, "ops") and isinstance(getattr(m, "weight", None), nn.Parameter) and m.weight.dim() == 2
               and not name.endswith("lm_head")]  # fmt: skip
    for name, module in targets:  # every shape checked before the first weight is replaced
        if method == "int4" and module.weight.shape[1] % GROUP:
            raise ValueError(f"quantization='int4': {name} has {module.weight.shape[1]} inputs, not a multiple of "
                             f"the group ({GROUP})")  # fmt: skip
    with torch.no_grad():
        for _, module in targets:
            quantized = FORMATS[method](module.weight.data)
            del module.weight  # the float Parameter goes
            module.weight = quantized  # a plain attribute: what ops.linear receives
    model.set_ops(QuantizedOps(model.ops, use_kernel))
    if torch.cuda.is_available() and any(p.is_cuda for p in model.parameters()):
        torch.cuda.empty_cache()  # the freed float weights back to the device, where the KV budget is measured
    return len(targets)


def quantized_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the quantized weights, bytes of the model's remaining float parameters)."""
    q = sum(
        m.weight.nbytes for m in model.modules() if isinstance(getattr(m, "weight", None), (Int8Weight, Int4Weight))
    )
    return q, sum(p.numel() * p.element_size() for p in model.parameters())


__all__ = ["METHODS", "quantize", "quantized_bytes"]
