"""The names every level exports, so that a script picks a level by its module name alone.

What it is: `SamplingParams`, `RequestOutputKind`, `RequestOutput`, `CompletionOutput`, `Logprob`,
`load_model`, and `StructuredOutputsParams` and `LoRARequest` (rooms' classes, which level 0 cannot
import: `__getattr__` fetches them through ladder/rooms.py; an engine serves a LoRARequest from
level 2 on, with enable_lora=True). Every level's `__init__.py` re-exports them
(`from level0_naive.api import *`) beside its own `LLM` (and from level 2 on `LLMEngine`).

What it is not: a level's own names (each `__init__.py` adds those).

Reference: vLLM's `vllm/__init__.py` (`LLM`, `SamplingParams`, `RequestOutput`, ... from one place).
"""

from ladder import rooms

from .loader import load_model
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import RequestOutputKind, SamplingParams


def __getattr__(name: str):
    """The public names a room lends every level (StructuredOutputsParams), through the registry."""
    return rooms.export(name)


__all__ = ["SamplingParams", "StructuredOutputsParams", "LoRARequest", "RequestOutput",  # noqa: F822 (__getattr__)
           "RequestOutputKind", "CompletionOutput", "Logprob", "load_model"]  # fmt: skip
