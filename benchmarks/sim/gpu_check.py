"""`python -m benchmarks.sim.gpu_check`: the ladder on a real GPU, and the what-if's prediction of the same run.

What it is: the check docs/what_if.md asks for when a GPU is at hand (the project's `device` tool lends one
to some sessions, for minutes): one command, prepared and tried on a CPU, in parts, in this order:

  kernel_tests         what the Triton kernel's tests said (`gpu_check.sh` runs them first: --kernel-log/-rc)
  prompt_logprobs      the features only a CUDA device can break, each on the built-in pair in seconds
  sampled_speculation  (benchmarks/sim/gpu_correctness.py says what each checks); structured outputs need
  structured_outputs   xgrammar or llguidance, and are skipped in one line without either
  compiled_step        the built-in model eager against compiled with CUDA graphs (benchmarks/compiled_step.py's
                       gpu_part): the same greedy tokens counted, ms per decode step at batch 1 and 16
  model                a random-weight Llama of about 1B parameters (Llama-3.2-1B's shape: hidden 2048, 16
                       layers, 32 query / 8 KV heads, FFN 8192, with the project's byte-level tokenizer, 259
                       tokens) in bfloat16, saved with `save_pretrained` into the output folder (2.5 GB:
                       gpu_check.sh deletes it on any exit);
  throughput           `benchmarks.throughput` on it: Hugging Face `generate` and levels 0, 2, 3 (`--workload`
                       each, a KV budget for every request at once), bfloat16;
  predict              levels 0, 2, 3 simulated on the same requests with the GPU's spec from gpus.json
                       (`--gpu`, by default the one that matches the device) and the model's shape,
                       *uncalibrated*: measured against predicted tokens/s and mean TTFT, row by row;
  throughput_level1    level 1 (the Triton kernel compiled for real) alone, last: its failure costs nothing else.

Every part fails soft (benchmarks/sim/fail_soft.py): an exception is one line (`part NAME error ...`, its
traceback on stderr) and the next part runs. The check keeps its own clock (`--budget`): a part that would
not fit in what is left is skipped with one line, and one that runs past the deadline (or its own cap) is
cut by an alarm and reported as `timeout`. After each part everything so far is written to `gpu_check.json`: each part's status, time and
figures, the machine, the rows measured beside predicted and their summary; the benchmark's own JSON is
`measured.json` beside it. The exit status is 1 when a part failed, errored or was cut, else 0.

On a CPU, `--device cpu --small` runs the same parts on a small model and the quick workloads
(tests/test_gpu_check.py and tests/test_simulator.py): the plumbing, not the figures.

What it is not: a calibration. The CPU validation (`benchmarks.sim.validate`) fits the per-step overheads to
the machine; here the GPU's are left as assumed, so the errors say how far the what-if's GPU figures can be
trusted as they are. Nor a test suite: tests/ proves the features; this runs each once where CUDA is real.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks import compiled_step

from . import gpu_correctness
from .fail_soft import Check, Skip, part_line

SIMULATED = ("level0_naive", "level2_continuous", "level3_prefix")
MEASURED = ("hf", "level0_naive", "level1_paged", "level2_continuous", "level3_prefix")
ONE_B = dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, max_positions=4096)  # Llama-3.2-1B's shape
SMALL = dict(hidden=128, layers=2, heads=4, kv_heads=2, ffn=256, max_positions=2048)
# part: (seconds it needs before it is worth starting, the most it may take; None: until the deadline).
# The caps keep one hung part from eating the others' time; the throughput, which writes its JSON only
# at its end, runs to the deadline rather than be cut for a later part that would have nothing to read.
PARTS = {"prompt_logprobs": (10, 60), "sampled_speculation": (10, 45), "structured_outputs": (10, 45),
         "compiled_step": (30, 120), "model": (20, 90), "throughput": (60, None), "predict": (5, 60), "throughput_level1": (30, None)}  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sim.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--gpu", default="auto", help="the GPU's spec in benchmarks/sim/gpus.json (default auto: the one "
                   "whose name the device's matches, else h200)")  # fmt: skip
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="where to measure (default cuda)")
    p.add_argument("--workload", action="append", default=None, help="repeatable (default: uniform)")
    p.add_argument("--num-requests", type=int, default=64, help="requests per workload (default 64)")
    p.add_argument("--small", action="store_true", help="a small model and the quick workloads: the plumbing only")
    p.add_argument("--out", type=Path, default=None, help="folder for the model and the JSON (default: outside the "
                   "repository)")  # fmt: skip
    p.add_argument("--budget", type=float, default=None, help="seconds for every part together (default: no limit)")
    p.add_argument("--parts", default=None, help=f"comma list, a subset of: {', '.join(PARTS)} (default: all)")
    p.add_argument("--kernel-log", type=Path, default=None, help="the kernel tests' output (gpu_check.sh's)")
    p.add_argument("--kernel-rc", type=int, default=None, help="their exit status (124: timed out)")
    return p


def gpu_key(name: str, device_name: str) -> str:
    """`--gpu auto`: the gpus.json entry the device's name matches (an H100 is predicted as one), else h200."""
    if name != "auto":
        return name
    n = device_name.lower()
    for needle, key in (("h200", "h200"), ("h100", "h100-80gb"), ("a100", "a100-40gb" if "40g" in n else "a100-80gb"),
                        ("l4", "l4")):  # fmt: skip
        if needle in n:
            return key
    return "h200"


def machine(device: str) -> dict:
    import platform
    from importlib import metadata

    import torch

    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    name = torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.machine()})"
    return {"device": name, "cuda": torch.version.cuda, "python": platform.python_version(),
            **{pkg: version(pkg) for pkg in ("torch", "triton", "transformers", "xgrammar", "llguidance")}}  # fmt: skip


def kernel_tests(log: Path, rc: int | None) -> dict:
    """The .sh's kernel-test run as a part: pass on exit 0, timeout on 124/137 (`timeout`'s), else fail."""
    import re

    last = log.read_text().strip().splitlines()[-1:] if log.is_file() else []
    line = last[0] if last else "no output"
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", line)}
    took = re.search(r" in ([\d.]+)s", line)  # pytest's own time; none when `timeout` cut it
    status = "pass" if rc == 0 else "timeout" if rc in (124, 137) else "fail"
    return {
        "status": status,
        "seconds": float(took[1]) if took else 0.0,
        "figures": {"exit": rc, **counts},
        "line": line,
    }


def build_model(out: Path, small: bool, device: str) -> tuple[Path, str]:
    """The random-weight Llama, in bfloat16 (about 2.5 GB for 1B), built once into `out`; (its path, where
    its weights were drawn). On the device: a CPU draws 1.2B random numbers in about a minute on a few
    cores, a GPU in well under a second, and `save_pretrained` copies them out. If that fails, on the CPU."""
    import shutil

    import torch

    from benchmarks.make_model import build

    path = out / ("llama-small" if small else "llama-1b")
    if (path / "config.json").is_file():
        return path, "earlier"
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # the weights are made in bfloat16: half the time and the memory
    try:
        for where in dict.fromkeys([device, "cpu"]):
            try:
                with torch.device(where):
                    build(path, **(SMALL if small else ONE_B))
                return path, where
            except Exception as e:  # noqa: BLE001 - the device's way failed: the CPU's is slower, not worse
                if where == "cpu":
                    raise
                print(f"building the model on {where} failed ({type(e).__name__}: {e}); building it on the CPU")
                shutil.rmtree(path, ignore_errors=True)
    finally:
        torch.set_default_dtype(before)


def bench_argv(model: Path, args) -> list[str]:
    argv = ["--model", str(model), "--device", args.device, "--dtype", "bfloat16", "--num-requests",
            str(args.num_requests), "--kv-requests", str(args.num_requests), "--hf-sweep", "none", "--no-progress"]  # fmt: skip
    for w in args.workload:
        argv += ["--workload", w]
    return argv + (["--quick"] if args.small else [])


def throughput_figures(measured: dict, engines) -> dict:
    """The figures docs/what_if.md cites, per workload and engine: tokens/s, mean TTFT, steps, batch."""
    return {name: {e: {"output_tokens_per_s": r["output_tokens_per_s"], "ttft_mean_s": r["ttft_s"]["mean"],
                       "steps": r.get("steps"), "mean_running": r.get("mean_running"), "duration_s": r["duration_s"]}
                   for e, r in w["results"].items() if e in engines and "output_tokens_per_s" in r}
            for name, w in measured["workloads"].items()}  # fmt: skip


def measure(model: Path, args, out: Path, figures: dict) -> str:
    """HF and levels 0, 2, 3 through the benchmark, into `out` (level 1 runs alone, later)."""
    from benchmarks import throughput

    engines = [e for e in MEASURED if e != "level1_paged"]
    throughput.main([*bench_argv(model, args), "--engines", ",".join(engines), "--out", str(out)])
    figures.update(throughput_figures(json.loads(out.read_text()), engines))
    return "; ".join(f"{w}: " + ", ".join(f"{e} {r['output_tokens_per_s']:.0f}" for e, r in rows.items())
                     for w, rows in figures.items()) + " output tok/s"  # fmt: skip


def measure_level1(model: Path, args, out: Path, figures: dict) -> str:
    """Level 1 alone (the Triton kernel compiled for real: if it fails, the other rows stand), merged into `out`."""
    from benchmarks import throughput

    if not out.is_file():
        raise Skip("no measured.json to add level 1 to (the throughput part did not finish)")
    level1 = out.with_name("measured_level1.json")
    throughput.main([*bench_argv(model, args), "--engines", "level1_paged", "--out", str(level1)])
    measured = json.loads(out.read_text())
    for name, w in json.loads(level1.read_text())["workloads"].items():
        measured["workloads"][name]["results"].update(w["results"])
    out.write_text(json.dumps(measured, indent=1))
    figures.update(throughput_figures(measured, ["level1_paged"]))
    return "; ".join(f"{w}: level1_paged {r['level1_paged']['output_tokens_per_s']:.0f} output tok/s"
                     for w, r in figures.items())  # fmt: skip


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


def predict_part(check: Check, measured_json: Path, model: Path, gpu_name: str, figures: dict) -> str:
    from .validate import summarise

    if not measured_json.is_file():
        raise Skip("nothing measured to predict (the throughput part did not finish)")
    rows = compare(json.loads(measured_json.read_text()), model, gpu_name)
    assert rows, "no simulated level has a measured row"
    check.result.update(rows=rows, summary=summarise(rows))
    figures.update(check.result["summary"])
    s = check.result["summary"]
    return f"{len(rows)} rows; |error| median: tokens/s {100 * s['tok_s_median']:.1f} %, TTFT {100 * s['ttft_median']:.1f} %"


def print_summary(check: Check, gpu_name: str) -> None:
    from .validate import row_line

    r = check.result
    print(f"\n== gpu_check summary ({r['machine']['device']}, {r['elapsed_s']:.0f} s) ==")
    for name, entry in r["parts"].items():
        print(part_line(name, entry))
    if r["rows"]:
        print(f"\nmeasured on {r['machine']['device']}, predicted for {gpu_name} "
              "(uncalibrated: the cost model's assumed efficiencies and overheads)")  # fmt: skip
        print(f"{'workload':10s} {'level':18s} {'tok/s real':>10s} {'sim':>8s} {'err':>7s}   "
              f"{'TTFT real':>9s} {'sim':>8s} {'err':>7s}   steps real / sim")  # fmt: skip
        for row in r["rows"]:
            print(f"{row_line(row, width=10)}   {row['real_steps']} / {row['sim_steps']}")
    print(f"json: {check.out / 'gpu_check.json'}")


def main(argv=None) -> dict:
    start = time.monotonic()  # before torch's import, which the budget pays for too
    args = parser().parse_args(argv)
    import torch

    from ladder.cli import output_dir

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here (--device cpu --small runs the plumbing on a CPU)")
    wanted = set(args.parts.split(",")) if args.parts else set(PARTS)
    if wanted - set(PARTS):
        raise SystemExit(
            f"gpu_check: unknown parts {', '.join(sorted(wanted - set(PARTS)))}; known: {', '.join(PARTS)}"
        )
    args.workload = args.workload or ["uniform"]
    out = args.out or output_dir() / "gpu_check"
    out.mkdir(parents=True, exist_ok=True)
    check = Check(out, args.budget, start)
    info = machine(args.device)
    gpu_name = gpu_key(args.gpu, info["device"])
    check.result.update(machine=info, gpu=gpu_name, measured=str(out / "measured.json"))
    if args.kernel_log is not None:
        check.result["parts"]["kernel_tests"] = entry = kernel_tests(args.kernel_log, args.kernel_rc)
        print(part_line("kernel_tests", entry), flush=True)
    cuda = args.device == "cuda"
    one_dtype = "bfloat16" if cuda else "float32"  # the CPU's bfloat16 path is not what this checks
    logprob_dtypes = ("float32", "bfloat16") if cuda else ("float32",)  # float32: exact to HF; bfloat16: the real one
    requests, tokens = (4, 24) if args.small else (8, 64)  # sampled speculation's size
    model = out / ("llama-small" if args.small else "llama-1b")

    def build(figures):
        path, figures["built_on"] = build_model(out, args.small, args.device)
        figures["path"] = str(path)
        return f"{'SMALL' if args.small else 'ONE_B'} shape, bfloat16, drawn on {figures['built_on']}, {path}"

    run = {
        "prompt_logprobs": lambda f: gpu_correctness.prompt_logprobs(f, args.device, logprob_dtypes),
        "sampled_speculation": lambda f: gpu_correctness.sampled_speculation(
            f, args.device, one_dtype, requests, tokens
        ),
        "structured_outputs": lambda f: gpu_correctness.structured_outputs(f, args.device, one_dtype),
        "compiled_step": lambda f: compiled_step.gpu_part(f, args.device),
        "model": build,
        "throughput": lambda f: measure(needs_model(model), args, out / "measured.json", f),
        "predict": lambda f: predict_part(check, out / "measured.json", needs_model(model), gpu_name, f),
        "throughput_level1": lambda f: measure_level1(needs_model(model), args, out / "measured.json", f),
    }
    if "throughput" in wanted:
        (out / "measured.json").unlink(missing_ok=True)  # an earlier run's rows are not this run's
    for name, (needs, cap) in PARTS.items():
        if name in wanted:
            check.part(name, run[name], needs, cap)
    check.save()
    print_summary(check, gpu_name)
    return check.result


def needs_model(model: Path) -> Path:
    if not (model / "config.json").is_file():
        raise Skip(f"no model at {model} (the model part did not finish)")
    return model


def failed(result: dict) -> bool:
    return any(p["status"] in ("fail", "error", "timeout") for p in result["parts"].values())


if __name__ == "__main__":
    sys.exit(1 if failed(main()) else 0)
