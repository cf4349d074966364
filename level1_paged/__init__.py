"""Level 1: PagedAttention. Level 0's engine with a block-allocated KV cache."""

from level0_naive import api
from level0_naive.api import *  # noqa: F403 (the names every level exports)

from .engine import LLM, PagedCacheConfig, PagedEngine
from .model_input import ModelInput
from .worker import Worker

__all__ = [*api.__all__, "LLM", "PagedCacheConfig", "PagedEngine", "ModelInput", "Worker"]
