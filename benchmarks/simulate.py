"""`python -m benchmarks.simulate`: the PagedAttention paper's serving figures, from the ladder's own engines.

What it is: the GPU what-if. Each system of the paper's section 6 is built from the ladder's
code on a modelled GPU clock (`benchmarks/sim/`): vLLM (level 2's scheduler and block manager;
`vllm-prefix`: level 3's), Orca with contiguous reservations (Max, Pow2, Oracle: level 2's
iteration scheduling, `ReservingKVCacheManager`) and FasterTransformer (level 0's static
batches). For one GPU, model and trace (sharegpt, alpaca, shared-prefix, chat: benchmarks/sim/serve.py;
`ft` sits out chat, whose next turns a static engine cannot take) it prints and plots

  1. normalized latency (s/token) against request rate, per system: the paper's figure 12;
  2. the highest rate each system sustains (its saturated rate, lowered if needed to meet a
     normalized-latency SLO), and vLLM's ratio to each (paper, OPT-13B on ShareGPT: 1.7-2.7x
     Orca Oracle, 2.7-8x Orca Max, up to 22x FT);
  3. at one rate (`--at-rate`, 2 req/s: the paper's figure 13), the mean number of batched
     requests and the share of KV memory holding tokens (figure 2: 20.4-38.2 % for Orca), the
     preemptions, the mean TTFT and the share of prompt tokens found in the prefix cache;
  4. a capacity table: vLLM's sustainable rate per replica at TP 1/2/4/8 (and, with `--pp`, each
     with that many pipeline stages: level 5's micro-batches overlapping on them) and the GPUs that
     `--target-rate` requests/s would need.

The plot what_if_<gpu>_<model>_<trace>.png and the numbers what_if_<gpu>_<model>_<trace>.json go
outside the repository (`ladder.cli.output_dir()`) unless --img-dir and --out say where; the
committed ones: --img-dir docs/img --out benchmarks/results/what_if_<gpu>_<model>_<trace>.json.

While it runs (minutes at the defaults: each sustainable rate is a bisection of whole simulated
runs), it writes a line to stderr as each part finishes (`--no-progress`: none).

What it is not: a measurement. Only the cost model's time is modelled (benchmarks/sim/cost.py
and docs/what_if.md say what it leaves out); every decision is the real engine's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.sim.cost import gpu, gpu_names, kv_budget, model_shape
from benchmarks.sim.serve import TRACES, simulate, trace

PAPER = {  # OPT-13B, one A100-40GB, ShareGPT (Kwon et al. 2023, figures 2, 12 and 13)
    "ratio": {"orca-oracle": "1.7-2.7x", "orca-pow2": "-", "orca-max": "2.7-8x", "ft": "up to 22x"},
    "batched": {"vllm": 30.42, "orca-oracle": 13.62, "orca-pow2": 9.81, "orca-max": 7.00},
    "kv": {"vllm": 96.3, "orca-oracle": 38.2, "orca-pow2": 26.8, "orca-max": 20.4},
}
PLOTTED = ("vllm", "orca-oracle", "orca-pow2", "orca-max", "ft")


def latency_at(system: str, rate: float, args, tp: int = 1, pp: int = 1):
    reqs = trace(args.trace, args.requests, rate, args.seed, model_shape(args.model).vocab)
    kwargs = {}
    if system == "vllm-spec":
        kwargs = dict(num_speculative_tokens=args.spec_k, alpha=args.spec_alpha,
                      draft_shape=model_shape(args.spec_draft) if args.spec_draft else None)  # fmt: skip
    return simulate(system, reqs, args.gpu, args.model, tp, rate, pp=pp, hardware=args.hw, **kwargs)


def max_rate(system: str, args, tp: int = 1, pp: int = 1) -> float:
    """The highest rate a system sustains: its saturated rate (requests finished per second while a queue
    waits, all requests arriving at once: at or above it the queue grows without bound, however few
    requests a run has to show it), lowered, if the SLO needs it, to the highest rate whose normalized
    latency meets the SLO (bisection on a log scale, 4 %). On chat only the first turns arrive at once;
    the later ones follow their answers, so near the end the queue can run dry while turns wait on
    their users' pauses: a slight underestimate there."""
    cap = latency_at(system, math.inf, args, tp, pp).drain_rate
    if latency_at(system, cap, args, tp, pp).normalized_latency <= args.slo:
        return cap
    lo, hi = cap / 1024, cap
    if latency_at(system, lo, args, tp, pp).normalized_latency > args.slo:
        return 0.0
    while hi / lo > 1.04:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if latency_at(system, mid, args, tp, pp).normalized_latency <= args.slo else (lo, mid)
    return lo


class Progress:
    """A line on stderr as each part finishes, with the seconds so far: the tables come only at the end."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.enabled, self.done, self.t0 = total, enabled, 0, time.perf_counter()

    def __call__(self, what: str) -> None:
        self.done += 1
        if self.enabled:
            seconds = time.perf_counter() - self.t0
            print(f"  [{seconds:5.0f} s] {self.done}/{self.total} {what}", file=sys.stderr, flush=True)


def plot(curves: dict, rates: list[float], args, at: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    for system, ys in curves.items():
        ax.plot(rates, ys, marker="o", ms=3, label=system)
    ax.axhline(args.slo, color="grey", ls=":", lw=1, label=f"SLO {args.slo} s/token")
    ax.set(xlabel="request rate (req/s)", ylabel="normalized latency (s/token)", ylim=(0, 4 * args.slo),
           title=f"{args.model} on a simulated {args.gpu}, {args.trace}-like")  # fmt: skip
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    names = list(at)
    bx.bar(names, [100 * at[s].kv_token_share for s in names], label="of reserved")
    bx.bar(names, [100 * at[s].kv_pool_share for s in names], alpha=0.6, label="of the whole pool")
    bx.set(ylabel="% of KV memory holding tokens", title=f"at {args.at_rate} req/s", ylim=(0, 100))
    bx.tick_params(axis="x", labelrotation=30, labelsize=8)
    bx.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--gpu", default="a100-40gb", choices=gpu_names())
    p.add_argument("--model", default="opt-13b", help="a shape in benchmarks/sim/models (opt-13b, llama-2-7b, ...)")
    p.add_argument("--trace", "--workload", default="sharegpt", choices=list(TRACES))
    p.add_argument("--requests", type=int, default=1000, help="requests per simulated run")
    p.add_argument("--slo", type=float, default=0.1, help="normalized-latency SLO (s/token) for sustainable rates")
    p.add_argument("--at-rate", type=float, default=None, help="rate for batched requests and KV use (default: 2 "
                   "for sharegpt and chat, 30 for alpaca, as the paper's figure 13; 10 for shared-prefix)")  # fmt: skip
    p.add_argument("--target-rate", type=float, default=10.0, help="req/s the capacity table plans for")
    p.add_argument("--tp", nargs="+", type=int, default=[1, 2, 4, 8], help="TP sizes for the capacity table")
    p.add_argument("--pp", nargs="+", type=int, default=[1], help="PP sizes for the capacity table, each with every "
                   "TP size (default 1; e.g. --pp 1 2 4: level 5's micro-batches overlapping on the stages)")  # fmt: skip
    p.add_argument("--link-gbytes", type=float, default=None, help="GB/s between GPUs, one way (default: the GPU's "
                   "own, gpus.json: NVLink's, PCIe's for the L4; e.g. 25 for 200 Gb/s InfiniBand between nodes): "
                   "what TP's all-reduces and PP's sends cross")
    p.add_argument("--link-latency-us", type=float, default=None, help="microseconds a message costs before its "
                   "bytes (default: the GPU's, 10)")
    p.add_argument("--points", type=int, default=10, help="rates on the latency curves")
    p.add_argument("--spec-k", type=int, default=0, help="add vllm-spec: level 4 with this many guesses per step")
    p.add_argument("--spec-alpha", type=float, default=0.7, help="vllm-spec: P(a guess is accepted | those before were)")
    p.add_argument("--spec-draft", default=None, help="vllm-spec: the draft model's shape (default: free guesses)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no line on stderr as each part finishes")
    p.add_argument("--out", type=Path, default=None, help="the JSON (default: outside the repository)")
    p.add_argument("--img-dir", type=Path, default=None, help="where the plot goes (default: outside the repository)")
    args = p.parse_args(argv)
    args.at_rate = args.at_rate or {"sharegpt": 2.0, "alpaca": 30.0, "shared-prefix": 10.0, "chat": 2.0}[args.trace]
    t0 = time.perf_counter()
    shape, hw = model_shape(args.model), gpu(args.gpu)
    if args.link_gbytes:  # GPUs in other boxes: a slower link
        hw = replace(hw, link_bytes_per_s=1e9 * args.link_gbytes)
    if args.link_latency_us is not None:
        hw = replace(hw, link_latency_s=1e-6 * args.link_latency_us)
    args.hw = hw
    budget = kv_budget(hw, shape)
    print(f"{args.model} ({shape.params / 1e9:.1f} B parameters, {shape.weight_bytes / 2**30:.1f} GiB) on a simulated "
          f"{hw.name}: KV budget {budget / 2**30:.1f} GiB = {budget // shape.kv_bytes_per_token} tokens; "
          f"{args.trace}-like trace, {args.requests} requests per run; between GPUs {hw.link_bytes_per_s / 1e9:.1f} "
          f"GB/s, {hw.link_latency_s * 1e6:.0f} us a message")  # fmt: skip

    # 2. sustainable rates (vLLM first: its rate sets the curves' range)
    plotted = tuple(s for s in PLOTTED if not (s == "ft" and args.trace == "chat"))  # (static: no next turns)
    prefix = ("vllm-prefix",) if args.trace in ("shared-prefix", "chat") else ()
    systems = plotted + prefix + (("vllm-spec",) if args.spec_k else ())
    layouts = [(tp, pp) for pp in args.pp for tp in args.tp if tp * pp > 1]
    done = Progress(3 * len(systems) + len(layouts), enabled=not args.no_progress)
    if not args.no_progress:
        print(f"simulating {len(systems)} systems (a sustainable rate, {args.points} rates, {args.at_rate} req/s each), "
              f"then {len(layouts)} more layouts: a line as each part finishes", file=sys.stderr, flush=True)  # fmt: skip
    sustain = {}
    for system in systems:
        sustain[system] = max_rate(system, args)
        done(f"sustainable rate of {system}: {sustain[system]:.3f} req/s")
    # 1. the curves
    top = 1.25 * sustain["vllm"]
    rates = [top * (i + 1) / args.points for i in range(args.points)]
    curves = {}
    for s in systems:
        curves[s] = [latency_at(s, r, args).normalized_latency for r in rates]
        done(f"latency curve of {s}")
    # 3. at one rate
    t_run = time.perf_counter()
    at = {}
    for s in systems:
        at[s] = latency_at(s, args.at_rate, args)
        done(f"{s} at {args.at_rate} req/s")
    seconds_per_run = (time.perf_counter() - t_run) / len(systems)

    print(f"\nnormalized latency (s/token) against request rate{'':10s}" + "".join(f"{s:>12s}" for s in systems))
    for i, r in enumerate(rates):
        print(f"  {r:8.3f} req/s{'':38s}" + "".join(f"{curves[s][i]:12.3f}" for s in systems))
    print(f"\nsustainable rate (saturated, lowered if needed to meet {args.slo} s/token), normalized latency there, "
          "and vLLM's ratio (paper: OPT-13B, A100-40GB, ShareGPT)")  # fmt: skip
    for s in systems:
        ratio = sustain["vllm"] / sustain[s] if sustain[s] else math.inf
        paper = PAPER["ratio"].get(s, "") if args.trace == "sharegpt" else ""
        there = latency_at(s, sustain[s], args).normalized_latency if sustain[s] else math.nan
        print(f"  {s:12s} {sustain[s]:8.3f} req/s  {there:6.3f} s/token   vLLM / it {ratio:6.2f}x   {paper}")
    print(f"\nat {args.at_rate} req/s: batched requests, KV memory holding tokens (of reserved / of the pool), "
          "preemptions, mean TTFT, prompt tokens found in the prefix cache (paper: figure 13, figure 2)")  # fmt: skip
    for s in systems:
        r = at[s]
        paper = f"{PAPER['batched'].get(s, '-')} / {PAPER['kv'].get(s, '-')} %" if args.trace == "sharegpt" else ""
        print(f"  {s:12s} {r.mean_batch:7.2f}   {100 * r.kv_token_share:5.1f} % / {100 * r.kv_pool_share:5.1f} %   "
              f"{r.preemptions:5d}   {1000 * r.mean_ttft:8.1f} ms   {100 * r.prefix_hit_share:3.0f} %   "
              f"paper {paper}")  # fmt: skip

    # 4. capacity
    print(f"\ncapacity: vLLM per replica at the SLO, and the GPUs {args.target_rate} req/s would need")
    capacity = []
    for pp in args.pp:
        for tp in args.tp:
            name = f"TP {tp}" + (f" x PP {pp}" if pp > 1 else "")
            try:
                kv_budget(hw, shape, tp * pp)
            except ValueError as e:
                print(f"  {name}: {e}")
                continue
            rate = sustain["vllm"] if tp * pp == 1 else max_rate("vllm", args, tp, pp)
            if tp * pp > 1:
                done(f"vLLM's sustainable rate at {name}")
            gpus = math.ceil(args.target_rate / rate) * tp * pp if rate else None
            capacity.append({"tp": tp, "pp": pp, "rate_per_replica": rate, "gpus": gpus})
            print(f"  {name}: {rate:8.3f} req/s per replica -> {gpus} GPUs")
    result = {
        "gpu": args.gpu, "model": args.model, "trace": args.trace, "requests": args.requests, "slo": args.slo,
        "link_bytes_per_s": hw.link_bytes_per_s, "link_latency_s": hw.link_latency_s,
        "rates": rates, "curves": curves, "sustainable": sustain, "at_rate": args.at_rate,
        "at": {s: vars(r) for s, r in at.items()}, "capacity": capacity, "paper": PAPER,
        "seconds_per_run": seconds_per_run, "seconds": time.perf_counter() - t0,
    }  # fmt: skip
    from ladder.cli import output_dir

    stem = f"what_if_{args.gpu}_{args.model}_{args.trace}"
    out = args.out or output_dir() / f"{stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    if not args.no_plot:
        img = (args.img_dir or output_dir()) / f"{stem}.png"
        plot(curves, rates, args, at, img)
        print(f"\nplot: {img}")
    print(f"json: {out}  ({result['seconds']:.0f} s; one run of {args.requests} requests: {seconds_per_run:.1f} s)")
    return result


if __name__ == "__main__":
    main()
