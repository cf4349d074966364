"""Level 4: speculative decoding. Level 3's engine with a proposer and a rejection sampler."""

from level0_naive import (
    CompletionOutput,
    Logprob,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    load_model,
)
from level2_continuous import RequestStatus

from .config import SpeculativeConfig
from .engine import LLM, LLMEngine, SpecDecodeStats, SpeculativeEngine
from .request import SpecRequest as Request

__all__ = ["LLM", "LLMEngine", "SpeculativeEngine", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "RequestOutputKind", "CompletionOutput", "Logprob",
           "SpeculativeConfig", "SpecDecodeStats", "Request", "RequestStatus", "load_model"]  # fmt: skip
