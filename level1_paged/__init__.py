"""Level 1: PagedAttention. Level 0's engine with a block-allocated KV cache."""

from level0_naive import (
    CompletionOutput,
    Logprob,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    load_model,
)

from .engine import LLM, PagedCacheConfig, PagedEngine
from .model_input import ModelInput
from .worker import Worker

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "RequestOutputKind",
    "CompletionOutput",
    "Logprob",
    "PagedCacheConfig",
    "PagedEngine",
    "ModelInput",
    "Worker",
    "load_model",
]
