"""How fast this machine is right now: two short probes the validation takes around every measurement.

What it is: a shared machine's speed drifts (a neighbour's load, its clock), by tens of per cent
over the minutes one level's benchmark takes (the same engine on the same workload measured
212 and 138 tokens/s in two runs an hour apart). A calibration fitted at one moment then
predicts rows measured at others, and the row's error mixes two things: what the cost model
gets wrong, and how much slower or faster the machine was. Two probes, taken before and after
each measured row and after each calibration, separate them:

  compute   the model's own matmul chain at batch 64 (`roofline.matmul_flops_per_s`, best of
            five 0.1 s windows): what the roofline's rates (matmuls, memory reads) scale by;
  small     a loop of the small work a CPU engine pays per step and per row outside the matmuls
            (tiny tensor ops through torch's dispatcher, Python lists and dicts), best of five
            0.1 s windows, in loops per second: what the calibration's c0-c5 (and d0, d1) scale by.

`scaled(roofline, cal, at, ref)` is the hardware as it was at `at`, from a roofline and a
calibration taken at `ref`. The validation reports its errors with and without it.

What it is not: a correction the cost model learns from the rows (each probe runs alone, on
its own fixed work, never on the benchmark's requests), or exact: the probes' work is not the
engines', and a neighbour that slows one may spare the other.
"""

from __future__ import annotations

import time

import torch

WINDOW_S, REPEATS = 0.1, 5
COSTS = ("c0_s", "c1_s", "c2_s", "c3_s", "c4_s", "c5_s", "d0_s", "d1_s")  # a calibration's seconds (validate.calibrate)


def small_work_rate(window: float = WINDOW_S, repeats: int = REPEATS) -> float:
    """Loops per second of tiny torch ops and Python bookkeeping (best window): per-step and per-row costs."""
    a, idx = torch.arange(16, dtype=torch.float32), torch.tensor([1, 3, 5, 7])
    best = 0.0
    for _ in range(repeats):
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < window:
            for _ in range(32):
                b = a[idx] * 2.0 + 1.0  # [4]: an index, two elementwise ops, as a block table's bookkeeping
                rows = {i: [i, i + 1] for i in range(8)}  # a scheduler's dicts and lists
                rows[0].extend(b.shape)
            n += 32
        best = max(best, n / (time.perf_counter() - start))
    return best


def probe(dims, dtype: torch.dtype) -> dict:
    """Both rates now: {"compute": FLOP/s of the matmul chain at batch 64, "small": loops/s}."""
    from benchmarks import roofline

    compute = roofline.matmul_flops_per_s(dims, 64, dtype, torch.device("cpu"), WINDOW_S, REPEATS)
    return {"compute": compute, "small": small_work_rate()}


def around(before: dict, after: dict) -> dict:
    """The pace of a run between two probes: the faster of each (a run keeps its fastest repeat, the least
    disturbed; the probe nearer that moment is the faster one more often than not)."""
    return {k: max(before[k], after[k]) for k in before}


def scaled(roofline: dict, cal: dict, at: dict, ref: dict) -> tuple[dict, dict]:
    """The roofline and the calibration as the machine was at `at`, given both were taken at `ref`: rates
    times compute(at) / compute(ref), seconds times small(ref) / small(at)."""
    k = at["compute"] / ref["compute"]
    roof = {**roofline, "sweep": [{**p, "flops_per_s": p["flops_per_s"] * k} for p in roofline["sweep"]],
            "bandwidth": roofline["bandwidth"] * k}  # fmt: skip
    s = ref["small"] / at["small"]
    return roof, {key: v * s if key in COSTS else v for key, v in cal.items()}
