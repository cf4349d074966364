"""Room: the compiled step. `torch.compile` as vLLM V1 uses it, plugged into level 1's worker.

What it is: what `compilation_config=` (and `enforce_eager=`) ask for, in small files:

    config.py        `CompilationConfig`: vLLM's names (level, backend, splitting_ops,
                     cudagraph_capture_sizes, use_cudagraph), checked
    attention_op.py  attention as one opaque custom op (`torch.ops.ladder.attention`) with a fake
                     implementation, reading the step's paged cache from a forward context
    piecewise.py     the backend: the traced graph split at attention, each piece compiled
    runner.py        `CompiledRunner`: the worker's model runner, compiled; padding, warm-up,
                     falling back to eager in one log line
    cuda_graphs.py   on a GPU: each piece captured as a CUDA graph per padded size, replayed
    demo.py          the model traced with attention followed into the backend and as the op

The worker (level1_paged/worker.py) asks `ladder/rooms.py` for a runner; a level never imports
this room. The lesson is docs/compiled_step.md.

On by default on a CPU, level 5's ranks included (each compiles its shard; its all-reduces are an
opaque op, level5_multigpu/parallel_state.py), level1_paged/engine.py's CompilationSettings says where
not, except for a
mixture-of-experts model: its routing sizes each expert's batch from the data, which Dynamo cannot
trace (vLLM makes the fused MoE a custom op, as attention here: not built), so by default it runs
eager without a word, and asked for, it tries and falls back in one log line. And except for a model
that declines (`compile_by_default = False`): EAGLE's head (level 4). Compiled, its features a graph
input (`step_inputs`), it was slower per pass than eager on this CPU at batch 1 (624-690 against
565-594 us a forward, `python -m benchmarks.compiled_step --eagle`: one layer saves fewer dispatches
than Dynamo's and the runner's per-call costs add), so by default it runs eager; asked for (on a GPU,
where its pieces are captured), it is compiled.

What it is not: a faster attention (the engine's own kernel is the op). Measured: docs/compiled_step.md.

Reference: vLLM `vllm/compilation/` and `vllm/config/compilation.py`.
"""

from .config import CompilationConfig, parse
from .runner import CompiledRunner


def compiled_runner(runner, config: CompilationConfig):
    """Level 0's `ModelRunner` and a config that compiles (ladder/rooms.py passes no other) -> the
    compiled runner the worker uses (level 0's runner itself for an MoE model or EAGLE's head by default: see
    above)."""
    if getattr(config, "by_default", False) and (
        not getattr(runner.model, "compile_by_default", True)  # (EAGLE's head says so)
        or any(hasattr(m, "experts") for m in runner.model.modules())  # (an MoE model)
    ):
        return runner
    wrap = None
    if config.graphs_captured(runner.device.type):
        from .cuda_graphs import capture_wrapper

        wrap = capture_wrapper(config.capture_sizes("cuda"), runner.model)
    return CompiledRunner(runner, config, wrap)


__all__ = ["CompilationConfig", "CompiledRunner", "compiled_runner", "parse"]
