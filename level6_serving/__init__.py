"""Level 6: serving. The engine core on a background thread behind an OpenAI-compatible HTTP API."""

from . import base
from .async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from .base import *  # noqa: F403 (the served level's names: base.py)

__all__ = [*base.__all__, "AsyncLLMEngine", "RequestStream", "EngineDeadError"]
