"""`python -m features.compilation.demo`: what Dynamo makes of the model, with and without the opaque op.

    python -m features.compilation.demo            # the graphs, then a decode step's time (a minute or two)
    python -m features.compilation.demo --no-time  # the graphs only (seconds)

What it is: the built-in model traced by Dynamo two ways, over the same steps (a 5-token prefill, a
decode at position 5, one at position 40, a 3-token chunk), counting with Dynamo's own counters
and the backend's (`backend="eager"`: Dynamo only, nothing compiled, so it takes seconds):

    attention traced        the level's attention backend object called in the model, as eager runs
                            it: Dynamo follows it into the metadata checks' `.item()`s, the C++
                            kernel's ctypes call and the cache write, and breaks the graph at each
                            (`torch._dynamo.explain`: every break with its reason and its line)
    attention as one op     `torch.ops.ladder.attention` (attention_op.py): the backend hidden
                            behind the op's fake implementation, one graph per token-count kind

then (without `--no-time`) a decode step eager against compiled at batch 1 and 16
(`benchmarks.compiled_step`'s rounds, fewer of them). The lab's experiment runs it (lab 1c). Both
ways use the torch formulas for RMSNorm and RoPE (the CPU room's compiled ones are ctypes calls,
more breaks that would hide attention's).

What it is not: the benchmark (benchmarks/compiled_step.py) or the test that nothing recompiles
(tests/test_compilation.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from level0_naive.model_runner import ModelRunner
from level0_naive.ops import DEFAULT_OPS
from level1_paged.model_input import ModelInput

from .config import CompilationConfig
from .runner import CompiledRunner

REPO = Path(__file__).resolve().parents[2]
STEPS = [([1, 2, 3, 4, 5], 0), ([6], 5), ([7], 40), ([8, 9, 10], 41)]  # (new tokens, first position): one sequence


def where(frame) -> str:
    """A break's place in this repository's code: path:line and the line itself."""
    if frame is None:
        return "?"
    path = frame.filename.split(f"{REPO}/")[-1] if frame.filename.startswith(str(REPO)) else Path(frame.filename).name
    return f"{path}:{frame.lineno}  {frame.line.strip()[:70] if frame.line else ''}"


def trace_counts(engine, opaque: bool) -> dict:
    """Run STEPS through the model under Dynamo (nothing compiled); what Dynamo made of it."""
    torch._dynamo.reset()
    counters.clear()
    worker = engine.worker
    model = worker.model
    model.set_ops(DEFAULT_OPS)  # the torch formulas for norms and RoPE both ways: the breaks below are attention's
    if opaque:  # the room's runner, as compilation_config={"backend": "eager"} builds it (its warm-up included)
        runner = CompiledRunner(ModelRunner(model), CompilationConfig(level=3, backend="eager"))
    bs, graphs, breaks, places = worker.block_size, 0, 0, {}
    for tokens, start in STEPS:
        mi = ModelInput.build([(tokens, start)], [[0, 1, 2, 3]], bs, [1])  # blocks 0-3: 64 positions at bs 16
        attn = mi.attention_backend(worker.cache, worker.impl, worker.scale)
        with torch.inference_mode():
            if opaque:
                runner.forward(mi, attn)
                continue
            # Dynamo's explain: the graphs and breaks of one call, each break with its reason and place
            ex = torch._dynamo.explain(lambda ids, pos, a: model(ids, pos, a))(mi.input_ids, mi.positions, attn)
        graphs, breaks = graphs + ex.graph_count, breaks + ex.graph_break_count
        for b in ex.break_reasons:
            places.setdefault(where(b.user_stack[-1] if b.user_stack else None), b.reason.split("\n")[0][:60])
    if opaque:
        graphs, breaks = runner.backend.counters.graphs, sum(counters["graph_break"].values())
    return {"graphs": graphs, "graph_breaks": breaks, "places": places}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m features.compilation.demo", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-shakespeare", help="checkpoint (default: the built-in tiny model)")
    p.add_argument("--no-time", action="store_true", help="the graph counts only, not the decode step's time")
    p.add_argument("--rounds", type=int, default=3, help="alternating timing rounds (default 3)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from level3_prefix import LLMEngine

    engine = LLMEngine(args.model, dtype="float32", max_model_len=256)
    layers = engine.loaded.model.config.num_layers
    out = {"layers": layers}
    print(
        f"{args.model}: {layers} layers; the same 4 steps (a 5-token prefill, two decodes, a 3-token chunk) traced two ways"
    )
    for name, opaque in (("attention traced", False), ("attention as one op", True)):
        out[name] = c = trace_counts(engine, opaque)
        print(f"  {name:20s} {c['graphs']:3d} graphs compiled, {c['graph_breaks']:3d} graph breaks")
        for place, reason in c["places"].items():
            print(f"  {'':20s} {reason}: {place}")
    if not args.no_time:
        from benchmarks.compiled_step import main as timing

        print("\na decode step, eager against compiled (benchmarks.compiled_step):")
        out["timing"] = timing(["--batches", "1,16", "--steps", "100", "--rounds", str(args.rounds)])
    return out


if __name__ == "__main__":
    main()
