"""Level 2: continuous batching. An iteration-level scheduler over level 1's paged cache."""

from level0_naive import (
    CompletionOutput,
    Logprob,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    load_model,
)

from .engine import LLM, ContinuousEngine, ContinuousSchedulerConfig, LLMEngine
from .kv_cache_manager import KVCacheManager, SimpleKVCacheManager
from .request import Request, RequestStatus
from .scheduler import ModelRunnerOutput, Scheduler, SchedulerOutput

__all__ = [
    "LLM",
    "LLMEngine",
    "ContinuousEngine",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "RequestOutputKind",
    "CompletionOutput",
    "Logprob",
    "ContinuousSchedulerConfig",
    "KVCacheManager",
    "SimpleKVCacheManager",
    "ModelRunnerOutput",
    "Scheduler",
    "SchedulerOutput",
    "Request",
    "RequestStatus",
    "load_model",
]
