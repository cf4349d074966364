"""`python -m ladder trace --level N [--spec] [--tp 2]`: one decode step, and whose code it runs, frame by frame.

What it is: a map of the layering, read off a running engine. It builds level N's engine on
the built-in model, runs a prompt's prefill, then traces the next step (a decode: one token
per request, or with `--spec` a verification of the draft's guesses) and prints its call
paths, each frame with the level (or room) that owns its file, in the step's order:

    to the KV manager's      from the engine's step down to the KV manager's `allocate_slots`
      allocation             (levels 2-5: the scheduler's decision)
    to the attention call    down to the function that attends over the KV cache (the first
                             of the step's layers)
    to the tokens            down to where the step's tokens are chosen (the sampler, or level
                             4's rejection sampler)

    level 2    level2_continuous/engine.py   ContinuousEngine._step     a level-3 engine's step is level 2's
    level 1    level1_paged/worker.py        Worker.execute             ... its worker level 1's ...
    room cpu_kernels  features/cpu_kernels/attention.py  paged_attention_cpu   ... its CPU kernel a room's

A frame's function is named by its *defining* class (`ContinuousEngine._step`, not the
subclass that inherited it), so an unchanged stage shows the level that wrote it. Levels 0
and 1 have no `step()` (static batching): their path starts at the batch loop
(`NaiveEngine._run_batch`), the decode being its second pass. Each level's chapter shows its
paths (tests/test_trace.py keeps the two in agreement).

What it is not: a profiler (`python -m benchmarks.profile` times a step), or a trace of every
call: only the frames of this repository on the two paths (torch's own frames are left out).
`--tp 2` starts a rank process; the path shown is the driver's, which is also rank 0.

Reference: Python's `sys.setprofile`; `py-spy dump`, which prints a running program's stacks.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from pathlib import Path

from ladder.cli import LadderParser, positive_int, torch_threads
from ladder.models import BUILTIN, BUILTIN_DRAFT

REPO = Path(__file__).resolve().parents[1]
LEVELS = ["level0_naive", "level1_paged", "level2_continuous", "level3_prefix", "level4_speculative",
          "level5_multigpu"]  # fmt: skip
PROMPT = "ROMEO:\nBut soft, what light"


def owner(path: Path) -> str:
    """Who a file belongs to: `level N`, `room <name>` (features/), or its top folder (ladder, benchmarks)."""
    parts = path.relative_to(REPO).parts
    if parts[0].startswith("level"):
        return f"level {parts[0][5]}"
    if parts[0] == "features":
        return f"room {parts[1]}"
    return parts[0]


def qualname(frame) -> str:
    """The running function's name with its *defining* class (`ContinuousEngine._step` in a level-3 engine)."""
    return getattr(frame.f_code, "co_qualname", None) or defining_name(frame)  # co_qualname: Python 3.11 on


def defining_name(frame) -> str:
    """What co_qualname says, found without it (Python 3.10): the class in self's MRO whose function runs this code."""
    code, self = frame.f_code, frame.f_locals.get("self")
    for cls in type(self).__mro__ if self is not None else ():
        fn = cls.__dict__.get(code.co_name)
        fn = fn.fget if isinstance(fn, property) else getattr(fn, "__func__", fn)
        if fn is not None and getattr(inspect.unwrap(fn), "__code__", None) is code:
            return f"{cls.__qualname__}.{code.co_name}"
    return code.co_name


def frames_to(frame, root) -> list[tuple[str, str, str]]:
    """(owner, file, function) of every repository frame from `root`'s frame down to `frame`, outermost first."""
    out = []
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        if path.is_relative_to(REPO):
            out.append((owner(path), str(path.relative_to(REPO)), qualname(frame)))
        if frame.f_code is root:
            return out[::-1]
        frame = frame.f_back
    raise RuntimeError("the traced call did not run inside the step")


class Tracer:
    """`sys.setprofile` for one call of `run`: the stack at the `skip[name]`-th call of each target (0: the first)."""

    def __init__(self, root, targets: dict[str, set], skip: dict[str, int] | None = None):
        self.root, self.targets, self.skip = root, targets, dict(skip or {})
        self.paths: dict[str, list] = {}

    def _profile(self, frame, event, arg):
        if event != "call":
            return
        for name, codes in self.targets.items():
            if name not in self.paths and frame.f_code in codes:
                if self.skip.get(name, 0):
                    self.skip[name] -= 1
                else:
                    self.paths[name] = frames_to(frame, self.root)

    def run(self, fn) -> dict[str, list]:
        sys.setprofile(self._profile)
        try:
            fn()
        finally:
            sys.setprofile(None)
        missing = set(self.targets) - set(self.paths)
        if missing:
            raise RuntimeError(f"the step never reached: {', '.join(sorted(missing))}")
        return self.paths


def code(fn) -> object:
    """A function's code object, through decorators (torch.inference_mode wraps with functools.wraps)."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return getattr(fn, "__func__", fn).__code__


def engine_kwargs(args) -> dict:
    kw = dict(dtype="float32", seed=0, max_model_len=128)
    if args.spec:
        kw["speculative_config"] = {"model": str(BUILTIN_DRAFT), "num_speculative_tokens": 3}
    if args.tp > 1:
        kw["tensor_parallel_size"] = args.tp
    return kw


def attention_codes(impl) -> set:
    """Where a step's layer attends: the backend's attention function, or its plan's call (a step the plan covers)."""
    return {code(impl.attend)} | ({code(impl.plan.__call__)} if isinstance(impl.plan, type) else set())


def trace_static(module, args) -> tuple[dict, str]:
    """Levels 0 and 1: the batch loop's second pass (the decode after the prefill)."""
    from ladder.progress import GenerateProgress
    from level0_naive.kv_cache import causal_attention
    from level0_naive.sampler import Sampler

    engine = module.LLM(str(BUILTIN), **engine_kwargs(args)).llm_engine
    attention = {code(causal_attention)} if not hasattr(engine, "worker") else attention_codes(engine.worker.impl)
    layers = engine.model_config.num_layers
    seqs = engine.inputs.make_requests([PROMPT], module.SamplingParams(max_tokens=3, temperature=0))[0]
    tracer = Tracer(code(type(engine)._run_batch), {"attention": attention, "tokens": {code(Sampler.sample)}},
                    skip={"attention": layers, "tokens": 1})  # fmt: skip
    with GenerateProgress(len(seqs), enabled=False) as bar:
        paths = tracer.run(lambda: engine.run(seqs, bar))
    return paths, "the batch loop's decode pass (after the prompt's prefill), 1 request"


def trace_step(module, args) -> tuple[dict, str]:
    """Levels 2-5: `LLMEngine.step` once the prompt is in the cache (and, with --spec, the guesses drafted)."""
    from level0_naive.sampler import Sampler

    engine = module.LLMEngine(str(BUILTIN), **engine_kwargs(args))
    try:
        engine.add_request("r", PROMPT, module.SamplingParams(max_tokens=8, temperature=0))
        engine.step()  # the prefill (and, with a draft model, the first guesses)
        (req,) = engine.scheduler.running
        worker = getattr(engine, "executor", None)
        attention = attention_codes((worker.worker if worker is not None else engine.worker).impl)  # level 5: rank 0's
        tokens = {code(Sampler.sample)}
        if args.spec:
            from level4_speculative.rejection_sampler import verify

            tokens.add(code(verify))
        targets = {"blocks": {code(type(engine.kv).allocate_slots)}, "attention": attention, "tokens": tokens}
        tracer = Tracer(code(type(engine).step), targets)
        guesses = len(getattr(req, "spec_token_ids", []))
        paths = tracer.run(engine.step)
        what = f"verifying {guesses} guesses" if guesses else "a decode"
        return paths, f"LLMEngine.step after the prompt's prefill: 1 request, {what}"
    finally:
        if hasattr(engine, "shutdown"):
            engine.shutdown()


def render(level: int, args, paths: dict, what: str) -> str:
    flags = "".join([" --spec" * args.spec, f" --tp {args.tp}" * (args.tp > 1)])
    lines = [f"$ python -m ladder trace --level {level}{flags}",
             f"level {level} ({LEVELS[level]}), the built-in model: {what}"]  # fmt: skip
    width = max(len(f) for path in paths.values() for _, f, _ in path)
    for name, title in (("blocks", "to the KV manager's allocation"), ("attention", "to the attention call"),
                        ("tokens", "to the tokens it chooses")):
        if name not in paths:
            continue
        lines += ["", title]
        lines += [f"  {who:<18} {f:<{width}}  {fn}" for who, f, fn in paths[name]]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = LadderParser(prog="python -m benchmarks.trace", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--level", type=int, choices=range(len(LEVELS)), required=True, help="the level to trace (0-5)")
    p.add_argument("--spec", action="store_true", help="level 4 and up: speculate with the built-in draft model (k = 3)")
    p.add_argument("--tp", type=positive_int, default=1, help="level 5: tensor-parallel ranks (starts tp - 1 processes)")
    return p


def trace(argv=None) -> str:
    """The rendered trace (what `main` prints)."""
    args = parser().parse_args(argv)
    if args.spec and args.level < 4:
        parser().error(f"--spec needs level 4 or 5 (speculative decoding), not level {args.level}")
    if args.tp > 1 and args.level < 5:
        parser().error(f"--tp needs level 5 (tensor parallelism), not level {args.level}")
    module = importlib.import_module(LEVELS[args.level])
    with torch_threads(1):
        paths, what = (trace_static if args.level < 2 else trace_step)(module, args)
    return render(args.level, args, paths, what)


def main(argv=None) -> int:
    print(trace(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
