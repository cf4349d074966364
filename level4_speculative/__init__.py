"""Level 4: speculative decoding. Level 3's engine with a proposer and a rejection sampler."""

from level0_naive import api
from level0_naive.api import *  # noqa: F403 (the names every level exports)
from level2_continuous import RequestStatus

from .config import SpeculativeConfig
from .engine import LLM, LLMEngine, SpecDecodeStats, SpeculativeEngine
from .request import SpecRequest as Request

__all__ = [*api.__all__, "LLM", "LLMEngine", "SpeculativeEngine", "SpeculativeConfig", "SpecDecodeStats", "Request",
           "RequestStatus"]  # fmt: skip
