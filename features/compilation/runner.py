"""The compiled model runner: level 0's `ModelRunner.forward`, through `torch.compile`, same answers.

What it is: `CompiledRunner(runner, config)`, what level 1's worker holds instead of its
`ModelRunner` when `compilation_config` asks for compilation. One step:

    batch (T tokens) --pad to a capture size--> input_ids, positions [Tp]       (on a CPU by default: Tp = T)
        set_forward_context(this step's attention backend, T)                    (attention_op.py)
        compiled(input_ids, positions, *side) -> hidden [Tp, hidden]              (the graph; pieces: piecewise.py)
        logits of the rows batch.logits_indices names (real rows only)           (eager: one matmul)

Dynamo traces the model once on the first call and Inductor compiles it; the token count is
marked dynamic, so one graph serves every T from 2 up (Dynamo always specialises a size of 1:
a second graph for T = 1). Both are compiled at start-up by a warm-up forward whose attention
writes nowhere, and the start-up log says how long it took and how big Inductor's on-disk cache
is (a second start loads from it: `TORCHINDUCTOR_CACHE_DIR`, by default a folder in /tmp).

The model's ops must be traceable: the CPU room's compiled RMSNorm and RoPE (ctypes calls) are
swapped for the torch formulas, which Inductor fuses into its own C++ loops. Attention stays
the engine's own backend (the C++ kernel on a CPU, Triton on a GPU), called by the opaque op.

It never crashes and never slows down silently: if compiling fails (no C++ compiler, a model
Dynamo cannot trace, a recompile limit) the runner says why in one log line and runs eager.

What it is not: a second model (the same modules and weights), or a cache of compiled code of our
own (Inductor's). Not built: compiling with `batch_invariant=True` (refused). Each of level 5's
ranks holds one on a CPU: its all-reduces are an opaque op too (level5_multigpu/parallel_state.py),
a later pipeline stage's input hidden states are its `step_inputs`, and a rank calls `hidden_states`
(a stage hands on hidden states, not logits). A warm-up that fails runs the rest of its forwards
eager where the model says its forward sends messages (`forward_sends_messages`), so every rank of a
stage makes the same all-reduces; a message that fails in the warm-up is raised, not taken for a
compile that failed. Level 4's draft model has a runner of its own, compiled too. EAGLE's head reads
the target's hidden states, which this runner keeps as the eager one does (`keep_hidden`: the
graph's output, the real rows); compiled (when asked for: the room's `compiled_runner` says why not
by default), its features are a graph input: a model's other per-token inputs (`model.step_inputs`)
are passed and padded beside the tokens. It changes Dynamo's recompile limits for the whole process
(`_allow_many_engines`).

Reference: vLLM `vllm/compilation/decorators.py` (`support_torch_compile`, `mark_dynamic` on
the token dimension) and `v1/worker/gpu_model_runner.py` (`_dummy_run`, `capture_model`).
"""

from __future__ import annotations

import bisect
import logging
import time
import weakref
from contextlib import contextmanager
from pathlib import Path

import torch
import torch._dynamo
from torch.utils._python_dispatch import _get_current_dispatch_mode

from level0_naive.model_runner import FlatBatch, ModelRunner
from level0_naive.ops import DEFAULT_OPS

from .attention_op import OPAQUE, set_forward_context
from .config import CompilationConfig
from .piecewise import Backend

log = logging.getLogger(__name__)
# What a compile can raise once the engine runs (a recompile): Dynamo's and Inductor's errors, and the
# recompile limit. Anything else (a kernel's IndexError, out of memory) is the step's, and propagates.
COMPILE_ERRORS = (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit)


def _allow_many_engines() -> None:
    """Dynamo keeps every graph of one function in one list, whichever engine traced it, and
    past `recompile_limit` (8) runs the function eager *silently*. Every engine's runner traces
    the same function (two graphs each), so raise the limit, and make reaching it an error that
    the runner catches and says (never a silent slowdown)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 1024)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 8192)
    torch._dynamo.config.fail_on_recompile_limit_hit = True


def inductor_cache() -> tuple[Path, int]:
    """Inductor's on-disk cache folder and the bytes in it."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    root = Path(cache_dir())
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.exists() else 0
    return root, size


def first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"


@contextmanager
def _freezing(on: bool | None):
    """`torch._inductor.config.freezing` set to `on` for one call of the graph (set and put back by hand:
    `config.patch` costs 13 us a call, this 4), so a trace in it (the first call, or a recompile) sees it;
    None leaves it as it is."""
    import torch._inductor.config as inductor

    if on is None:
        yield
        return
    old = inductor.freezing
    inductor.freezing = on
    try:
        yield
    finally:
        inductor.freezing = old


class _WriteNowhere:
    """The warm-up's attention: zeros out, nothing written (the cache is not touched)."""

    def __call__(self, layer, q, k, v):
        return torch.zeros_like(q)


class CompiledRunner:
    """`ModelRunner`'s forward through `torch.compile` (see the module docstring)."""

    def __init__(self, runner: ModelRunner, config: CompilationConfig, wrap_piece=None):
        self.runner, self.model, self.device = runner, runner.model, runner.device
        self.config = config
        self.capture_sizes = config.capture_sizes(self.device.type)  # ascending; [] = no padding
        settings = config.inductor_settings(self.device.type)
        self.backend = Backend(config.backend, config.split_at(self.device.type), wrap_piece, settings)
        # Dynamo itself reads Inductor's `freezing` while it traces (whether the weights are constants of
        # the graph or inputs to it), so that one is set around every call of the graph, not only the compile
        self.freezing = settings.get("freezing") if config.backend == "inductor" else None
        self.eager_reason: str | None = None  # why this runner fell back to eager, once it has
        self.compiled_steps = 0  # the steps that ran through the graph (not the warm-up's)
        self.eager_ops = self.model.ops  # given back on a fallback: eager is then exactly enforce_eager's
        if not getattr(self.model.ops, "traceable", True):
            self.model.set_ops(DEFAULT_OPS)  # the torch formulas: Inductor fuses them
        weakref.finalize(self, self.backend.release)  # Dynamo keeps the backend; the compiled code goes with us
        _allow_many_engines()
        self.compiled = torch.compile(self._model_forward, backend=self.backend, dynamic=False, fullgraph=True)
        self.startup_s = self.warm_up()

    def _model_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *side: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, OPAQUE, *side)  # [Tp, hidden]; what Dynamo traces

    def _side(self, n: int | None = None) -> tuple[torch.Tensor, ...]:
        """A model's per-token inputs besides tokens and positions (`model.step_inputs`: EAGLE's head, its
        features [T, H]), each [T, ...]; `n`: zeros of n rows, for the warm-up. Most models have none."""
        step_inputs = getattr(self.model, "step_inputs", None)
        return () if step_inputs is None else step_inputs(n)

    # keep_hidden / hidden: the eager runner's (model_runner.py), whichever way the step ran
    keep_hidden = property(lambda self: self.runner.keep_hidden,
                           lambda self, on: setattr(self.runner, "keep_hidden", on))  # fmt: skip
    hidden = property(lambda self: self.runner.hidden, lambda self, h: setattr(self.runner, "hidden", h))

    def padded(self, n: int) -> int:
        """The capture size a batch of n tokens runs at (n itself above the largest, or with none)."""
        i = bisect.bisect_left(self.capture_sizes, n)
        return self.capture_sizes[i] if i < len(self.capture_sizes) else n

    @torch.inference_mode()
    def forward(self, batch: FlatBatch, attn) -> torch.Tensor:
        """-> logits [len(batch.logits_indices), V], as `ModelRunner.forward`."""
        hidden = self.hidden_states(batch.input_ids, batch.positions, attn)  # [T, hidden]
        if self.runner.keep_hidden:  # (EAGLE's features: the real rows)
            self.runner.hidden = hidden
        return self.model.compute_logits(hidden[batch.logits_indices])  # [S, V]

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """The model's output [T, hidden] for the step's real rows, through the graph. (Level 5's ranks call
        this: a pipeline stage hands on its hidden states, not logits.)"""
        side = self._side()
        if self.eager_reason is not None or _get_current_dispatch_mode() is not None:
            # (a TorchDispatchMode watching every op, a profiler's count or a test's: compiled code cannot
            # run under one, so this one step runs eager, and the next compiled again)
            return self.model(input_ids, positions, attn, *side)
        try:
            hidden = self._run(input_ids, positions, attn, side)  # [Tp, hidden]
        except COMPILE_ERRORS as e:  # a recompile that failed mid-run: eager from now on (the same writes again)
            self._fall_back(e)
            return self.model(input_ids, positions, attn, *side)
        self.compiled_steps += 1
        return hidden[: input_ids.shape[0]]  # real rows only (a view: read before the next step runs)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn, side: tuple = ()) -> torch.Tensor:
        n = input_ids.shape[0]
        if any(t.shape[0] != n for t in side):  # (marked dynamic with the tokens below: a row per token)
            shapes = [tuple(t.shape) for t in side]
            raise ValueError(f"a model's step inputs have a row per token: {shapes} for {n} tokens")
        inputs = [input_ids, positions, *side]  # each [T, ...]
        # one made outside inference mode (a CPU batch as the engine built it) is cloned into an inference
        # tensor: Dynamo guards on the kind, so one kind
        inputs = [t if t.is_inference() else t.clone() for t in inputs]
        tp = self.padded(n)
        if tp != n:  # padding rows: token 0 at position 0 (and zero side inputs), their attention writes nowhere
            inputs = [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, tp - n)) for t in inputs]
        if tp >= 2:  # one graph for every T >= 2 (T = 1 is always specialised)
            for t in inputs:
                torch._dynamo.mark_dynamic(t, 0)
        with set_forward_context(attn, n, tp), _freezing(self.freezing):
            return self.compiled(*inputs)

    def _fall_back(self, error: Exception) -> None:
        root = error
        while (root.__cause__ or root.__context__) not in (None, root):  # what Dynamo's message wraps
            root = root.__cause__ or root.__context__
        # the cause first (say, the fake implementation's own error), then what Dynamo made of it
        self.eager_reason = first_line(error) if root is error else f"{first_line(root)} (then {first_line(error)})"
        self.model.set_ops(self.eager_ops)
        log.warning("torch.compile failed, running the model eager (as enforce_eager=True): %s", self.eager_reason)

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Compile (or load from Inductor's cache) the graphs a run needs before the first request,
        then capture each size where graphs are captured; returns the seconds it took."""
        from ladder.progress import StatusBar

        start = time.perf_counter()
        # the graph for every T >= 2 is traced at the largest of these (`hint` rows unless a capture size is
        # larger): with FROZEN_GEMM Inductor sizes its GEMMs' blocking for the trace's T (benchmarks.profile, the
        # built-in model, one run each: traced at 2 rows a batch-64 step took 16.0 ms against 14.0 for the
        # default's ATen matmuls; traced at 16, 8.9 ms, and batch 1 1.1 ms against 2.0)
        hint = 16 if self.freezing else 2
        sizes = sorted({1, hint, *self.capture_sizes}, reverse=True)  # largest first, as vLLM captures
        bar = StatusBar("compiling the model (torch.compile)", total=len(sizes))
        with bar:
            for tp in sizes:
                ids = torch.zeros(tp, dtype=torch.long, device=self.device)
                pos = torch.arange(tp, dtype=torch.long, device=self.device)
                runs = 2 if self.backend.wrap_piece is not None else 1  # a captured size: run, then capture
                for _ in range(runs):
                    if self.eager_reason is None:
                        try:
                            self._run(ids, pos, _WriteNowhere(), self._side(tp))
                            continue
                        except torch.distributed.DistError:  # a message failed (a peer gone, or a timeout): the
                            raise  # graph ran, and rerunning it eager would send messages no peer answers
                        except Exception as e:  # tracing or compiling failed, before the graph ran
                            self._fall_back(e)
                    if getattr(self.model, "forward_sends_messages", False):
                        # eager, the same forwards: a rank of level 5 makes the all-reduces its stage's others make
                        self.model(ids, pos, _WriteNowhere(), *self._side(tp))
                bar.advance()
        elapsed = time.perf_counter() - start
        if self.eager_reason is not None:
            return elapsed
        c = self.backend.counters
        root, size = inductor_cache() if self.config.backend == "inductor" else (Path("-"), 0)
        line = (f"compiled the model ({self.config.backend}, "
                f"{f'split at {c.splits} attention calls' if c.splits else 'one piece'}): {c.graphs} graph(s), "
                f"{c.pieces} piece(s), {elapsed:.1f} s; Inductor's cache {root} holds {size / 1e6:.1f} MB "
                "(enforce_eager=True or --enforce-eager: eager)")  # fmt: skip
        log.info(line)
        bar.report(line)
        return elapsed


__all__ = ["CompiledRunner", "inductor_cache"]
