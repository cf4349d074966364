"""Level 3: automatic prefix caching. Level 2 with a hash-named, ref-counted block pool (and beam search on it)."""

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

from .beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from .block_hash import PrefixRequest
from .engine import LLM, LLMEngine, PrefixCacheConfig, PrefixCachingEngine

__all__ = [
    "LLM",
    "LLMEngine",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "PrefixCachingEngine",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "RequestOutputKind",
    "CompletionOutput",
    "Logprob",
    "PrefixCacheConfig",
    "Request",
    "PrefixRequest",
    "RequestStatus",
    "load_model",
]
