"""Level 2: continuous batching. An iteration-level scheduler over level 1's paged cache."""

from level0_naive import CompletionOutput, Logprob, RequestOutput, SamplingParams, load_model

from .engine import LLM, ContinuousEngineConfig, LLMEngine
from .request import Request, RequestStatus

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "ContinuousEngineConfig", "Request", "RequestStatus", "load_model"]
