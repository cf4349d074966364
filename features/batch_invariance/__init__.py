"""Room: batch invariance. A request's tokens and logprobs are the same bits alone or in any batch.

What it is: what `batch_invariant=True` (or LADDER_BATCH_INVARIANT=1) swaps in, each piece
behind a seam the levels already have:

    ops.py        `InvariantOps`: the ops seam (level0_naive/ops.py) with a matmul that adds over
                  k in order (invariant_ops.cpp), one code path for norms and SwiGLU
    attention.py  the attention backend (level 1): the compiled CPU kernel for every query
    sampler.py    `KeyedSampler`: the sampler's draw (level0_naive/sampler.py) keyed by the
                  request's seed and the token's position; level 4 verifies guesses against it
    demo.py       `python -m features.batch_invariance.demo`: one request alone and among
                  others, with and without the mode, and where the two runs part, layer by layer

The levels reach it only through `ladder/rooms.py`, by the setting's value. It builds on the
compiled CPU kernels (`features/cpu_kernels`), a room of its own.

What it is not: a GPU path, or a promise across machines, dtypes or tensor-parallel layouts
(docs/batch_invariance.md says what it does and does not promise, and what it costs).

Reference: He, "Defeating Nondeterminism in LLM Inference" (Thinking Machines, 2025); vLLM's
VLLM_BATCH_INVARIANT=1 (`model_executor/layers/batch_invariant.py`).
"""

from .attention import invariant_attention
from .ops import InvariantOps, invariant_ops
from .sampler import KeyedSampler, keyed_gumbel

__all__ = ["InvariantOps", "invariant_ops", "invariant_attention", "KeyedSampler", "keyed_gumbel"]
