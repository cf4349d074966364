"""The cost model fitted to what DistServe's artifact measured: each system's speed from its requests alone.

What it is: `python -m benchmarks.sim.distserve_fit DIR`, where DIR holds the measured requests of DistServe's
simulator's ground truth (`simdistserve/benchmarks/alignment/data-ground-truth/opt-13b-sharegpt/` in
github.com/LLMServe/DistServe: one Python list of dicts a file, each request's prompt_len, output_len, ttft_ms
and tpot_ms, then a summary). It fits three numbers of the cost model (cost.py's `Hardware`) to each system
at its lowest measured rate, where a request mostly runs alone:

    compute_efficiency, client_s   to the fastest TTFT in each 250-token band of prompt lengths (a prompt's
                                   prefill with nothing ahead of it: the band's lower envelope), against
                                   client_s + the model's prefill of that prompt at the system's prefill TP;
                                   client_s is the time a request spends outside the engine's steps before
                                   its first token (the client, HTTP, tokenizing)
    memory_efficiency              to the median TPOT of requests with more than 20 output tokens, against
                                   the model's decode step of as many requests as were decoding on average
                                   (Little's law: the decode engine's rate x the mean time a request decodes),
                                   each at the mean prompt plus half the mean output

by a grid search on the relative squared error, and prints them beside the errors left. disagg.py's
`MEASURED_SPEEDS` holds what this printed (its `--speeds measured`); the ground truth is not committed.

`--validate` then replays every measured run of the two systems (vLLM's `vllm-*`, DistServe's 2P+1D
`distserve-c21d11-*`: the same requests, lengths and arrival times) on the simulator at the fitted speeds and
prints the measured and simulated SLO attainment (TTFT <= 0.25 s and TPOT <= 0.1 s) and medians side by side:
the fit saw only the lowest rate, so the others are predictions.

Why: DistServe compared two engines of different speeds (vLLM of 2023 and its own), so its figure mixes
what disaggregation does with what faster kernels do. Fitted separately, the simulator can play each system
at its measured speed, and the same kernels for both, and say which part is which.

What it is not: a kernel model. The fit is to single-request latencies (TTFT also holds the client's and the
HTTP server's time, which lands in the step overhead), not to the loaded runs the goodput comes from: those
are what the simulator then predicts.
"""

from __future__ import annotations

import argparse
import ast
import random
from dataclasses import replace
from pathlib import Path
from statistics import median

from .cost import Hardware, gpu, model_shape, step_time
from .disagg import MEASURED_SPEEDS, colocated, disaggregated
from .serve import SimRequest

# What each system's fit reads: (its lowest-rate file, prefill TP, decode TP, requests/s its decode engine saw)
SYSTEMS = {"vllm": ("vllm-100-1.exp", 1, 1, 1.0), "distserve": ("distserve-c21d11-300-3.exp", 2, 1, 3.0)}


def load(path: Path) -> list[dict]:
    """The measured requests of one ground-truth file (the list before its summary)."""
    text = path.read_text()
    return ast.literal_eval(text[: text.index("]") + 1])


def envelope(records: list[dict], band: int = 250) -> list[tuple[int, float]]:
    """(prompt tokens, seconds): the fastest TTFT of each band of prompt lengths."""
    best: dict[int, dict] = {}
    for r in records:
        b = r["prompt_len"] // band
        if b not in best or r["ttft_ms"] < best[b]["ttft_ms"]:
            best[b] = r
    return [(r["prompt_len"], r["ttft_ms"] / 1e3) for _, r in sorted(best.items())]


def decode_load(records: list[dict], rate: float) -> tuple[float, int, int]:
    """(median TPOT in seconds of requests with more than 20 output tokens, the mean number decoding at once,
    their mean context)."""
    tpots = sorted(r["tpot_ms"] for r in records if r["output_len"] > 20)
    decoding = sum((r["output_len"] - 1) * r["tpot_ms"] / 1e3 for r in records) / len(records)
    prompt = sum(r["prompt_len"] for r in records) / len(records)
    output = sum(r["output_len"] for r in records) / len(records)
    return tpots[len(tpots) // 2] / 1e3, max(1, round(rate * decoding)), round(prompt + output / 2)


def fit(records: list[dict], model: str, hw: Hardware, prefill_tp: int, decode_tp: int, rate: float) -> dict:
    """The efficiencies and the client's time that bring the model closest to the measured latencies."""
    shape, points = model_shape(model), envelope(records)
    tpot, batch, context = decode_load(records, rate)
    grid = [x / 100 for x in range(5, 101)]

    def prefill_err(h: Hardware, client_s: float) -> float:
        return sum(((client_s + step_time(h, shape, [(0, n)], 1, prefill_tp)) / t - 1) ** 2 for n, t in points)

    def decode_err(h: Hardware) -> float:
        return (step_time(h, shape, [(context, 1)] * batch, batch, decode_tp) / tpot - 1) ** 2

    # a short prompt's prefill reads the weights (memory) and a decode step does some FLOPs (compute): each
    # fit depends a little on the other's efficiency, so they take turns until neither moves
    c, m, client_s = hw.compute_efficiency, hw.memory_efficiency, 0.0
    for _ in range(10):
        h = replace(hw, memory_efficiency=m)
        _, c_new, client_s = min((prefill_err(replace(h, compute_efficiency=e), s), e, s)
                                   for s in (ms / 1e3 for ms in range(61)) for e in grid)  # (client: 0-60 ms)  # fmt: skip
        m_new = min(grid, key=lambda e: decode_err(replace(hw, compute_efficiency=c_new, memory_efficiency=e)))
        if (c_new, m_new) == (c, m):
            break
        c, m = c_new, m_new
    err = prefill_err(replace(hw, compute_efficiency=c, memory_efficiency=m), client_s)  # (what is reported)
    return {"compute_efficiency": c, "memory_efficiency": m, "client_s": client_s,
            "prefill_rms": (err / len(points)) ** 0.5,
            "decode_error": decode_err(replace(hw, compute_efficiency=c, memory_efficiency=m)) ** 0.5,
            "tpot_s": tpot, "decode_batch": batch}  # fmt: skip


def replay(records: list[dict], system: str, speed: dict, vocab: int = 50272) -> list:
    """The measured requests (their lengths and arrival times) on the simulator: DistServe's artifact ran vLLM
    with 16,384 prompt tokens a step (V0's schedule) and DistServe as 2P (TP=2) + 1D."""
    rng, t0 = random.Random(0), min(r["issue_time"] for r in records)
    reqs = [SimRequest(r["issue_time"] - t0, [rng.randrange(3, vocab) for _ in range(r["prompt_len"])],
                       r["output_len"]) for r in sorted(records, key=lambda r: r["issue_time"])]  # fmt: skip
    if system == "vllm":
        return colocated(reqs, "opt-13b", "a100-80gb", v0=True, v0_tokens=16384, speed=speed)
    return disaggregated(reqs, "opt-13b", "a100-80gb", "nvlink", 2, 1, 1, speed=speed)


def validate(directory: Path, speeds: dict) -> list[dict]:
    """Measured against simulated, for every run of the two systems in `directory`."""
    rows = []
    for system, pattern, gpus in (("vllm", "vllm-*.exp", 1), ("distserve", "distserve-c21d11-*.exp", 3)):
        for path in sorted(directory.glob(pattern), key=lambda p: float(p.stem.split("-")[-1])):
            measured = load(path)
            sim = replay(measured, system, speeds[system])
            ok = sum(r["ttft_ms"] <= 250 and r["tpot_ms"] <= 100 for r in measured) / len(measured)
            rows.append({"system": system, "requests": len(measured), "rate_per_gpu": float(path.stem.split("-")[-1]) / gpus,
                         "measured": ok, "simulated": sum(t.ttft <= 0.25 and t.tpot <= 0.1 for t in sim) / len(sim),
                         "ttft_p50": (median(r["ttft_ms"] / 1e3 for r in measured), median(t.ttft for t in sim)),
                         "tpot_p50": (median(r["tpot_ms"] / 1e3 for r in measured), median(t.tpot for t in sim))})  # fmt: skip
    return rows


def main(argv=None) -> dict:
    from ladder.cli import LadderParser

    p = LadderParser(prog="python -m benchmarks.sim.distserve_fit", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("dir", type=Path, help="DistServe's opt-13b-sharegpt ground truth (its *.exp files)")
    p.add_argument("--model", default="opt-13b")
    p.add_argument("--gpu", default="a100-80gb")
    p.add_argument("--validate", action="store_true", help="replay every measured run at disagg.py's MEASURED_SPEEDS")
    args = p.parse_args(argv)
    out = {}
    for name, (file, ptp, dtp, rate) in SYSTEMS.items():
        out[name] = fit(load(args.dir / file), args.model, gpu(args.gpu), ptp, dtp, rate)
        print(name, {k: round(v, 4) for k, v in out[name].items()})
    if args.validate:
        out["validation"] = validate(args.dir, MEASURED_SPEEDS)
        print("system     requests  rate/GPU  attainment: measured  simulated   TTFT p50 (s)   TPOT p50 (s)")
        for r in out["validation"]:
            print(f"{r['system']:<10} {r['requests']:>8}  {r['rate_per_gpu']:>8.2f}  {r['measured']:>20.2f}  "
                  f"{r['simulated']:>9.2f}   {r['ttft_p50'][0]:.3f} {r['ttft_p50'][1]:.3f}    "
                  f"{r['tpot_p50'][0]:.3f} {r['tpot_p50'][1]:.3f}")
    return out


if __name__ == "__main__":
    main()
