"""`python -m benchmarks.throughput`: every level against Hugging Face and the machine's limit.

What it is: the one command behind the committed results and plots.

    python -m benchmarks.throughput --quick                # every workload, tiny: a smoke run (about a minute)
    python -m benchmarks.throughput --workload latency     # one workload, full size (minutes)
    python -m benchmarks.throughput --all --repeats 2 --plots --img-dir docs/img --readme --out benchmarks/results/latest.json
                                                           # the committed results, plots and README tables
    python -m benchmarks.throughput --markdown benchmarks/results/latest.json

Per workload it picks a KV budget that holds `--kv-requests` (16) requests at the
workload's longest prompt + output, the same bytes for every level (same memory,
different ideas), and gives HF a batch of the same 16. Then it measures the CPU's
matmul rate for the model's shapes at a sweep of batches and its memory read bandwidth
(together: the ceiling at each engine's own mean batch, `roofline.py`), warms every
engine up, and runs each engine on the same requests in this one process, in
alternating order across `--repeats` (a shared machine drifts; ratios from one process
drift much less than absolutes), keeping each engine's fastest run.

Two comparisons beside the same-budget one:
  - on `uniform`, HF `generate` also at a sweep of batch sizes (`--hf-sweep`): HF at its
    best batch, whatever memory that takes, is the strongest baseline a user could pick;
  - `poisson` (requests arriving over time) runs at a sweep of request rates, multiples
    (`--rate-multiples`) of level 1's capacity (its requests/s with all of them queued at
    once); the table shows the rate at 0.9x, which level 1 can just sustain, and the goals
    read p99 latency there and the highest rate that keeps p99 TTFT under `--ttft-slo`.
    Each rate runs `--repeats` times too, and each engine keeps its least delayed run (the
    lowest mean end-to-end latency: the arrivals are the same, so the rest is noise).

By default it runs with one torch thread (the most stable figures on a shared machine,
and what a tiny model runs fastest with) and writes its JSON, and with `--plots` its
pictures, outside the repository (`ladder.cli.output_dir()`), so a run never modifies a
tracked file unless asked to (`--out`, `--img-dir docs/img`, `--readme`). A `--quick`
run's plot titles say it is a smoke run.

What it is not: a speed test that can fail. It reports; `goals` says which targets were
met, and nothing exits non-zero because of a number.

Reference: vLLM `benchmarks/benchmark_throughput.py`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch
from rich.console import Console

from ladder.cli import LadderParser, check_device_and_models, nonneg_int, output_dir, positive_int

from . import report, roofline
from .engines import LABELS, available_levels, label, make_engine
from .workloads import NAMES, make_workload

LABELS_KNOWN = [n for n in LABELS if n != "hf" and ":" not in n]

HERE = Path(__file__).resolve().parent
README = HERE.parent / "README.md"
PREFIX_WORKLOADS = ("shared-prefix", "chat")  # where level 3 also runs with its cache off


VARIANTS = {"level3_prefix:nocache": "level3_prefix", "level4_speculative:ngram": "level4_speculative",
            "level3_prefix:offload": "level3_prefix", "level4_speculative:eagle": "level4_speculative",
            "level4_speculative:eagle+frozen": "level4_speculative"} | {
    f"{m}:{v}": m
    for m in ("level1_paged", "level2_continuous", "level3_prefix", "level4_speculative")
    for v in ("invariant", "compiled", "eager", "frozen")
}  # level 3 without its cache, level 4 with n-grams or the EAGLE head, a level with batch_invariant=True,
# compilation_config=3, enforce_eager=True or the frozen GEMMs (compilation_config's FROZEN_GEMM)


def parser() -> argparse.ArgumentParser:
    p = LadderParser(
        prog="python -m benchmarks.throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint directory or built-in name (default: the built-in tiny Shakespeare model)",
    )
    p.add_argument("--draft-model", default=None,
                   help="level 4's draft (default: the built-in draft with the built-in model; otherwise level 4 uses n-grams)")  # fmt: skip
    p.add_argument("--workload", action="append", choices=NAMES, help="repeatable; default: spread (--quick: all)")
    p.add_argument("--all", action="store_true", help="every workload")
    p.add_argument("--engines", default=None, type=engine_list,
                   help="comma list, e.g. hf,level0_naive,level3_prefix:nocache (default: hf + every level that imports)")  # fmt: skip
    p.add_argument(
        "--num-requests", type=positive_int, default=None, help="requests per workload (default 128; --quick 8)"
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny lengths and counts, every workload: a smoke run, about a minute"
    )
    p.add_argument(
        "--kv-requests", type=positive_int, default=16, help="KV budget = this many worst-case requests (default 16)"
    )
    p.add_argument(
        "--hf-batch-size", type=positive_int, default=None, help="HF generate batch size (default: --kv-requests)"
    )
    p.add_argument("--max-num-seqs", type=positive_int, default=256, help="the levels' batch limit (default 256)")
    p.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "float64"], help="default auto"
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default auto")
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="run every engine this many times, alternating order; keep the fastest run (poisson: at each rate, "
        "the least delayed)",
    )
    p.add_argument("--seed", type=nonneg_int, default=0, help="seeds every workload (default 0)")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch CPU threads (default 1: the most stable figures on a shared machine; a tiny model gains nothing from more)")  # fmt: skip
    p.add_argument("--out", type=Path, default=None,
                   help="results JSON (default: throughput.json or quick.json in a folder outside the repository; "
                        "the committed results are benchmarks/results/latest.json)")  # fmt: skip
    p.add_argument("--plots", action="store_true", help="also draw the bench_*.png pictures (into --img-dir)")
    p.add_argument("--img-dir", type=Path, default=None,
                   help="where --plots and --plots-from draw (default: the folder outside the repository where the "
                        "JSON goes without --out; docs/img rewrites the committed pictures)")  # fmt: skip
    p.add_argument("--img-prefix", default="bench_", help="file name prefix of the PNGs (default bench_)")
    p.add_argument("--plots-from", metavar="JSON", type=existing_file, help="only redraw the plots from a results JSON")
    p.add_argument(
        "--markdown",
        metavar="JSON",
        type=existing_file,
        help="only print the markdown results tables of a results JSON",
    )
    p.add_argument(
        "--readme",
        action="store_true",
        help="also write the README's results tables (with a run, or with --markdown JSON)",
    )
    p.add_argument("--hf-sweep", type=batch_list, default=None,
                   help="HF batch sizes to also run on uniform, comma list, or none (default 8,16,32,64,128; --quick 4,8)")  # fmt: skip
    p.add_argument("--rate-multiples", type=multiple_list, default=None,
                   help="poisson: request rates as multiples of level 1's capacity (default 0.25,0.5,0.9,1.25,1.5,2; --quick 0.5,1.5)")  # fmt: skip
    p.add_argument("--ttft-slo", type=float, default=2.0, help="poisson: the p99 TTFT target in seconds (default 2)")
    p.add_argument("--no-progress", action="store_true", help="draw no progress bars")
    return p


POISSON_ENGINES = ("hf", "level1_paged", "level2_continuous", "level3_prefix")  # static vs continuous batching
REFERENCE_MULTIPLE = 0.9  # the poisson rate the tables show: one level 1 can just sustain


def batch_list(text: str) -> list[int]:
    if text.strip() == "none":
        return []
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive batch sizes, e.g. 8,16,32, or none")
    return out


def multiple_list(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive multiples, e.g. 0.5,0.9,1.5")
    return out


def engine_list(text: str) -> list[str]:
    """`--engines`: every name must be an engine this harness knows (checked before anything runs)."""
    known = ["hf", *LABELS_KNOWN, *VARIANTS]
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown engine {', '.join(bad) or repr(text)}; known: {', '.join(known)}")
    return names


def existing_file(text: str) -> Path:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file")
    return Path(text)


def parse_args(argv=None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if not (args.markdown or args.plots_from):
        check_device_and_models(p, args, ("model", "draft_model"))
        levels = set(available_levels())
        missing = [n for n in (args.engines or []) if n != "hf" and VARIANTS.get(n, n) not in levels]
        if missing:
            p.error(
                f"argument --engines: {', '.join(missing)} cannot run here (importable levels: {', '.join(sorted(levels))})"
            )
    return args


def machine_info(device: torch.device) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass

    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    try:  # read-only: which commit the numbers belong to
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "triton": version("triton"), "transformers": version("transformers"),
        "python": platform.python_version(), "platform": platform.platform(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "git_commit": commit,
    }  # fmt: skip


def engine_names(args, workload: str, levels: list[str]) -> list[str]:
    if workload == "poisson" and not args.engines:
        return [n for n in POISSON_ENGINES if n == "hf" or n in levels]
    names = list(args.engines) if args.engines else ["hf", *levels]
    if not args.engines and "level3_prefix" in names and workload in PREFIX_WORKLOADS:
        names.append("level3_prefix:nocache")
    return names


def make_console() -> Console:
    console = Console()
    return console if console.is_terminal else Console(width=150)  # logs keep whole table rows


def model_paths(args) -> tuple[str, str | None]:
    """(target, draft) as checkpoint directories. A built-in name or a cached hub id becomes
    its directory here, once: HF's `from_pretrained` and the roofline's `AutoConfig` would
    take `tiny-shakespeare` for a hub id."""
    from ladder.models import BUILTIN, BUILTIN_DRAFT, default_model, resolve_path

    model = (resolve_path(args.model) if args.model else default_model()).resolve()
    if args.draft_model:
        draft = resolve_path(args.draft_model).resolve()
    else:  # the built-in draft shares only the built-in target's vocabulary
        draft = BUILTIN_DRAFT.resolve() if model == BUILTIN.resolve() else None
    return str(model), (str(draft) if draft else None)


def run(args, console: Console) -> dict:
    from level0_naive.config import resolve_device, resolve_dtype

    torch.set_num_threads(args.threads)
    model, draft = model_paths(args)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    workloads = list(NAMES) if (args.all or (args.quick and not args.workload)) else (args.workload or ["spread"])
    num_requests = args.num_requests or (8 if args.quick else 128)
    hf_batch = args.hf_batch_size or args.kv_requests
    levels = available_levels()
    dims = roofline.Dims.from_checkpoint(model)
    bytes_per_token = dims.kv_bytes_per_token(dtype.itemsize)
    encode = tokenizer_encode(model)

    console.print(
        f"[bold]model[/] {model}  ({dims.params / 1e6:.1f}M matmul params, {dtype}, {device}); levels: {', '.join(levels)}; "
        f"{args.threads} torch thread(s); level 4 drafts with {draft or 'n-grams (no draft model with this vocabulary)'}"
    )
    with console.status("measuring the matmul roofline"):
        batches = [1, 16] if args.quick else [1, 4, 16, 64, 256, 1024]  # 1024: prefill chunks are that wide
        roof = roofline.measure(
            dims, dtype, device, batches, window=0.03 if args.quick else 0.25, repeats=3 if args.quick else 5
        )
        roof.update(bandwidth=roofline.kv_read_bandwidth(device=device), bytes_per_token=bytes_per_token,
                    weight_bandwidth=roofline.weight_bandwidth(dims.params * dtype.itemsize, device))  # fmt: skip
    console.print(
        "matmul rate: "
        + ", ".join(f"B={s['batch']}: {s['flops_per_s'] / 1e9:.1f}" for s in roof["sweep"])
        + f" GFLOP/s; memory read {roof['bandwidth'] / 1e9:.1f} GB/s ({roof['weight_bandwidth'] / 1e9:.1f} at the weights' size)"
    )

    common = dict(
        dtype=args.dtype, device=args.device, seed=args.seed, progress=not args.no_progress, draft_model=draft
    )
    data = {"schema": 1, "machine": machine_info(device), "roofline": roof, "workloads": {}}
    data["config"] = {
        "model": model, "model_name": Path(args.model or model).name, "dtype": str(dtype).removeprefix("torch."), "device": str(device),
        "quick": args.quick, "seed": args.seed, "num_requests": num_requests, "kv_requests": args.kv_requests,
        "hf_batch_size": hf_batch, "max_num_seqs": args.max_num_seqs, "repeats": args.repeats, "bytes_per_token": bytes_per_token,
        "threads": args.threads, "draft_model": draft,
        "command": " ".join(["python -m benchmarks.throughput", *args.argv]),
    }  # fmt: skip
    warmed: dict[str, object] = {}
    for wname in workloads:
        wl = make_workload(wname, num_requests, dims.vocab, seed=args.seed, quick=args.quick, encode=encode)
        kv_budget = args.kv_requests * wl.max_seq_len * bytes_per_token
        names = engine_names(args, wname, levels)
        console.rule(
            f"[bold]{wname}[/]: {wl.description}; {wl.num_requests} requests; KV budget {kv_budget / 2**20:.1f} MiB"
        )

        def new_engine(name: str, hf_batch_size: int | None = None, wl=wl, kv_budget=kv_budget):  # this workload's
            seqs = wl.max_num_seqs or args.max_num_seqs  # latency: everyone at batch 1
            engine = make_engine(name, model, kv_cache_memory=kv_budget, max_num_seqs=seqs,
                                 hf_batch_size=hf_batch_size or wl.max_num_seqs or hf_batch, **common)  # fmt: skip
            if name not in warmed:
                engine.warmup()
                warmed[name] = True
            return engine

        if wl.arrivals is not None:
            data["workloads"][wname] = run_arrivals(args, console, wl, names, new_engine, dims, roof, kv_budget)
            continue
        def run_once(name: str, rep: int, wl=wl) -> dict:  # (wl bound here: a closure in a loop)
            engine = new_engine(name)
            console.print(f"[cyan]{label(name)}[/] (run {rep + 1}/{args.repeats})")
            res = engine.run(wl)
            fig = report.summarise(res, dims, roof)
            console.print(f"  {fig['output_tokens_per_s']:.0f} output tok/s in {res.duration:.1f} s")
            return fig

        runs = repeated(names, args.repeats, run_once)
        results = {}
        for name in names:
            # Keep the fastest repeat: a neighbour's load only ever slows a run down, so the
            # fastest is the least disturbed (the reasoning of Python's `timeit`).
            results[name] = max(runs[name], key=lambda f: f["output_tokens_per_s"])
            results[name]["repeat_tokens_per_s"] = [f["output_tokens_per_s"] for f in runs[name]]
        report.add_ratios(results)
        data["workloads"][wname] = {"description": wl.description, "num_requests": wl.num_requests, "max_seq_len": wl.max_seq_len,
                                    "kv_cache_memory": kv_budget, "results": results}  # fmt: skip
        sweep = args.hf_sweep if args.hf_sweep is not None else ([4, 8] if args.quick else [8, 16, 32, 64, 128])
        if wname == "uniform" and sweep and "hf" in names:
            data["workloads"][wname]["hf_sweep"] = hf_sweep(console, wl, sweep, new_engine, dims, roof)
            levels_run = [n for n in results if n.startswith("level")]
            if levels_run:  # the best level again, given the memory HF's best batch takes
                best = max(levels_run, key=lambda n: results[n]["output_tokens_per_s"])
                data["workloads"][wname]["level_at_hf_best"] = level_at_hf_best(
                    console, wl, best, data["workloads"][wname]["hf_sweep"], bytes_per_token, new_engine, dims, roof
                )
        for table in report.rich_tables(wname, data["workloads"][wname]):
            console.print(table)
    data["goals"] = report.goals(data["workloads"])
    return data


def tokenizer_encode(model: str):
    """The checkpoint's tokenizer as text -> ids (for the natural-text prompts), or None without one."""
    try:
        from level0_naive.loader import load_tokenizer

        tok = load_tokenizer(Path(model))
    except Exception:  # noqa: BLE001 - a checkpoint without a tokenizer: random-id prompts everywhere
        return None
    return None if tok is None else tok.encode


def hf_sweep(console: Console, wl, batches: list[int], new_engine, dims, roof) -> list[dict]:
    """HF `generate` at each batch size, one run each: the strongest static-batching baseline."""
    out = []
    for b in batches:
        res = new_engine("hf", hf_batch_size=b).run(wl)
        fig = report.summarise(res, dims, roof)
        fig["batch_size"] = b
        out.append(fig)
        console.print(f"  HF at batch {b}: {fig['output_tokens_per_s']:.0f} output tok/s")
    return out


def level_at_hf_best(console: Console, wl, name: str, sweep: list[dict], bytes_per_token: int, new_engine, dims,
                     roof) -> dict:  # fmt: skip
    """`name` with the KV memory HF's fastest batch reserves (batch x the workload's longest request):
    HF at its best against the ladder, both given the same memory."""
    b = max(sweep, key=lambda f: f["output_tokens_per_s"])["batch_size"]
    budget = b * wl.max_seq_len * bytes_per_token
    fig = report.summarise(new_engine(name, kv_budget=budget).run(wl), dims, roof)
    fig.update(engine=name, batch_size=b, kv_cache_memory=budget)
    console.print(f"  {label(name)} with HF's batch-{b} memory ({budget / 2**20:.1f} MiB): "
                  f"{fig['output_tokens_per_s']:.0f} output tok/s")  # fmt: skip
    return fig


def repeated(names: list[str], repeats: int, run_once, first: int = 0) -> dict[str, list]:
    """Every engine `repeats` times, `run_once(name, rep)` each, the order reversed every other round
    (`first` shifts which round goes forward) so a drifting machine's slow minutes fall on each in turn."""
    runs: dict[str, list] = {n: [] for n in names}
    for rep in range(repeats):
        for name in names if (first + rep) % 2 == 0 else reversed(names):
            runs[name].append(run_once(name, rep))
    return runs


def run_arrivals(args, console: Console, wl, names: list[str], new_engine, dims, roof, kv_budget: int) -> dict:
    """The poisson workload: level 1's capacity first, then every engine at each rate."""
    from dataclasses import replace

    base = "level1_paged" if "level1_paged" in names else next((n for n in names if n != "hf"), names[0])
    offline = report.summarise(new_engine(base).run(replace(wl, arrivals=None)), dims, roof)
    capacity = offline["requests_per_s"]
    multiples = args.rate_multiples or ([0.5, 1.5] if args.quick else [0.25, 0.5, REFERENCE_MULTIPLE, 1.25, 1.5, 2.0])
    rates = [round(m * capacity, 3) for m in multiples]
    reference = min(rates, key=lambda r: abs(r - REFERENCE_MULTIPLE * capacity))
    console.print(f"{label(base)} capacity: {capacity:.2f} req/s with all {wl.num_requests} queued at once; "
                  f"rates {', '.join(f'{r:.2f}' for r in rates)} req/s")  # fmt: skip
    sweep: dict[str, list] = {n: [] for n in names}
    for i, rate in enumerate(rates):

        def run_once(name: str, rep: int, rate: float = rate) -> dict:  # (rate bound here, as above)
            fig = report.summarise(new_engine(name).run(wl, rate=rate), dims, roof)
            fig["request_rate"] = rate
            run = f" (run {rep + 1}/{args.repeats})" if args.repeats > 1 else ""
            console.print(f"  {label(name)} at {rate:.2f} req/s{run}: p99 TTFT {fig['ttft_s']['p99']:.2f} s, "
                          f"p99 e2e {fig['e2e_s']['p99']:.2f} s")  # fmt: skip
            return fig

        runs = repeated(names, args.repeats, run_once, first=i)
        for name in names:  # the least delayed repeat, as the offline workloads keep the fastest: the arrivals
            # are the same in every repeat, so a run's extra latency is what a neighbour's load added to it
            best = min(runs[name], key=lambda f: f["e2e_s"]["mean"])
            best["repeat_e2e_mean_s"] = [f["e2e_s"]["mean"] for f in runs[name]]
            best["repeat_ttft_mean_s"] = [f["ttft_s"]["mean"] for f in runs[name]]
            sweep[name].append(best)
    results = {n: next(f for f in sweep[n] if f["request_rate"] == reference) for n in names}
    report.add_ratios(results)
    return {"description": f"{wl.description}, at {reference:.2f} req/s ({REFERENCE_MULTIPLE}x {label(base)}'s capacity)",
            "num_requests": wl.num_requests, "max_seq_len": wl.max_seq_len, "kv_cache_memory": kv_budget,
            "capacity_rps": capacity, "capacity_engine": base, "rates": rates, "reference_rate": reference,
            "ttft_slo_s": args.ttft_slo, "sweep": sweep, "results": results}  # fmt: skip


def print_goals(console: Console, goals: list[dict], quick: bool) -> None:
    from rich.table import Table

    title = (
        "performance goals (a --quick smoke run: tiny workloads, so these figures say nothing)"
        if quick
        else "performance goals"
    )
    t = Table(title=title)
    for col in ("goal", "measured", "target", "met"):
        t.add_column(col)
    for g in goals:
        v = g["measured"]
        shown = "-" if v is None else (f"{100 * v:.1f} %" if "%" in g["target"] else f"{v:.2f}")
        met = "-" if g["met"] is None else ("[green]yes[/]" if g["met"] else "[red]no[/]")
        t.add_row(g["goal"], shown, g["target"], met)
    console.print(t)


def img_dir(args) -> Path:
    """`--img-dir`, else the output folder: only an explicit `--img-dir docs/img` rewrites the committed
    pictures, so a smoke run's plots never replace them."""
    return Path(args.img_dir) if args.img_dir else output_dir()


def main(argv=None) -> dict | None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    args.argv = argv
    if args.markdown:
        data = json.loads(Path(args.markdown).read_text())
        print(report.markdown(data))
        if args.readme:
            report.write_readme(data, README)
        return None
    if args.plots_from:
        from . import plots

        for path in plots.make_all(json.loads(Path(args.plots_from).read_text()), img_dir(args), args.img_prefix):
            print(path)
        return None
    console = make_console()
    data = run(args, console)
    print_goals(console, data["goals"], args.quick)
    out = Path(args.out or output_dir() / ("quick.json" if args.quick else "throughput.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    console.print(f"wrote {out}")
    if args.plots:
        from . import plots

        for path in plots.make_all(data, img_dir(args), args.img_prefix):
            console.print(f"wrote {path}")
    if args.readme:
        report.write_readme(data, README)
        console.print(f"wrote the results tables of {README}")
    return data


if __name__ == "__main__":
    main()
