"""Level 5: tensor and pipeline parallelism. Level 4's engine with its target split over ranks."""

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
from level4_speculative import Request, SpeculativeConfig

from .config import ParallelConfig
from .engine import LLM, LLMEngine, ParallelEngine
from .executor import WorkerDiedError

__all__ = ["LLM", "LLMEngine", "ParallelEngine", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "RequestOutputKind", "CompletionOutput", "Logprob",
           "SpeculativeConfig", "ParallelConfig", "WorkerDiedError", "Request", "RequestStatus", "load_model"]  # fmt: skip
