"""Level 6: serving. The engine core on a background thread behind an OpenAI-compatible HTTP API."""

from .async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from .base import (
    LLM,
    CompletionOutput,
    LLMEngine,
    Logprob,
    Request,
    RequestOutput,
    RequestOutputKind,
    RequestStatus,
    SamplingParams,
    SpecDecodeStats,
    SpeculativeConfig,
    StructuredOutputsParams,
    load_model,
)

__all__ = ["LLM", "LLMEngine", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "RequestOutputKind", "CompletionOutput", "Logprob",
           "SpeculativeConfig", "SpecDecodeStats", "Request", "RequestStatus", "load_model", "AsyncLLMEngine",
           "RequestStream", "EngineDeadError"]  # fmt: skip
