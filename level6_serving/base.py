"""The engine level 6 serves: the one place where the level below is named.

What it is: the offline front end (`LLM`) and engine core (`LLMEngine`) that the server
wraps, and the public names every level exports. Level 6 is meant to wrap level 5's
engine (tensor and pipeline parallelism); level 5 is being built, so this file imports
level 4's, and switching is this one import (every other file of level 6 imports from
here). The server's `--tensor-parallel-size` and `--pipeline-parallel-size` are passed to
the engine when its configuration has those fields; until then a size other than 1 is
refused with a one-line error (`__main__.py`).

What it is not: a new engine. Level 6 adds serving, not a model or cache idea.
"""

from __future__ import annotations

# Level 5 (level5_multigpu) is not built yet: the server wraps level 4's engine. To serve
# level 5's, change this one import.
from level4_speculative import (
    LLM,
    CompletionOutput,
    LLMEngine,
    Logprob,
    Request,
    RequestOutput,
    RequestOutputKind,
    RequestStatus,
    SamplingParams,
    SpecDecodeStats,
    SpeculativeConfig,
    load_model,
)

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "RequestOutputKind", "CompletionOutput", "Logprob",
           "SpeculativeConfig", "SpecDecodeStats", "Request", "RequestStatus", "load_model"]  # fmt: skip
