"""Level 2: continuous batching. An iteration-level scheduler over level 1's paged cache."""

from level0_naive import CompletionOutput, Logprob, RequestOutput, RequestOutputKind, SamplingParams, load_model

from .engine import LLM, ContinuousEngineConfig, LLMEngine, SamplerOutput
from .kv_cache_manager import KVCacheManager, SimpleKVCacheManager
from .request import Request, RequestStatus

__all__ = [
    "LLM",
    "LLMEngine",
    "SamplingParams",
    "RequestOutput",
    "RequestOutputKind",
    "CompletionOutput",
    "Logprob",
    "ContinuousEngineConfig",
    "KVCacheManager",
    "SimpleKVCacheManager",
    "SamplerOutput",
    "Request",
    "RequestStatus",
    "load_model",
]
