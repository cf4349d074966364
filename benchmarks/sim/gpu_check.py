"""`python -m benchmarks.sim.gpu_check`: the ladder on a real GPU, and the what-if's prediction of the same run.

What it is: the check docs/what_if.md asks for when a GPU is at hand (the project's `device`
tool lends one to some sessions, for minutes): one command, prepared and tried on a CPU, that

  1. builds a random-weight Llama of about 1B parameters (hidden 2048, 16 layers, 32 query / 8
     KV heads, FFN 8192: Llama-3.2-1B's shape with the project's byte-level tokenizer, so 259
     tokens of vocabulary) in bfloat16, with `save_pretrained`, into the output folder;
  2. measures it with `benchmarks.throughput` on CUDA (Hugging Face `generate` and levels 0-3,
     `--workload` each, a KV budget for every request at once; level 1, which runs the Triton
     kernel compiled for real, in a run of its own, so that its failure costs nothing else);
  3. simulates levels 0, 2 and 3 on the same workloads with the GPU's spec from gpus.json
     (`--gpu`) and the model's shape, *uncalibrated*: the cost model's assumed efficiencies and
     per-step overhead, the only thing the what-if's GPU figures rest on;
  4. prints measured against predicted tokens/s and mean TTFT, row by row, and writes it all as
     JSON beside the benchmark's.

`benchmarks/sim/gpu_check.sh` runs it after the Triton kernel's tests, as one script for the device.
On a CPU, `--device cpu --small` runs the same steps on a small model and the quick workloads
(what tests/test_simulator.py does): the plumbing, not the figures.

What it is not: a calibration. The CPU validation (`benchmarks.sim.validate`) fits the per-step
overheads to the machine; here the GPU's are left as assumed, so the errors say how far the
what-if's GPU figures can be trusted as they are.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SIMULATED = ("level0_naive", "level2_continuous", "level3_prefix")
MEASURED = ("hf", "level0_naive", "level1_paged", "level2_continuous", "level3_prefix")
ONE_B = dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, max_positions=4096)  # Llama-3.2-1B's shape
SMALL = dict(hidden=128, layers=2, heads=4, kv_heads=2, ffn=256, max_positions=2048)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sim.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--gpu", default="h200", help="the GPU's spec in benchmarks/sim/gpus.json (default h200)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="where to measure (default cuda)")
    p.add_argument("--workload", action="append", default=None,
                   help="repeatable (default: uniform)")  # fmt: skip
    p.add_argument("--num-requests", type=int, default=64, help="requests per workload (default 64)")
    p.add_argument("--small", action="store_true", help="a small model and the quick workloads: the plumbing only")
    p.add_argument("--out", type=Path, default=None, help="folder for the model and the JSON (default: outside the "
                   "repository)")  # fmt: skip
    return p


def build_model(out: Path, small: bool) -> Path:
    """The random-weight Llama, in bfloat16 (about 2 GB for 1B), built once into `out`."""
    import torch

    from benchmarks.make_model import build

    path = out / ("llama-small" if small else "llama-1b")
    if not (path / "config.json").is_file():
        before = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # the weights are made in bfloat16: half the time and the memory
        try:
            build(path, **(SMALL if small else ONE_B))
        finally:
            torch.set_default_dtype(before)
    return path


def measure(model: Path, args, out: Path) -> dict:
    """HF and levels 0, 2, 3 through the benchmark, then level 1 alone (its Triton kernel has never run on a GPU:
    if it fails there, the rest is measured already). A KV budget for every request at once (--kv-requests)."""
    from benchmarks import throughput

    argv = ["--model", str(model), "--device", args.device, "--dtype", "bfloat16", "--num-requests",
            str(args.num_requests), "--kv-requests", str(args.num_requests), "--hf-sweep", "none", "--no-progress"]  # fmt: skip
    for w in args.workload:
        argv += ["--workload", w]
    argv += ["--quick"] if args.small else []
    main_engines = [e for e in MEASURED if e != "level1_paged"]
    throughput.main([*argv, "--engines", ",".join(main_engines), "--out", str(out)])
    measured = json.loads(out.read_text())
    level1 = out.with_name("measured_level1.json")
    try:
        throughput.main([*argv, "--engines", "level1_paged", "--out", str(level1)])
        for name, w in json.loads(level1.read_text())["workloads"].items():
            measured["workloads"][name]["results"].update(w["results"])
    except (Exception, SystemExit) as e:  # noqa: BLE001 - reported, not fatal: the other rows stand
        print(f"level 1 failed: {type(e).__name__}: {e}")
        measured["level1_error"] = f"{type(e).__name__}: {e}"
    out.write_text(json.dumps(measured, indent=1))
    return measured


def compare(measured: dict, model: Path, gpu_name: str) -> list[dict]:
    """Each simulated level on each measured workload, on the GPU's spec: measured against predicted."""
    from .cost import gpu
    from .validate import committed_row, predict, side_by_side

    hw, cfg, rows = gpu(gpu_name), measured["config"], []
    for name in measured["workloads"]:
        for level in SIMULATED:
            real = committed_row(measured, name, level)
            if real is None or "output_tokens_per_s" not in real:
                continue  # the level did not run (or failed) on this machine: nothing to hold a prediction against
            sim = predict(level, name, measured, cfg, {}, str(model), "bfloat16", hw=hw)
            rows.append(side_by_side(name, level, real, sim))
    return rows


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    import torch

    from ladder.cli import output_dir

    from .validate import row_line, summarise

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here (--device cpu --small runs the plumbing on a CPU)")
    args.workload = args.workload or ["uniform"]
    out = args.out or output_dir() / "gpu_check"
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(out, args.small)
    measured = measure(model, args, out / "measured.json")
    rows = compare(measured, model, args.gpu)
    print(f"\nmeasured on {measured['machine'].get('device', args.device)}, predicted for {args.gpu} "
          "(uncalibrated: the cost model's assumed efficiencies and overheads)")  # fmt: skip
    print(f"{'workload':10s} {'level':18s} {'tok/s real':>10s} {'sim':>8s} {'err':>7s}   "
          f"{'TTFT real':>9s} {'sim':>8s} {'err':>7s}   steps real / sim")  # fmt: skip
    for r in rows:
        print(f"{row_line(r, width=10)}   {r['real_steps']} / {r['sim_steps']}")
    summary = summarise(rows) if rows else {}
    if rows:
        print(f"|error| median: tokens/s {100 * summary['tok_s_median']:.1f} %, TTFT {100 * summary['ttft_median']:.1f} %")
    for name, w in measured["workloads"].items():  # every engine's measured figure, HF and level 1 included
        line = ", ".join(f"{e} {r['output_tokens_per_s']:.0f}" for e, r in w["results"].items()
                         if "output_tokens_per_s" in r)  # fmt: skip
        print(f"{name}: output tokens/s measured: {line}")
    result = {"gpu": args.gpu, "model": str(model), "rows": rows, "summary": summary,
              "measured": str(out / "measured.json")}  # fmt: skip
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    print(f"json: {out / 'gpu_check.json'}")
    return result


if __name__ == "__main__":
    main()
