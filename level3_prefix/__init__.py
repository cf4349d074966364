"""Level 3: automatic prefix caching. Level 2 with a hash-named, ref-counted block pool (and beam search on it)."""

from level0_naive import api
from level0_naive.api import *  # noqa: F403 (the names every level exports)
from level2_continuous import RequestStatus

from .beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from .block_hash import PrefixRequest
from .block_hash import PrefixRequest as Request  # level 2's, with its block names
from .engine import LLM, LLMEngine, PrefixCacheConfig, PrefixCachingEngine

__all__ = [*api.__all__, "LLM", "LLMEngine", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence",
           "PrefixCachingEngine", "PrefixCacheConfig", "Request", "PrefixRequest", "RequestStatus"]  # fmt: skip
