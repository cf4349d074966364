"""Level 0: the naive baseline every other level imports and is measured against."""

from .config import EngineConfig
from .llm import LLM
from .loader import load_model
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling import RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "RequestOutputKind",
    "CompletionOutput",
    "Logprob",
    "EngineConfig",
    "load_model",
]
