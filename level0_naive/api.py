"""The names every level exports, so that a script picks a level by its module name alone.

What it is: `SamplingParams`, `RequestOutputKind`, `RequestOutput`, `CompletionOutput`,
`Logprob`, `load_model` and `StructuredOutputsParams` (a room's, loaded when first asked for:
ladder/rooms.py). Every level's `__init__.py` re-exports them (`from level0_naive.api import *`)
beside its own `LLM` (and from level 2 on `LLMEngine`):

    for name in ["level0_naive", "level1_paged", "level2_continuous", "level3_prefix"]:
        LLM = importlib.import_module(name).LLM      # the same SamplingParams works with each

What it is not: a level's own names (each `__init__.py` adds those).
"""

from ladder import rooms

from .loader import load_model
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import RequestOutputKind, SamplingParams


def __getattr__(name: str):
    """The public names a room lends every level (StructuredOutputsParams), loaded when first asked for."""
    return rooms.export(name)


__all__ = [  # noqa: F822 (StructuredOutputsParams is a room's: __getattr__)
    "SamplingParams", "StructuredOutputsParams", "RequestOutput", "RequestOutputKind", "CompletionOutput", "Logprob",
    "load_model",
]  # fmt: skip
