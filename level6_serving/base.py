"""The engine level 6 serves: the one place where the level below is named.

What it is: the offline front end (`LLM`) and engine core (`LLMEngine`) that the server
wraps, and the public names every level exports. The engine is level 5's: level 4's
(prefix caching, optional speculative decoding) whose target model can be split over
`tensor_parallel_size` x `pipeline_parallel_size` ranks; with both sizes 1 it is level
4, step for step. Every other file of level 6 imports the engine from here, so serving
another level's engine is a change of this one import (`__main__.py` passes
`--tensor-parallel-size` / `--pipeline-parallel-size` only to an engine whose
configuration has those fields, and refuses a size other than 1 in one line otherwise).

What it is not: a new engine. Level 6 adds serving, not a model or cache idea.
"""

from __future__ import annotations

from level4_speculative import SpecDecodeStats  # level 5 does not re-export it

# The one line that names the engine level 6 serves (level 4's would be `from level4_speculative import ...`).
from level5_multigpu import (
    LLM,
    CompletionOutput,
    LLMEngine,
    Logprob,
    Request,
    RequestOutput,
    RequestOutputKind,
    RequestStatus,
    SamplingParams,
    SpeculativeConfig,
    StructuredOutputsParams,
    load_model,
)

__all__ = ["LLM", "LLMEngine", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "RequestOutputKind", "CompletionOutput", "Logprob",
           "SpeculativeConfig", "SpecDecodeStats", "Request", "RequestStatus", "load_model"]  # fmt: skip
