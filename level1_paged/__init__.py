"""Level 1: PagedAttention. Level 0's engine with a block-allocated KV cache."""

from level0_naive import CompletionOutput, Logprob, RequestOutput, SamplingParams, load_model

from .engine import LLM, PagedEngineConfig

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "PagedEngineConfig", "load_model"]
