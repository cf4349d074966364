"""Attention as one opaque custom op, and the per-step forward context it reads the paged cache from.

What it is: `torch.ops.ladder.attention(q, k, v, layer)`, registered with `torch.library`, which
the compiled model calls in each layer instead of the engine's attention backend object. Dynamo
cannot trace the backend: it reads block tables with `.tolist()`, calls a C++ kernel through
ctypes and writes the KV cache in place, and every such thing is a graph break (40 breaks and a
recompile per layer, measured on the built-in model). So the graph sees attention as a single
call with a *fake implementation* (`register_fake`: "the output has q's shape and dtype"),
which is all Dynamo and Inductor need to trace around it.

What the op does not take as arguments is the trick (vLLM's `unified_attention`): the cache,
the block tables, the slot mapping and the sequence lengths change shape every step, so they
stay out of the graph. `set_forward_context(attn, num_tokens)` puts this step's attention
backend object (level 1's `PagedAttention`, level 3's copy-on-write one) where the op finds it;
the only shape the compiled graph ever sees change is T, the step's number of tokens.

    compiled graph:  embed -> [norm, qkv, rope] -> ladder.attention -> [o, norm, mlp] -> ... -> norm
                                                       |
    forward context: this step's backend ---------------+  (writes k, v into the cache, attends)

The op writes the cache: a side effect the graph does not see (the cache is not an argument).
That is safe because the op's output feeds the next layer, so no compiler moves or drops it,
and because `mutates_args=()` is honest about its arguments: q, k and v are only read.

Padding (a batch padded to a capture size): rows from `num_tokens` on are padding. The backend
gets only the real rows, so padding writes no slot; its output rows are zeros, never sampled
(the runner's logits indices point at real rows only).

What it is not: an attention kernel (the backend's is called), or thread-safe (one context per
process, as vLLM's: two engines never run a forward at the same time in one thread).

Reference: vLLM `vllm/attention/layer.py` (`unified_attention`, `direct_register_custom_op`) and
`vllm/forward_context.py` (`set_forward_context`).
"""

from __future__ import annotations

import contextlib

import torch


class _Context:
    attn = None  # this step's attention backend object: (layer, q, k, v) -> out
    num_tokens = 0  # the step's real tokens; rows from here on are padding
    padded_tokens = 0  # the rows the graph runs (a capture size, or num_tokens)


CONTEXT = _Context()


@contextlib.contextmanager
def set_forward_context(attn, num_tokens: int, padded_tokens: int):
    """Within the block, `ladder.attention` runs `attn` on the first `num_tokens` of `padded_tokens` rows."""
    CONTEXT.attn, CONTEXT.num_tokens, CONTEXT.padded_tokens = attn, num_tokens, padded_tokens
    try:
        yield
    finally:
        CONTEXT.attn, CONTEXT.num_tokens, CONTEXT.padded_tokens = None, 0, 0


@torch.library.custom_op("ladder::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """q [Tp, Hq, D], k/v [Tp, Hkv, D] -> out [Tp, Hq, D]: the step's backend on the real rows, zeros on padding."""
    if CONTEXT.attn is None:
        raise RuntimeError("ladder.attention called outside set_forward_context (no step's attention backend)")
    n = CONTEXT.num_tokens
    if n == q.shape[0]:
        return CONTEXT.attn(layer, q, k, v).contiguous()
    out = q.new_zeros(q.shape)  # padding rows attend to nothing and write nowhere
    out[:n] = CONTEXT.attn(layer, q[:n], k[:n], v[:n])
    return out


@attention.register_fake
def _(q, k, v, layer):
    return q.new_empty(q.shape)  # all a tracer needs to know: q's shape and dtype


class OpaqueAttention:
    """What the compiled model is handed as its attention backend: the custom op, nothing else."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.ladder.attention(q, k, v, layer)


OPAQUE = OpaqueAttention()
ATTENTION_OPS = (torch.ops.ladder.attention.default, torch.ops.ladder.attention)  # how the op appears in a graph
