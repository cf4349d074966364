"""The registry of rooms: which capability answers a setting, imported only when it is asked for.

What it is: the one door between the levels and the rooms (`features/`). A room is a
capability that cuts across the levels; it lives in one package named for it and plugs
into a seam the levels expose. A level asks here, by a setting's value, and the room's
package is imported then, not before (structured outputs' at every engine's construction,
since any request may carry a spec; the others only where a setting or a checkpoint names them):

    the setting                                  the room                      the seam it plugs into
    ops="auto" | "cpu"                           features.cpu_kernels          the ops (level0_naive/ops.py)
    attention_backend="auto" | "cpu" on a CPU    features.cpu_kernels          the attention backend (level 1)
    batch_invariant=True                         features.batch_invariance     the ops, the attention backend,
                                                                               the sampler's draw
    SamplingParams(structured_outputs=...)       features.structured_outputs   the sampler's processors, the
                                                                               request's constraint (level 0)
    a checkpoint with experts (Mixtral, Qwen-MoE) features.moe                 the model's MLP, the loader,
                                                                               level 5's sharded layers
    compilation_config=3 (or a dict)             features.compilation          the worker's model runner (level 1)
    kv_transfer_config={...}                     features.kv_connectors        level 3's block pool and KV cache
                                                                               manager, level 1's worker
    enable_lora=True, lora_request=...           features.lora                 the model's projections, level 0's
                                                                               preparers, level 2's admission and
                                                                               step input, level 3's block names
    quantization="int8" | "int4"                 features.quantization         the ops (level 0), the loaded
                                                                               model's projections (level 0, and
                                                                               level 5's ranks)
    kv_cache_dtype="fp8" | "int8"                features.quantization         level 1's paged cache (its bytes)
                                                                               and attention backend

A level imports this file and never a room; a room imports the level files whose seams it
plugs into and never this file; this file imports no level and no room (only their names,
as strings). So the arrows run one way: levels -> ladder, rooms -> levels. Where a room is
the default today (the compiled CPU kernels), the default settings still reach it here.

What it is not: a plugin system (the table is written out, one line per room), or a place
for a room's logic: each function below picks a room and calls it.

Reference: vLLM's registries that map a setting to an implementation loaded on demand
(`model_executor/models/registry.py`'s lazy model classes, `attention/selector.py`).
"""

from __future__ import annotations

import importlib
from types import ModuleType

ROOMS = {
    "cpu_kernels": "features.cpu_kernels",
    "batch_invariance": "features.batch_invariance",
    "structured_outputs": "features.structured_outputs",
    "moe": "features.moe",
    "compilation": "features.compilation",
    "kv_connectors": "features.kv_connectors",
    "lora": "features.lora",
    "quantization": "features.quantization",
}
# Names a room lends a level's public API (`from level3_prefix import StructuredOutputsParams`).
EXPORTS = {"StructuredOutputsParams": "structured_outputs", "LoRARequest": "lora"}
# Checkpoint model types a room adds to the loader's dense Llama family.
ARCHITECTURES = {"mixtral": "moe", "qwen2_moe": "moe", "qwen3_moe": "moe"}


def load(room: str) -> ModuleType:
    """The room's package (imported on the first call)."""
    if room not in ROOMS:
        raise ValueError(f"there is no room {room!r}; the rooms are {', '.join(ROOMS)}")
    return importlib.import_module(ROOMS[room])


def export(name: str):
    """A public name a room lends the levels, or AttributeError (what a module's `__getattr__` raises)."""
    if name not in EXPORTS:
        raise AttributeError(name)
    return getattr(load(EXPORTS[name]), name)


def ops(name: str, batch_invariant: bool, device, dtype):
    """An engine's `ops=` and `batch_invariant=` -> the Ops its model computes with."""
    if batch_invariant:
        return load("batch_invariance").invariant_ops(device, dtype)
    return load("cpu_kernels").resolve_ops(name, device)


def attention(name: str, device, batch_invariant: bool):
    """`attention_backend=` on a CPU ("auto", "cpu") or with `batch_invariant=True` -> the compiled
    kernel's (write_kv, attend) and, on a CPU, its plan (level 1's AttentionImpl), or None where "auto"
    finds no compiler (the level's torch backend)."""
    if batch_invariant:
        return load("batch_invariance").invariant_attention(name, device)
    return load("cpu_kernels").attention_functions(name, device)


def sampler_class(batch_invariant: bool):
    """The sampler class a room swaps in (`batch_invariant=True`: draws keyed by position), or None."""
    return load("batch_invariance").KeyedSampler if batch_invariant else None


def logits_processors() -> list:
    """The processors rooms add to the sampler's chain (each applies only to the requests that ask)."""
    return [load("structured_outputs").GrammarMask()]


def structured_outputs_backends() -> tuple[str, ...]:
    """The values `structured_outputs_backend=` takes (the room's compilers)."""
    return load("structured_outputs").BACKENDS


def request_preparer(tokenizer, vocab_size: int, stop_ids: list[int], backend: str):
    """What prepares a request whose parameters ask for a room (structured outputs: its spec is
    compiled, each sample gets its constraint); `backend` is `structured_outputs_backend=`."""
    return load("structured_outputs").StructuredOutputManager(tokenizer, vocab_size, stop_ids, backend)


def architecture(model_type: str) -> ModuleType | None:
    """The room that adds this checkpoint model type, or None (the loader's own Llama family)."""
    return load(ARCHITECTURES[model_type]) if model_type in ARCHITECTURES else None


__all__ = ["ROOMS", "EXPORTS", "ARCHITECTURES", "load", "export", "ops", "attention", "sampler_class",
           "logits_processors", "structured_outputs_backends", "request_preparer", "architecture",
           "kv_connector", "lora_manager", "lora_books", "lora_slots",
           "quantization_methods", "quantize", "kv_cache_dtypes", "kv_format",
           "kv_head_bytes"]  # fmt: skip


def compilation_config(value, enforce_eager: bool):
    """`compilation_config=` and `enforce_eager=` -> the room's checked config, or None for eager
    (the room is not imported for the default)."""
    if value is None or value is False or value == 0:
        return None
    config = load("compilation").parse(value, enforce_eager)
    return config if config.compiled else None


def kv_connector(value, block_size: int, hash_fn, model: str = ""):
    """`kv_transfer_config=` -> the room's connector (both sides of vLLM's seam), or None without one."""
    return None if value is None else load("kv_connectors").make_connector(value, block_size, hash_fn, model)


def lora_manager(model, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None):
    """`enable_lora=True` -> the room's manager, its slots installed in `model`'s projections."""
    return load("lora").make_manager(model, max_loras, max_lora_rank, max_cpu_loras)


def lora_books(model_config, dtype, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None):
    """`enable_lora=True` over ranks (level 5's driver) -> the room's manager without slots (the ranks hold them)."""
    return load("lora").make_books(model_config, dtype, max_loras, max_lora_rank, max_cpu_loras)


def lora_slots(model, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None, fully_sharded: bool = False):
    """`enable_lora=True` on a rank (level 5) -> the room's slots, installed in its stage's layers (every adapter
    sharded S-LoRA's way with `fully_sharded_loras`)."""
    return load("lora").make_slots(model, max_loras, max_lora_rank, max_cpu_loras, fully_sharded)


def quantization_methods() -> tuple[str, ...]:
    """The values `quantization=` takes besides None (the room's formats)."""
    return load("quantization").METHODS


def kv_cache_dtypes() -> tuple[str, ...]:
    """The values `kv_cache_dtype=` takes besides "auto" (the model's dtype): the room's 8-bit formats."""
    return tuple(load("quantization").KV_FORMATS)


def kv_format(name: str, calculate_scales: bool = False):
    """`kv_cache_dtype=` -> the room's format (what a block stores, the write and attend over it), or None
    for "auto" (the model's dtype: the level's own cache)."""
    return None if name == "auto" else load("quantization").kv_format(name, calculate_scales)


def kv_head_bytes(name: str, head_dim: int) -> int | None:
    """One KV head's bytes in a token's slot for `kv_cache_dtype=` (None for "auto": the model's dtype decides)."""
    return None if name == "auto" else kv_format(name).head_bytes(head_dim)


def quantize(model, method: str | None) -> None:
    """`quantization=` -> the loaded model's projections in the room's format (None: left as loaded)."""
    if method is not None:
        load("quantization").quantize(model, method)


def model_runner(runner, compilation):
    """Level 0's `ModelRunner` and a `compilation_config` (or None) -> the runner a worker uses."""
    return runner if compilation is None else load("compilation").compiled_runner(runner, compilation)
