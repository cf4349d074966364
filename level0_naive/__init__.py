"""Level 0: the naive baseline every other level imports and is measured against."""

from . import api
from .api import CompletionOutput, Logprob, RequestOutput, RequestOutputKind, SamplingParams, load_model  # noqa: F401
from .config import CacheConfig, EngineConfig, ModelSettings, SchedulerConfig
from .llm import LLM


def __getattr__(name: str):
    return getattr(api, name)  # a room's name (StructuredOutputsParams), loaded when first asked for


__all__ = [*api.__all__, "LLM", "EngineConfig", "ModelSettings", "CacheConfig", "SchedulerConfig"]
