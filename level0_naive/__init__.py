"""Level 0: the naive baseline every other level imports and is measured against."""

from .config import EngineConfig
from .engine import LLM
from .loader import load_model
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "EngineConfig", "load_model"]
