"""Level 5: tensor and pipeline parallelism. Level 4's engine with its target split over ranks."""

from level0_naive import api
from level0_naive.api import *  # noqa: F403 (the names every level exports)
from level2_continuous import RequestStatus
from level4_speculative import Request, SpeculativeConfig

from .config import ParallelConfig
from .engine import LLM, LLMEngine, ParallelEngine
from .executor import WorkerDiedError

__all__ = [*api.__all__, "LLM", "LLMEngine", "ParallelEngine", "SpeculativeConfig", "ParallelConfig", "WorkerDiedError",
           "Request", "RequestStatus"]  # fmt: skip
