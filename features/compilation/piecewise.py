"""The backend Dynamo hands the traced model to: split the graph at attention, compile each piece.

What it is: `Backend`, a `torch.compile` backend (a function of the traced `GraphModule` and its
example inputs that returns what to run instead). With splitting ops (on a GPU: attention) it
cuts the graph at every call of them with `torch.fx`'s `split_module`:

    traced:  embed, norm, qkv, rope | attention(0) | o, add, norm, mlp, add, norm, qkv, rope | attention(1) | ...
    pieces:  submod_0                 submod_1       submod_2                                   submod_3       ...
             compiled                 left as is      compiled                                   left as is

and compiles each piece apart (Inductor, or nothing for `backend="eager"`), so what runs between
two attention calls is fused code that never sees the paged cache. The pieces are compiled on
fake tensors with the trace's symbolic token count, so one compile serves every batch size.
On a GPU each piece is then wrapped to be captured as a CUDA graph per padded size
(cuda_graphs.py): the attention pieces, whose inputs change shape with the context, run outside.
Without splitting ops (a CPU's default) the whole graph goes to Inductor in one piece, the
attention op an opaque call inside it.

`Counters` records what was compiled (graphs Dynamo traced, pieces compiled) and how long it
took: the test that nothing recompiles reads them, and the runner reports them.

What it is not: vLLM's pass manager (no fusion passes of our own: Inductor's are used as they
are), or a cache of our own (Inductor's on-disk cache is the cache: runner.py reports it).

Reference: vLLM `vllm/compilation/backends.py` (`VllmBackend`, `split_graph`,
`PiecewiseCompileInterpreter`), and `torch.fx.passes.split_module`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch._guards import detect_fake_mode
from torch.fx.passes.split_module import split_module

from .attention_op import ATTENTION_OPS


@dataclass
class Counters:
    graphs: int = 0  # graphs Dynamo handed to the backend (one per distinct guard set: a recompile adds one)
    pieces: int = 0  # pieces compiled (a graph without splitting is one piece)
    splits: int = 0  # attention calls the graph was split at
    compile_s: float = 0.0  # seconds spent in the backend (Inductor's compile, or a cache hit's load)


def is_split_point(node: torch.fx.Node, split_at: list[str]) -> bool:
    return node.op == "call_function" and "ladder.attention" in split_at and node.target in ATTENTION_OPS


def split_graph(gm: torch.fx.GraphModule, split_at: list[str]) -> tuple[torch.fx.GraphModule, int]:
    """gm -> (a GraphModule calling submod_0, submod_1, ... in order, how many split points):
    every split point alone in its own piece, the nodes between two of them in one."""
    piece, ids, splits = 0, {}, 0
    for node in gm.graph.nodes:
        if is_split_point(node, split_at):
            ids[node] = piece + 1
            piece += 2
            splits += 1
        else:
            ids[node] = piece
    return split_module(gm, None, lambda node: ids[node], keep_original_order=True), splits


class Piece(torch.nn.Module):
    """A compiled piece in the split graph's place (a submodule must be a Module)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


class Releasable:
    """What the backend hands Dynamo: the compiled code behind one reference that `release` drops.
    Dynamo keeps every graph it compiled for a function, for the life of the process, and every
    engine's runner compiles the same function: without this, an engine's compiled code (and on a
    GPU its captured graphs and their memory) would outlive the engine."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        if self.fn is None:
            raise RuntimeError("this engine's compiled model was released (the engine is gone)")
        return self.fn(*args)


class _CompilePieces(torch.fx.Interpreter):
    """Runs the split graph on fake tensors; each piece without a split point is compiled on the
    fake arguments it receives (their shapes symbolic where the trace's were) and put in its place."""

    def __init__(self, split: torch.fx.GraphModule, compile_piece, split_at: list[str]):
        super().__init__(split)
        self.compile_piece, self.split_at = compile_piece, split_at

    def call_module(self, target, args, kwargs):
        out = super().call_module(target, args, kwargs)  # on fake tensors: shapes only
        sub = getattr(self.module, target)
        if not any(is_split_point(n, self.split_at) for n in sub.graph.nodes):
            setattr(self.module, target, Piece(self.compile_piece(sub, list(args))))
        return out


class Backend:
    """`torch.compile(fn, backend=Backend(...))`: split at `split_at`, compile the pieces with `compiler`."""

    def __init__(self, compiler: str, split_at: list[str], wrap_piece=None, inductor_settings: dict | None = None):
        self.compiler, self.split_at = compiler, split_at
        self.inductor_settings = inductor_settings or {}  # torch._inductor.config while compiling
        self.wrap_piece = wrap_piece  # piece callable -> callable: cuda_graphs.py's capture, on a GPU
        self.wrapped: list = []  # the pieces it wrapped
        self.handed_out: list[Releasable] = []  # what it gave Dynamo, emptied by release()
        self.counters = Counters()

    def compile_piece(self, gm: torch.fx.GraphModule, example_inputs: list, wrap: bool = True):
        self.counters.pieces += 1
        if self.compiler == "eager":
            fn = gm  # Dynamo's graph, run op by op: what the trace captured, no compiler
        else:
            import torch._inductor.config
            from torch._inductor.compile_fx import compile_fx

            with torch._inductor.config.patch(self.inductor_settings):
                fn = compile_fx(gm, example_inputs)
        if self.wrap_piece is None or not wrap:
            return fn
        self.wrapped.append(self.wrap_piece(fn))
        return self.wrapped[-1]

    def release_later(self, fn) -> Releasable:
        self.handed_out.append(Releasable(fn))
        return self.handed_out[-1]

    def release(self) -> None:
        """Drop the compiled code and captured graphs (the runner's finalizer calls it)."""
        for r in self.handed_out:
            r.fn = None
        self.handed_out.clear()
        self.wrapped.clear()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list):
        start = time.perf_counter()
        self.counters.graphs += 1
        try:
            if not self.split_at:  # one piece, attention inside it: never captured (config.graphs_captured)
                return self.release_later(self.compile_piece(gm, example_inputs, wrap=False))
            split, self.counters.splits = split_graph(gm, self.split_at)
            fake_mode = detect_fake_mode()  # the trace's: it knows the symbolic token count of these inputs
            fake = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
            with fake_mode:
                _CompilePieces(split, self.compile_piece, self.split_at).run(*fake)
            return self.release_later(split)
        finally:
            self.counters.compile_s += time.perf_counter() - start


__all__ = ["Backend", "Counters", "split_graph"]
