"""A PEFT LoRA checkpoint, read and checked against the base model: A and B per targeted layer.

What it is: `load_adapter(request, model_config, max_rank, dtype)`. A PEFT checkpoint is a folder
with `adapter_config.json` (r, lora_alpha, target_modules, use_rslora, ...) and
`adapter_model.safetensors`, whose names are the base model's with `.lora_A.weight` [r, in] and
`.lora_B.weight` [out, r] in place of `.weight`. The adapter changes a linear layer W to

    y = x W^T + scale * (x A^T) B^T,     scale = lora_alpha / r   (rsLoRA: lora_alpha / sqrt(r))

Every way an adapter can be wrong for this engine is a one-line ValueError naming it: a missing
file, a rank above max_lora_rank, a target this engine does not adapt (only the seven projections
below), a shape that does not fit the base model, a feature it does not build (DoRA, biases,
modules_to_save, per-layer ranks).

What it is not: a slot (manager.py puts an adapter's A and B where the batch reads them) or a trainer.

Reference: PEFT `tuners/lora/layer.py` (`Linear.forward`: scaling = lora_alpha / r) and its
checkpoint format; vLLM `vllm/lora/models.py` (`LoRAModel.from_local_checkpoint`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip
NAME = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class Adapter:
    lora_int_id: int
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, module) -> (A [r, in], B [out, r])

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def shapes(cfg) -> dict[str, tuple[int, int]]:
    """module -> (in, out) of the base model's seven projections (level 0's ModelConfig)."""
    q, kv, h, ff = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, ff),
            "up_proj": (h, ff), "down_proj": (ff, h)}  # fmt: skip


def load_adapter(request, cfg, max_rank: int, dtype: torch.dtype) -> Adapter:
    """The request's PEFT checkpoint -> an Adapter in `dtype`, or a one-line ValueError naming the problem."""
    from safetensors.torch import load_file

    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    folder = Path(request.lora_path)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for f in (config_file, weights_file):
        if not f.is_file():
            raise ValueError(f"{where}: no {f.name} there (a PEFT checkpoint has adapter_config.json and "
                             "adapter_model.safetensors)")  # fmt: skip
    try:
        conf = json.loads(config_file.read_text())
        tensors = load_file(str(weights_file))
    except Exception as e:  # noqa: BLE001 - whatever the parsers raise, one line naming the folder
        raise ValueError(f"{where}: unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(conf, dict):
        raise ValueError(f"{where}: adapter_config.json is not a JSON object")
    rank, alpha = int(conf.get("r", 0)), float(conf.get("lora_alpha", conf.get("r", 0)))
    if not 1 <= rank <= max_rank:
        raise ValueError(f"{where}: rank r={rank} is above max_lora_rank={max_rank}" if rank > max_rank
                         else f"{where}: rank r={rank} must be >= 1")  # fmt: skip
    for feature, off in (("use_dora", False), ("bias", "none"), ("modules_to_save", None), ("rank_pattern", {}),
                         ("alpha_pattern", {})):  # fmt: skip
        if conf.get(feature, off) not in (off, None, {}, [], False):
            raise ValueError(f"{where}: {feature}={conf[feature]!r} is not supported")
    dims, weights = shapes(cfg), {}
    for name, tensor in tensors.items():
        m = NAME.search(name)
        if m is None:
            raise ValueError(f"{where}: tensor {name!r} adapts no layer this engine adapts ({', '.join(TARGETS)})")
        layer, module, which = int(m[1]), m[3], m[4]
        if module not in TARGETS or layer >= cfg.num_layers:
            raise ValueError(f"{where}: tensor {name!r} targets {module} of layer {layer}; this engine adapts "
                             f"{', '.join(TARGETS)} of layers 0..{cfg.num_layers - 1}")  # fmt: skip
        n_in, n_out = dims[module]
        want = (rank, n_in) if which == "A" else (n_out, rank)
        if tuple(tensor.shape) != want:
            raise ValueError(f"{where}: {name} is {tuple(tensor.shape)}, the base model needs {want}")
        pair = weights.setdefault((layer, module), [None, None])
        pair[0 if which == "A" else 1] = tensor.to(dtype)
    if missing := [f"{m} of layer {i}" for (i, m), (a, b) in weights.items() if a is None or b is None]:
        raise ValueError(f"{where}: lora_A or lora_B missing for {missing[0]}")
    scale = alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank
    return Adapter(request.lora_int_id, rank, scale, {k: (a, b) for k, (a, b) in weights.items()})


__all__ = ["Adapter", "load_adapter", "TARGETS", "shapes"]
