"""Level 0: the naive baseline every other level imports and is measured against."""

from ladder import rooms

from .config import CacheConfig, EngineConfig, ModelSettings, SchedulerConfig
from .llm import LLM
from .loader import load_model
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import RequestOutputKind, SamplingParams


def __getattr__(name: str):
    """The public names a room lends every level (StructuredOutputsParams), loaded when first asked for."""
    return rooms.export(name)


__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "RequestOutputKind",
    "CompletionOutput",
    "Logprob",
    "EngineConfig",
    "ModelSettings",
    "CacheConfig",
    "SchedulerConfig",
    "load_model",
]
