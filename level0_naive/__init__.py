"""Level 0: the naive baseline every other level imports and is measured against."""

from .config import EngineConfig
from .llm import LLM
from .loader import load_model
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling import RequestOutputKind, SamplingParams
from .structured import StructuredOutputsParams

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "RequestOutputKind",
    "CompletionOutput",
    "Logprob",
    "EngineConfig",
    "load_model",
]
