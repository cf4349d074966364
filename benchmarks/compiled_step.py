"""`python -m benchmarks.compiled_step`: a decode step eager against compiled, side by side.

    python -m benchmarks.compiled_step                       # batches 1, 16, 64; the built-in model, float32
    python -m benchmarks.compiled_step --batches 1 --rounds 6

What it is: one level-3 engine per mode in this one process, each running `--steps` decode steps
at each batch size, in alternating rounds (a shared machine drifts: ratios from one process drift
much less than absolutes), keeping each mode's best round and its median. The modes:

    eager          compilation_config=0 (the C++ CPU kernels for norms, RoPE, attention; the default on a GPU)
    compiled       compilation_config={"inductor_compile_config": {"cpp_wrapper": False}}:
                   Inductor's kernels called from Python
    compiled-cpp   compilation_config=3, the default on a CPU: the calls in C++ too (cpp_wrapper)
    frozen         compilation_config={"inductor_compile_config": FROZEN_GEMM}: the weights frozen into the
                   graph and Inductor's own GEMMs tried beside ATen's (features/compilation/config.py)

It prints ms per step, tokens/s, each mode's ratio to eager and its start-up (compile) seconds
(Inductor's cache makes a second run's start much shorter than the first's, except `frozen`'s, which
compiles at every start: about 30 s).

    python -m benchmarks.compiled_step --eagle               # EAGLE's head: eager against compiled

times instead the passes of level 4's EAGLE head (one layer) at batch 1 on the built-in pair, over
natural text, on the CPU, with the target compiled in both: the head as the default leaves it (eager)
against the head compiled (compilation_config=3), in alternating rounds (`--rounds`; `--model`,
`--dtype`, `--batches` and `--steps` do not apply): microseconds a head forward, the number that
decides the default (features/compilation/__init__.py).

What it is not: the whole-engine benchmark (`benchmarks.throughput --engines
level3_prefix,level3_prefix:compiled` runs the workloads), or a GPU measurement (CUDA graphs:
`benchmarks/sim/gpu_check.sh`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from features.compilation.config import FROZEN_GEMM
from ladder.models import default_model

MODES = {
    "eager": 0,
    "compiled": {"level": 3, "inductor_compile_config": {"cpp_wrapper": False}},
    "compiled-cpp": 3,
    "frozen": {"level": 3, "inductor_compile_config": FROZEN_GEMM},
}


def decode_round(engine, batch: int, steps: int, params) -> float:
    """ms per decode step over `steps` steps of `batch` requests (prefill and the first step untimed)."""
    for i in range(batch):
        engine.add_request(f"r{time.perf_counter_ns()}-{i}", [5 + i % 50, 6, 7, 8], params)
    engine.step()  # the prefill
    engine.step()  # the first decode
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    ms = 1e3 * (time.perf_counter() - t0) / steps
    while engine.has_unfinished_requests():
        engine.step()
    return ms


def eagle_passes(rounds: int, tokens: int = 200) -> dict:
    """-> {mode: {"best_us", "median_us", "passes"}}: the EAGLE head's forward, eager and compiled (module docstring)."""
    import os

    import level4_speculative
    from benchmarks.workloads import TEXTS

    text = TEXTS.read_text()
    prompts = [list(text[i * 90 : (i + 1) * 90].encode()) for i in range(4)]  # the built-in model reads bytes
    params = level4_speculative.SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=0)
    spec = {"method": "eagle", "model": "tiny-shakespeare-eagle", "num_speculative_tokens": 2}
    saved = os.environ.pop("LADDER_COMPILE_LEVEL", None)  # the default: the target compiled on a CPU, the head eager
    try:
        kw = dict(seed=0, speculative_config=spec, device="cpu")  # (a CPU's default compiles; a wall clock times it)
        llms = {
            "eager head": level4_speculative.LLM("tiny-shakespeare", **kw),
            "compiled head": level4_speculative.LLM("tiny-shakespeare", compilation_config=3, **kw),
        }
    finally:
        if saved is not None:
            os.environ["LADDER_COMPILE_LEVEL"] = saved
    times = {mode: [] for mode in llms}
    for _ in range(rounds):
        for mode, llm in llms.items():
            worker, spent = llm.llm_engine.proposer.worker, [0.0, 0]
            forward = worker.runner.forward

            def timed(batch, attn, _forward=forward, _spent=spent):
                t0 = time.perf_counter()
                out = _forward(batch, attn)
                _spent[0] += time.perf_counter() - t0
                _spent[1] += 1
                return out

            worker.runner.forward = timed  # (an instance attribute: the runner's own method is untouched)
            for prompt in prompts:
                llm.generate([prompt], [params], progress=False)
            del worker.runner.forward
            times[mode].append((1e6 * spent[0] / spent[1], spent[1]))
    return {mode: {"best_us": min(t for t, _ in r), "median_us": statistics.median(t for t, _ in r), "passes": r[0][1]}
            for mode, r in times.items()}  # fmt: skip


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compiled_step", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the built-in tiny Shakespeare model)")
    p.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 16, 64],
                   help="batch sizes, comma-separated (default 1,16,64)")  # fmt: skip
    p.add_argument("--steps", type=int, default=200, help="decode steps timed per round (default 200)")
    p.add_argument("--rounds", type=int, default=4, help="alternating rounds per batch (default 4)")
    p.add_argument("--dtype", default="float32", help="default float32")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--eagle", action="store_true", help="time EAGLE's head passes instead, eager against compiled")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.eagle:
        heads = eagle_passes(args.rounds)
        print(f"EAGLE's head at batch 1 (the built-in pair, the target compiled), us a forward; best of {args.rounds} "
              "alternating rounds (median in brackets):")  # fmt: skip
        for mode, r in heads.items():
            print(f"  {mode:>13}  {r['best_us']:6.0f} us ({r['median_us']:.0f}) over {r['passes']} passes")
        return {"eagle_head": heads}
    from level3_prefix import LLMEngine, SamplingParams

    model = args.model or str(default_model())
    engines, startup = {}, {}
    for mode, config in MODES.items():
        t0 = time.perf_counter()
        engines[mode] = LLMEngine(model, dtype=args.dtype, max_num_seqs=max(args.batches), seed=0,
                                  compilation_config=config)  # fmt: skip
        startup[mode] = time.perf_counter() - t0
    params = SamplingParams(max_tokens=args.steps + 2, ignore_eos=True, temperature=0)
    results = {}
    for batch in args.batches:
        runs = {mode: [] for mode in MODES}
        for _ in range(args.rounds):
            for mode, engine in engines.items():
                runs[mode].append(decode_round(engine, batch, args.steps, params))
        results[batch] = {
            mode: {"best_ms": min(r), "median_ms": statistics.median(r), "runs_ms": r} for mode, r in runs.items()
        }
    print(f"decode steps, {model}, {args.dtype}, {args.threads} thread(s); best of {args.rounds} alternating rounds "
          f"of {args.steps} steps (median in brackets)")  # fmt: skip
    print(f"{'batch':>5}  " + "  ".join(f"{m:>24}" for m in MODES) + "   x eager (best)")
    for batch, r in results.items():
        cells = "  ".join(f"{r[m]['best_ms']:8.3f} ms ({r[m]['median_ms']:7.3f})" for m in MODES)
        ratios = " ".join(f"{r['eager']['best_ms'] / r[m]['best_ms']:.2f}x" for m in MODES if m != "eager")
        print(f"{batch:>5}  {cells}   {ratios}")
    print("start-up: " + ", ".join(f"{m} {s:.1f} s" for m, s in startup.items()) + " (a compile, or Inductor's cache)")
    return {"results": results, "startup_s": startup}


GPU_SIZES = [1, 2, 4, 8, 16]  # the check's capture sizes: a handful, so capturing stays within its seconds


def gpu_part(figures: dict, device: str, prompts: int = 4, tokens: int = 32, steps: int = 100) -> str:
    """benchmarks/sim/gpu_check.py's `compiled_step` part: on CUDA, the built-in model in float32 eager
    against compiled with CUDA graphs (capture sizes GPU_SIZES): the greedy tokens of both (counted, not
    asserted: Inductor's fused kernels may round differently), and ms per decode step at batch 1 and 16."""
    from benchmarks.sim.fail_soft import Skip

    if device != "cuda":
        raise Skip("CUDA graphs need a GPU (the compiled step's CPU path is tests/test_compilation.py's)")
    from level3_prefix import LLM, SamplingParams

    model, t0 = str(default_model()), time.perf_counter()
    eager = LLM(model, dtype="float32", device="cuda", max_num_seqs=16, seed=0)
    figures["eager_startup_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = LLM(model, dtype="float32", device="cuda", max_num_seqs=16, seed=0,
                   compilation_config={"cudagraph_capture_sizes": GPU_SIZES})  # fmt: skip
    runner = compiled.llm_engine.worker.runner
    figures.update(compiled_startup_s=time.perf_counter() - t0, eager_reason=runner.eager_reason,
                   pieces=runner.backend.counters.pieces)  # fmt: skip
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    texts = [[5 + i, 6, 7, 8 + i] for i in range(prompts)]
    outs = [[o.outputs[0].token_ids for o in llm.generate(texts, params, progress=False)] for llm in (eager, compiled)]
    figures["same_tokens"] = sum(a == b for a, b in zip(*outs))
    decode = SamplingParams(max_tokens=steps + 2, ignore_eos=True, temperature=0)
    for batch in (1, 16):
        runs = {"eager": [], "compiled": []}
        for _ in range(3):
            for name, llm in (("eager", eager), ("compiled", compiled)):
                torch.cuda.synchronize()
                runs[name].append(decode_round(llm.llm_engine, batch, steps, decode))
        figures[f"batch{batch}_ms"] = {name: min(r) for name, r in runs.items()}
    figures["captured"] = sum(len(p.graphs) for p in runner.backend.wrapped)
    return (f"same greedy tokens {figures['same_tokens']}/{prompts}; start-up eager {figures['eager_startup_s']:.1f} s, "
            f"compiled {figures['compiled_startup_s']:.1f} s ({figures['pieces']} pieces, {figures['captured']} graphs); "
            + "; ".join(f"batch {b}: eager {figures[f'batch{b}_ms']['eager']:.2f} ms, compiled "
                        f"{figures[f'batch{b}_ms']['compiled']:.2f} ms a step" for b in (1, 16))
            + ("" if runner.eager_reason is None else f"; FELL BACK TO EAGER: {runner.eager_reason}"))  # fmt: skip


if __name__ == "__main__":
    main()
