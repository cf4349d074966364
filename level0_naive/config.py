"""Engine configuration: every setting of `LLM(...)`, in parts, as vLLM's `VllmConfig` holds them.

What it is: `EngineConfig`, one object per engine, made of parts, each a dataclass of the
settings of one concern with its validation (a `ValueError` naming the setting):

    config.model       ModelSettings     the checkpoint, dtype, device, max_model_len, seed, and
                                         the settings a room answers (ops, batch_invariant, ...)
    config.cache       CacheConfig       the KV budget
    config.scheduler   SchedulerConfig   the batch's seats (`max_num_seqs`)

An engine names its part classes (`config_parts`); a subclass may swap or add one. The
keywords stay flat, as vLLM's `LLM(...)` takes them: `LLM(model, dtype="float32",
max_num_seqs=8)` gives each keyword to the part that has it; one no part has is a `TypeError`.
The "auto" rules for device, dtype and the KV memory budget are here too.

What it is not: global state (every engine owns its config). Later levels extend the parts
(level 1's cache adds the block size and attention backend, level 2's scheduler the token
budget, level 3 prefix caching) or add one (level 4: `speculative`, level 5: `parallel`).

Reference: vLLM `vllm/config/` (`VllmConfig`, `ModelConfig`, `CacheConfig`, `SchedulerConfig`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

import torch

from ladder import models, rooms

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
}  # fmt: skip
OPS_NAMES = ("auto", "cpu", "torch")


class Part:
    """A part of the config: a dataclass whose fields are `LLM(...)` keywords (a part may take others)."""

    @classmethod
    def setting_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_settings(cls, **settings):
        return cls(**settings)


@dataclass
class ModelSettings(Part):
    model: str  # a directory, a built-in name or a hub id (ladder/models.py finds it, downloading on first use)
    revision: str | None = None  # a hub id's branch, tag or commit (None: main)
    download_dir: str | None = None  # where a hub id is downloaded (None: the Hugging Face cache)
    dtype: str | torch.dtype = "auto"  # "auto": float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # "auto": CUDA if available, else CPU
    # None: what the model was trained for (the tokenizer's model_max_length, when it says less than the
    # checkpoint's max_position_embeddings); -1: max_position_embeddings, however far past training that is
    max_model_len: int | None = None
    seed: int = 0  # seeds every unseeded sampling request, so whole runs repeat
    # The settings a room answers (ladder/rooms.py says which room, docs/engine_core.md draws them):
    ops: str = "auto"  # the model's norms and RoPE: torch (ops.py) | cpu | auto (compiled on a CPU when it builds)
    # the same bits for a request alone or in any batch; the default from LADDER_BATCH_INVARIANT=1 (vLLM's name)
    batch_invariant: bool = field(default_factory=lambda: os.environ.get("LADDER_BATCH_INVARIANT", "0") == "1")
    structured_outputs_backend: str = "auto"  # which compiler a request's structured_outputs gets
    quantization: str | None = None  # the projections' weights stored in "int8" or "int4" (vLLM's keyword)

    def __post_init__(self):
        self.model = models.pinned(self.model, self.revision, self.download_dir)  # with either: its directory
        if self.ops not in OPS_NAMES:
            raise ValueError(f"ops={self.ops!r} is not one of: {', '.join(OPS_NAMES)}")
        if self.structured_outputs_backend not in (backends := rooms.structured_outputs_backends()):
            raise ValueError(f"structured_outputs_backend={self.structured_outputs_backend!r} is not one of: "
                             f"{', '.join(backends)}")  # fmt: skip
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant={self.batch_invariant!r} must be True or False")
        if self.quantization is not None:
            if self.quantization not in (methods := rooms.quantization_methods()):
                raise ValueError(f"quantization={self.quantization!r} is not one of: {', '.join(methods)} (or None)")
            if self.batch_invariant:
                raise ValueError("quantization with batch_invariant=True is not built (the packed kernels are not "
                                 "fixed-order)")  # fmt: skip
        if self.max_model_len is not None and self.max_model_len < 2 and self.max_model_len != -1:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 2 (or -1: the model's positions)")


@dataclass
class CacheConfig(Part):
    kv_cache_memory: int | None = None  # KV budget in bytes; default 1 GiB on CPU
    gpu_memory_utilization: float = 0.9  # on CUDA without kv_cache_memory: fraction of total memory

    def __post_init__(self):
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory} must be a positive number of bytes")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")


@dataclass
class SchedulerConfig(Part):
    max_num_seqs: int = 256  # the most sequences in one batch

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")


PARTS = {"model": ModelSettings, "cache": CacheConfig, "scheduler": SchedulerConfig}  # level 0's


class EngineConfig:
    """`LLM(model, **settings)`'s settings, each given to the part that has it (see the module docstring)."""

    def __init__(self, model: str, parts: dict[str, type[Part]] | None = None, **settings):
        parts = PARTS if parts is None else parts
        settings["model"] = model
        known = self.setting_names(parts)
        unknown = sorted(set(settings) - known)
        if unknown:
            raise TypeError(f"unknown setting(s) {', '.join(unknown)}; this engine takes: {', '.join(sorted(known))}")
        self.parts = dict(parts)
        for name, part in parts.items():
            mine = {k: v for k, v in settings.items() if k in part.setting_names()}
            setattr(self, name, part.from_settings(**mine))

    @staticmethod
    def setting_names(parts: dict[str, type[Part]]) -> set[str]:
        """Every keyword an engine with these parts takes (what a command line may offer as flags)."""
        return {name for part in parts.values() for name in part.setting_names()}

    def __repr__(self) -> str:
        return "EngineConfig(" + ", ".join(f"{name}={getattr(self, name)!r}" for name in self.parts) + ")"


def resolve_device(device: str) -> torch.device:
    """ "auto" -> CUDA if available, else CPU; CUDA where there is none is a clear error, before any weight loads."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device={device!r} is not a device torch knows ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise ValueError(f"device={device!r} is not available ({why}); use 'cpu' or 'auto'")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_kv_budget(cfg: CacheConfig, device: torch.device) -> int:
    """The KV cache memory budget in bytes."""
    if cfg.kv_cache_memory is not None:
        return int(cfg.kv_cache_memory)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free  # weights and whatever else is already there
        return max(int(total * cfg.gpu_memory_utilization) - used, 0)
    return 1 << 30
