"""`python -m benchmarks.thrash`: the thrash of a crowd admitted together, and admission headroom's cure, in one picture.

What it is: level 2 on the benchmark's `uniform` workload (every prompt 32 tokens, every
output 128, all arriving at once) under the benchmark's KV budget (16 worst-case requests),
once per `kv_admission_headroom` (default 0, 1, 2), drawn step by step from the engine's
own step log: how many requests run, and how many prompt tokens have been computed so far
(a preempted request computes its prompt and its output again). With headroom 0 (vLLM's
rule) step 0 admits a crowd, every member needs its next block at the same token, and the
engine preempts and recomputes in waves; with headroom h an admission must leave h free
blocks per running request, so fewer run at first and almost nobody is thrown out.

    python -m benchmarks.thrash                                        # the picture, outside the repository
    python -m benchmarks.thrash --plot docs/img/level2_thrash.png      # the committed one (ladder.figures)
    python -m benchmarks.thrash --measure uniform spread chat shared-prefix --repeats 2
                                # tokens/s per headroom on those workloads (what chose the default)

The figures it prints (steps, preemptions, prompt tokens computed) are the same on any
machine; the seconds are this machine's, and are printed, not drawn.

What it is not: the throughput benchmark (`benchmarks.throughput` measures tokens/s of
every level, with the default headroom).
"""

from __future__ import annotations

import time

import torch

from ladder.cli import LadderParser, nonneg_int, plot_path, positive_int

from .roofline import Dims
from .workloads import NAMES, make_workload


def run(model: str, headroom: int, num_requests: int) -> dict:
    """One level-2 run of `uniform` at this headroom: the per-step series and the totals."""
    import level2_continuous

    dims = Dims.from_checkpoint(model)
    wl = make_workload("uniform", num_requests, dims.vocab, seed=0)
    budget = 16 * wl.max_seq_len * dims.kv_bytes_per_token(4)  # the benchmark's budget, float32 KV
    llm = level2_continuous.LLM(model, dtype="float32", max_model_len=-1, kv_cache_memory=budget,
                                kv_admission_headroom=headroom, step_log_size=100_000)  # fmt: skip
    params = [level2_continuous.SamplingParams(max_tokens=r.max_tokens, min_tokens=r.max_tokens, ignore_eos=True,
                                               temperature=0) for r in wl.first]  # fmt: skip
    t0 = time.perf_counter()
    llm.generate([r.prompt for r in wl.first], params, progress=False)
    seconds = time.perf_counter() - t0
    log = list(llm.llm_engine.step_log)
    computed, total = [], 0
    for rec in log:
        total += rec.num_prefill_tokens
        computed.append(total)
    return {"headroom": headroom, "running": [r.running for r in log], "prefilled": computed,
            "preemptions": sum(r.preempted for r in log), "steps": len(log), "seconds": seconds,
            "prompt_tokens": sum(len(r.prompt) for r in wl.first)}  # fmt: skip


def measure(model: str, workloads: list[str], headrooms: list[int], repeats: int, num_requests: int = 128) -> dict:
    """Level 2's output tokens/s at each headroom on each workload (the benchmark's budget and
    requests), in alternating order across repeats, keeping the fastest run of each."""
    from .engines import LevelEngine

    dims = Dims.from_checkpoint(model)
    best: dict[tuple[str, int], float] = {}
    for name in workloads:
        wl = make_workload(name, num_requests, dims.vocab, seed=0)
        budget = 16 * wl.max_seq_len * dims.kv_bytes_per_token(4)  # the benchmark's budget, float32 KV
        for rep in range(repeats):
            for h in headrooms if rep % 2 == 0 else reversed(headrooms):
                engine = LevelEngine("level2_continuous", model, "float32", "cpu", budget, 256, 0, False)
                engine.kwargs["kv_admission_headroom"] = h
                if rep == 0 and h == headrooms[0]:
                    engine.warmup()
                res = engine.run(wl)
                tps = sum(r["output_len"] for r in res.records) / res.duration
                best[name, h] = max(best.get((name, h), 0.0), tps)
                print(f"{name}, headroom {h}: {tps:.0f} output tok/s, {res.stats['preemptions']} preemptions")
    return best


def plot(runs: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for r in runs:
        name = f"headroom {r['headroom']}" + (" (vLLM's rule)" if r["headroom"] == 0 else "")
        a.plot(r["running"], lw=1, label=f"{name}: {r['steps']} steps, {r['preemptions']} preemptions")
        b.plot(r["prefilled"], lw=1.2, label=f"{name}: {r['prefilled'][-1]} computed")
    b.axhline(
        runs[0]["prompt_tokens"], color="k", ls="--", lw=1, label=f"the prompts: {runs[0]['prompt_tokens']} tokens"
    )
    a.set_ylabel("requests running")
    a.set_ylim(bottom=0)
    a.legend(fontsize=7)
    b.set_ylabel("prompt tokens computed\n(recomputation included)")
    b.set_xlabel("engine step")
    b.set_ylim(bottom=0)
    b.legend(fontsize=7)
    fig.suptitle("Level 2 on `uniform` (128 requests, one shape, all at once) under 16 worst-case requests' KV:\n"
                 "admitted in a crowd they grow in step and preempt each other; headroom admits fewer, and keeps them",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    p = LadderParser(prog="python -m benchmarks.thrash", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory or built-in name (default: the built-in model)")
    p.add_argument("--headroom", type=nonneg_int, nargs="+", default=[0, 1, 2], help="headrooms to run (default 0 1 2)")
    p.add_argument("--num-requests", type=positive_int, default=128, help="requests per workload (default 128)")
    p.add_argument(
        "--plot", default=None, help="where to save the picture (default: level2_thrash.png outside the repository)"
    )
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--measure", nargs="+", choices=[n for n in NAMES if n != "poisson"], default=None,
                   help="instead of the picture: level 2's tokens/s per headroom on these workloads")  # fmt: skip
    p.add_argument("--repeats", type=positive_int, default=2, help="with --measure: runs per setting (default 2)")
    args = p.parse_args(argv)
    from ladder.models import default_model, resolve_path

    torch.set_num_threads(args.threads)
    model = str(resolve_path(args.model) if args.model else default_model())
    if args.measure:
        best = measure(model, args.measure, args.headroom, args.repeats, args.num_requests)
        for name in args.measure:
            print(f"{name}: " + ", ".join(f"headroom {h} {best[name, h]:.0f}" for h in args.headroom) + " tok/s (best)")
        return [{"workload": w, "headroom": h, "output_tokens_per_s": v} for (w, h), v in best.items()]
    runs = []
    for h in args.headroom:
        runs.append(run(model, h, args.num_requests))
        r = runs[-1]
        print(f"headroom {h}: {r['steps']} steps, {r['preemptions']} preemptions, {r['prefilled'][-1]} prompt tokens "
              f"computed for {r['prompt_tokens']}, {r['seconds']:.1f} s here")  # fmt: skip
    path = plot_path(args.plot, "level2_thrash.png")
    plot(runs, path)
    print(f"plot: {path}")
    return runs


if __name__ == "__main__":
    main()
