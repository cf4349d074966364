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

What it is not: an attention kernel (the backend's is called). The context is per thread (vLLM's is
per process): engines stepping on two threads of one process never see each other's step.

Reference: vLLM `vllm/attention/layer.py` (`unified_attention`, `direct_register_custom_op`) and
`vllm/forward_context.py` (`set_forward_context`).
"""

from __future__ import annotations

import contextlib
import threading

import torch


class _Context(threading.local):
    """Per thread: two engines stepping on two threads of one process (two servers in a test) each
    see their own step."""

    def __init__(self):
        self.attn = None  # this step's attention backend object: (layer, q, k, v) -> out
        self.num_tokens = 0  # the step's real tokens; rows from here on are padding
        self.padded_tokens = 0  # the rows the graph runs (a capture size, or num_tokens)


CONTEXT = _Context()


@contextlib.contextmanager
def set_forward_context(attn, num_tokens: int, padded_tokens: int):
    """Within the block, `ladder.attention` runs `attn` on the first `num_tokens` of `padded_tokens` rows."""
    CONTEXT.attn, CONTEXT.num_tokens, CONTEXT.padded_tokens = attn, num_tokens, padded_tokens
    try:
        yield
    finally:
        CONTEXT.attn, CONTEXT.num_tokens, CONTEXT.padded_tokens = None, 0, 0


def attention_real(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """The op's implementation, run when the compiled code reaches it: q [Tp, Hq, D], k/v [Tp, Hkv, D] ->
    out [Tp, Hq, D], the step's backend on the first num_tokens rows (it writes their K/V into the cache
    and attends), zeros on the padding rows after them."""
    if CONTEXT.attn is None:
        raise RuntimeError("ladder.attention called outside set_forward_context (no step's attention backend)")
    n = CONTEXT.num_tokens
    if n == q.shape[0]:
        return CONTEXT.attn(layer, q, k, v).contiguous()
    out = q.new_zeros(q.shape)  # padding rows attend to nothing and write nowhere
    out[:n] = CONTEXT.attn(layer, q[:n], k[:n], v[:n])
    return out


def attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """The op's fake implementation, what Dynamo and Inductor run while tracing (on fake tensors: shapes,
    dtypes and devices, no values): an empty tensor shaped, typed and placed as the output."""
    return q.new_empty(q.shape)  # the output: one row per query, one head per query head


# Registered once, at import: the op's schema comes from attention_real's annotations; nothing it
# receives is written (mutates_args=()), the cache it writes is not an argument (see above).
attention = torch.library.custom_op("ladder::attention", attention_real, mutates_args=())
attention.register_fake(attention_fake)


class OpaqueAttention:
    """What the compiled model is handed as its attention backend: the custom op, nothing else."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.ladder.attention(q, k, v, layer)


OPAQUE = OpaqueAttention()
ATTENTION_OPS = (torch.ops.ladder.attention.default, torch.ops.ladder.attention)  # how the op appears in a graph
