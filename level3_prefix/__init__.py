"""Level 3: automatic prefix caching. Level 2 with a hash-named, ref-counted block pool."""

from level0_naive import (
    CompletionOutput,
    Logprob,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    load_model,
)
from level2_continuous import Request, RequestStatus

from .engine import LLM, LLMEngine, PrefixCachingEngine, PrefixEngineConfig

__all__ = [
    "LLM",
    "LLMEngine",
    "PrefixCachingEngine",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "RequestOutputKind",
    "CompletionOutput",
    "Logprob",
    "PrefixEngineConfig",
    "Request",
    "RequestStatus",
    "load_model",
]
