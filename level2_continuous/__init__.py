"""Level 2: continuous batching. An iteration-level scheduler over level 1's paged cache."""

from level0_naive import api
from level0_naive.api import *  # noqa: F403 (the names every level exports)

from .engine import LLM, ContinuousEngine, ContinuousSchedulerConfig, LLMEngine
from .kv_cache_manager import KVCacheManager, SimpleKVCacheManager
from .request import Request, RequestStatus
from .scheduler import ModelRunnerOutput, Scheduler, SchedulerOutput

__all__ = [*api.__all__, "LLM", "LLMEngine", "ContinuousEngine", "ContinuousSchedulerConfig", "KVCacheManager",
           "SimpleKVCacheManager", "ModelRunnerOutput", "Scheduler", "SchedulerOutput", "Request", "RequestStatus"]  # fmt: skip
