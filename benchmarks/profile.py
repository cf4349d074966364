"""`python -m benchmarks.profile`: where one decode step's time goes, at the batch the engine runs.

What it is: the steady-state decode step of a level-2+ engine, taken apart. For each batch
size of a sweep (1, 16, 64, 128 by default) it fills an engine with that many requests of the
workload's prompt length, lets every prompt finish its prefill, and then times `--steps`
decode steps, each split into

    schedule     Scheduler.schedule() and the engine's bookkeeping around it
    input        prepare_input: token ids, positions, slots, block tables -> ModelInput
    linears      every Ops.linear call (q, k, v, o, gate, up, down, the LM head)
    attention    the backend's KV write and paged attention, all layers
    glue         the rest of the forward: embeddings, norms, RoPE, SiLU, residual adds
    sampling     the engine's sampler over the logits
    outputs      update_from_output, post_step, and the RequestOutputs of step()
    between      the step's wall time not in any of the above (Python between the parts)

by wrapping those methods on the one engine object (an instance attribute each; the engine's
code is untouched, and `torch` on a CPU is synchronous, so a wall clock around a call is its
cost). One more, untimed, step counts the aten ops called (`torch.profiler`'s aten events that
no other aten op called: what Python, or compiled code, asked the dispatcher for).

    python -m benchmarks.profile --compiled      # the engine's default on a CPU: the model compiled
    python -m benchmarks.profile --frozen        # compiled with FROZEN_GEMM (opt-in: the weights frozen,
                                                 # Inductor's own GEMMs; the ceiling's matmuls compiled so too)

profiles the compiled step instead (compilation_config=3; without the flag the engine runs with
enforce_eager=True): the compiled forward is one call, so `linears`, `attention` and `glue` are
one part there, `model` (a stopwatch inside it would break the graph).

Beside each batch it prints the honest ceiling at that batch: the time the model's matmuls
take at that batch size on this machine (`roofline.matmul_flops_per_s`, weights hot in cache;
ATen's matmuls, and with `--frozen` the same chain compiled with FROZEN_GEMM too, the faster kept:
Inductor's own GEMMs could beat ATen's) plus the step's KV-cache bytes read at the
machine's measured read bandwidth. The engine's
tokens/s over that ceiling's tokens/s is "how far from the limit", measured at the batch the
engine actually runs, not at the best batch the machine could run.

    python -m benchmarks.profile                                 # level 3, uniform, 1/16/64/128
    python -m benchmarks.profile --level level2_continuous --batches 16,64 --attention-backend torch
    python -m benchmarks.profile --plot docs/img/profile_level3_prefix.png   # the committed picture
                                                                 # (python -m ladder.figures --only profile)

What it is not: a trace (use `torch.profiler` for one op at a time) or a speed test: it reports
and never fails on a number. Prefill is not profiled (a decode step is what a long generation
is made of). Levels 0 and 1 have no scheduler step to take apart.

Reference: vLLM's `benchmarks/benchmark_latency.py` and its `--profile` option; Williams et
al., "Roofline" (CACM 2009).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from features.compilation.config import FROZEN_GEMM
from level0_naive.ops import Ops

from .roofline import Dims, kv_read_bandwidth, matmul_flops_per_s, step_floor
from .workloads import NAMES, make_workload

PARTS = ("schedule", "input", "linears", "attention", "glue", "model", "sampling", "outputs", "between")


class TimedOps(Ops):
    """The model's ops with a stopwatch on the linears; every other op is the inner one's, in "glue"."""

    def __init__(self, inner: Ops, clock: Counter):
        self.inner, self.clock = inner, clock

    def linear(self, x, weight, bias=None):
        t0 = time.perf_counter()
        try:
            return self.inner.linear(x, weight, bias)
        finally:
            self.clock["linears"] += time.perf_counter() - t0

    def rms_norm(self, x, weight, eps):
        return self.inner.rms_norm(x, weight, eps)  # part of "glue"

    def rope(self, q, k, cos, sin):
        return self.inner.rope(q, k, cos, sin)

    def silu_mul(self, gate, up):
        return self.inner.silu_mul(gate, up)


def _timed(fn, clock: Counter, part: str):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock[part] += time.perf_counter() - t0

    return wrapper


class CountOps(TorchDispatchMode):
    """Counts every aten op dispatched while it is active (a compiled model's step runs eager under
    one: features/compilation/runner.py, so `aten_ops` below counts with the profiler instead)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def aten_ops(step) -> int:
    """The aten ops one call of `step` asks for: the profiler's aten events not inside another."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    aten = [e for e in prof.events() if e.name.startswith("aten::")]
    return sum(1 for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))


def instrument(engine, clock: Counter, inside: bool = True) -> None:
    """Wrap the engine's parts so that each adds its seconds to `clock` (see the module docstring);
    `inside=False` leaves the forward pass whole (a compiled one)."""
    engine.schedule = _timed(engine.schedule, clock, "schedule")
    engine.prepare_input = _timed(engine.prepare_input, clock, "input")
    engine.sample = _timed(engine.sample, clock, "sampling")
    engine.scheduler.update_from_output = _timed(engine.scheduler.update_from_output, clock, "outputs")
    engine.post_step = _timed(engine.post_step, clock, "outputs")
    engine.outputs.make = _timed(engine.outputs.make, clock, "outputs")
    worker = engine.worker
    worker.execute = _timed(worker.execute, clock, "forward")
    if not inside:
        return
    impl = worker.impl
    worker.impl = type(impl)(_timed(impl.write_kv, clock, "attention"), _timed(impl.attend, clock, "attention"))
    model = worker.model
    model.set_ops(TimedOps(model.ops, clock))


def profile_batch(args, module, batch: int) -> dict:
    """One engine at one batch size: per-part milliseconds per decode step, and the ops count."""
    max_tokens = args.steps + 8
    kw = dict(dtype=args.dtype, max_num_seqs=batch, max_model_len=-1, seed=0)
    if args.frozen:  # compiled with the weights frozen and Inductor's own GEMMs (features/compilation/config.py)
        kw["compilation_config"] = {"inductor_compile_config": FROZEN_GEMM}
    elif args.compiled:
        kw["compilation_config"] = 3
    else:
        kw["enforce_eager"] = True  # the parts timed one by one need the model's ops called from Python
    if args.attention_backend:
        kw["attention_backend"] = args.attention_backend
    if args.batch_invariant:
        kw["batch_invariant"] = True
    if args.level.startswith("level4"):
        kw["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        }
    llm = module.LLM(args.model, **kw)
    engine = llm.llm_engine
    params = module.SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, temperature=0)
    vocab = engine.model_config.vocab_size
    prompts = [r.prompt for r in make_workload(args.workload, batch, vocab, seed=0).first]  # the workload's prompts
    prompts = [prompts[i % len(prompts)] for i in range(batch)]  # (latency has 16: reused)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for g in engine.requests.values() for r in g):
        engine.step()  # every prompt prefilled: from here on, every step is a decode step
    engine.step()  # and one more, so first-call costs are behind us
    ops = aten_ops(engine.step)
    clock: Counter = Counter()
    instrument(engine, clock, inside=not args.compiled)
    contexts = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        contexts.append(statistics.mean(r.num_tokens for g in engine.requests.values() for r in g))
        engine.step()
    wall = time.perf_counter() - t0
    ms = {
        part: 1e3 * clock[part] / args.steps
        for part in ("schedule", "input", "linears", "attention", "sampling", "outputs")
    }
    forward = 1e3 * (clock["forward"] - clock["linears"] - clock["attention"]) / args.steps
    ms["model"], ms["glue"] = (forward, 0.0) if args.compiled else (0.0, forward)
    ms["between"] = 1e3 * wall / args.steps - sum(ms.values())
    step_ms = 1e3 * wall / args.steps
    return {"batch": batch, "step_ms": step_ms, "tok_per_s": batch / (step_ms / 1e3), "ms": ms,
            "aten_ops_per_step": ops, "mean_context": statistics.mean(contexts),
            "bytes_per_token": engine.bytes_per_token}  # fmt: skip


def ceiling(dims: Dims, row: dict, dtype: torch.dtype, bandwidth: float, inductor: dict | None = None) -> dict:
    """The step's floor at this batch: matmuls at this batch + KV bytes at the read bandwidth. `inductor`:
    the matmuls also compiled with those settings (--frozen: the GEMMs that engine runs), the faster rate kept."""
    b = row["batch"]
    rate = matmul_flops_per_s(dims, b, dtype, torch.device("cpu"), window=0.1, repeats=3)  # at this very batch
    if inductor is not None:
        rate = max(rate, matmul_flops_per_s(dims, b, dtype, torch.device("cpu"), 0.1, 3, inductor=inductor))
    matmul_s, kv_s = step_floor(dims, rate, b, row["mean_context"], row["bytes_per_token"], bandwidth)
    floor = matmul_s + kv_s
    return {"matmul_ms": 1e3 * matmul_s, "kv_ms": 1e3 * kv_s, "ceiling_tok_per_s": b / floor,
            "of_ceiling": row["tok_per_s"] / (b / floor)}  # fmt: skip


def show(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("batch", "step ms", *PARTS, "aten ops", "tok/s", "ceiling tok/s", "of ceiling"):
        table.add_column(col, justify="right")
    for r in rows:
        parts = [f"{r['ms'].get(p, 0.0):.2f}" for p in PARTS]
        table.add_row(str(r["batch"]), f"{r['step_ms']:.2f}", *parts, str(r["aten_ops_per_step"]), f"{r['tok_per_s']:.0f}",
                      f"{r['ceiling_tok_per_s']:.0f}", f"{100 * r['of_ceiling']:.0f} %")  # fmt: skip
    console = Console(width=max(Console().width, 150))  # the table is wide; a pipe or CI log gets it whole
    console.print(table)
    console.print(
        "ms per decode step; ceiling = matmuls at that batch (weights hot) + KV bytes at the measured read bandwidth"
    )


def plot(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [str(r["batch"]) for r in rows]
    bottom = [0.0] * len(rows)
    for part in PARTS:
        per_token = [1e3 * r["ms"].get(part, 0.0) / r["batch"] for r in rows]  # µs per token (a JSON from before "model": none)
        ax.bar(labels, per_token, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, per_token)]
    floor = [1e3 * (r["matmul_ms"] + r["kv_ms"]) / r["batch"] for r in rows]
    ax.scatter(labels, floor, color="black", marker="_", s=900, zorder=3, label="ceiling (matmuls + KV reads)")
    ax.set_xlabel("batch (requests decoding)")
    ax.set_ylabel("µs per generated token")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    from ladder.models import default_model

    p = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument(
        "--level", default="level3_prefix", choices=["level2_continuous", "level3_prefix", "level4_speculative"]
    )
    p.add_argument("--workload", default="uniform", choices=NAMES, help="whose prompts the requests have")
    p.add_argument("--batches", default="1,16,64,128")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per batch")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--attention-backend", default=None, help="auto (default), cpu, torch, ref")
    p.add_argument("--batch-invariant", action="store_true", help="the engine with batch_invariant=True")
    p.add_argument("--compiled", action="store_true", help="the model compiled (compilation_config=3; default: eager)")
    p.add_argument("--frozen", action="store_true", help="compiled with FROZEN_GEMM (the weights frozen, Inductor's "
                   "GEMMs); the ceiling's matmuls compiled so too")  # fmt: skip
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--plot", nargs="?", const="", default=None, metavar="PATH",
                   help="draw the stacked bars (to PATH, default profile_LEVEL.png outside the repository)")  # fmt: skip
    p.add_argument("--out", default=None, help="write the JSON here")
    p.set_defaults(default_model=default_model)
    return p


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    from ladder.cli import output_dir

    args.model = args.model or str(args.default_model())
    args.compiled = args.compiled or args.frozen  # (frozen is a way of compiling: one forward call)
    torch.set_num_threads(args.threads)
    module = importlib.import_module(args.level)
    rows = [profile_batch(args, module, int(b)) for b in args.batches.split(",")]
    dims, bandwidth = Dims.from_checkpoint(args.model), kv_read_bandwidth()
    for r in rows:
        r.update(ceiling(dims, r, getattr(torch, args.dtype), bandwidth, FROZEN_GEMM if args.frozen else None))
    from features.cpu_kernels import attention as cpu_attention

    backend = args.attention_backend or ("cpu (auto)" if cpu_attention.available() else "torch (auto)")
    how = " compiled, frozen GEMMs" if args.frozen else " compiled" if args.compiled else ""
    title = (f"{args.level}{how}, {args.workload} prompts, {args.dtype}, attention {backend}, "
             f"{args.threads} thread(s); KV read bandwidth {bandwidth / 1e9:.1f} GB/s")  # fmt: skip
    show(rows, title)
    data = {"title": title, "level": args.level, "workload": args.workload, "bandwidth": bandwidth, "rows": rows}
    out = Path(args.out) if args.out else output_dir() / f"profile_{args.level}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    if args.plot is not None:
        path = Path(args.plot) if args.plot else output_dir() / f"profile_{args.level}.png"
        plot(rows, title, path)
        print(f"plot: {path}")
    print(f"json: {out}")
    return data


if __name__ == "__main__":
    main()
