"""CUDA graphs: each compiled piece recorded once per padded batch size, then replayed.

What it is: `capture_wrapper(sizes)`, what piecewise.py wraps every compiled piece with on a GPU.
A decode step of a small model is dozens of kernel launches of a few microseconds each, and the
CPU that issues them is slower than the GPU that runs them: the GPU waits. A CUDA graph records
the launches of one call once and replays them all with one launch. It replays the same
kernels on the same memory, so a graph is made per batch size (hence the padding to a few
sizes, runner.py) and its inputs must be where they were at capture:

    size 8, first call     run the piece (a warm-up: Inductor's and the allocator's first-time work)
    size 8, second call    inputs that are not the model's weights or buffers are activations:
                           copy them into buffers of our own; capture the piece on those buffers
    size 8, later calls    copy the activations into the buffers, replay the graph, return
                           its (graph-owned) outputs

(Which inputs are weights is known from the model, not guessed from where an input lives: the
caching allocator hands a step's activations the same addresses as the last step's, often.)
    another size           run the piece as compiled (never captured)

Attention pieces are never wrapped (piecewise.py does not compile them): their inputs change
with every step's context, and the Triton kernel runs between the replays.

Known costs, not yet cut: every (piece, size) keeps its own input buffers and outputs (vLLM shares
one buffer of the largest size and keeps weak references to outputs), and the graphs are captured
after the KV cache was sized, outside its budget; each capture also runs a garbage collection.
For the built-in model this is megabytes; for a large model give few capture sizes.

What it is not: tested on this project's CPU machines (`tests/test_compilation.py` runs it only
where CUDA is; `benchmarks/sim/gpu_check.sh` times it against eager), or vLLM's full graph mode
(the whole step, attention included, in one graph: needs attention metadata in fixed buffers).

Reference: vLLM `vllm/compilation/cuda_graph.py` (`CUDAGraphWrapper`) and
`v1/worker/gpu_model_runner.py` (`capture_model`); PyTorch's `torch.cuda.graph`.
"""

from __future__ import annotations

import torch

from .attention_op import CONTEXT


class CapturedPiece:
    """One compiled piece, captured per padded size (see the module docstring)."""

    def __init__(self, fn, sizes: list[int], pool, fixed: set[int]):
        self.fn, self.sizes, self.pool = fn, set(sizes), pool
        self.fixed = fixed  # data pointers of the model's weights and buffers: read in place
        self.warmed: set[int] = set()  # sizes run once
        self.graphs: dict[int, tuple] = {}  # size -> (graph, moving arg indices, static args, static outputs)

    def __call__(self, *args):
        size = CONTEXT.padded_tokens
        if size not in self.sizes:
            return self.fn(*args)
        if size not in self.warmed:
            self.warmed.add(size)
            return self.fn(*args)
        if size not in self.graphs:
            self.graphs[size] = self._capture(args)
        graph, moving, static_args, outputs = self.graphs[size]
        for i in moving:
            static_args[i].copy_(args[i], non_blocking=True)
        graph.replay()
        return outputs

    def _capture(self, args):
        moving = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.data_ptr() not in self.fixed]
        static_args = list(args)
        for i in moving:
            a = args[i]  # a buffer of our own, where the graph will read, with the input's strides
            static_args[i] = torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device).copy_(a)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self.fn(*static_args)
        torch.cuda.synchronize()
        return graph, moving, static_args, outputs


def capture_wrapper(sizes: list[int], model: torch.nn.Module):
    """-> (compiled piece -> the piece captured per size in `sizes`), one memory pool for all."""
    pool = torch.cuda.graph_pool_handle()
    fixed = {t.data_ptr() for t in [*model.parameters(), *model.buffers()]}

    def wrap(fn):
        return CapturedPiece(fn, sizes, pool, fixed)

    return wrap


__all__ = ["CapturedPiece", "capture_wrapper"]
