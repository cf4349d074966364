"""`python -m benchmarks.quantization`: what 8- and 4-bit weights buy a decode at batch 1, and what an 8-bit KV
cache buys a batch.

What it is: the `latency` workload (one request at a time, every step a batch of one, natural-text
prompts with the model's tokenizer) on level 3 with the model in float32, and the same engine with
`quantization="int8"` and `"int4"` (features/quantization), side by side in one process, in
alternating order across `--repeats`, each keeping its fastest run. Two models:

    100m    a random-weight ~100M-parameter Llama (benchmarks/make_model.py, built once into the cache
            folder): 400 MB of float32 projections, far more than the CPU's caches, so each decode step
            reads every weight from memory, and reading a quarter (int8) or an eighth (int4) of the
            bytes is what the step saves
    tiny    the built-in 6M model: its 24 MB of weights mostly sit in the caches, the step is mostly
            Python and small ops, and the saving is small

Reported: output tokens/s each, the ratios to float32, and which matmul ran (the packed kernel
for how many projections; formats.py says why a shape would fall back to the reference).

`--kv` (the built-in model): the `spread` workload on level 3 with one KV budget for all three caches,
float32, fp8 and int8 (`kv_cache_dtype`), and that for each budget of `--kv-requests` (2, 4 and 8 of
spread's longest requests in float32): the same bytes hold about 4x the tokens in 8 bits, so more
requests run at once, which pays as long as memory was what limited the batch. Reported per budget:
tokens/s, the blocks each pool has, the mean batch, preemptions, the KV waste (the share of the blocks'
bytes, summed over the steps, that held no token: the last block's unfilled slots and, in 8 bits, the
scales are not counted as waste), and the ratios to float32.

What it is not: an accuracy figure (`python -m benchmarks.quality`), or a GPU's (on a GPU this
room runs its reference: no GPU kernel is built).
"""

from __future__ import annotations

import argparse
import time

from ladder.cli import LadderParser, cache_dir, positive_int, save_result, torch_threads
from ladder.models import resolve_path

SETTINGS = (None, "int8", "int4")


def model_100m() -> str:
    from .make_model import build

    path = cache_dir() / "llama-100m"
    if not (path / "config.json").is_file():
        print(f"building a ~100M-parameter random Llama in {path} (once)", flush=True)
        build(path)
    return str(path)


def kernels(llm) -> dict:
    """How many quantized projections run the packed kernel, of how many, and the bytes they hold."""
    from features.quantization import Int4Weight, Int8Weight, quantized_bytes

    model = llm.llm_engine.loaded.model
    ws = [m.weight for m in model.modules() if isinstance(getattr(m, "weight", None), (Int8Weight, Int4Weight))]
    held, rest = quantized_bytes(model)  # the quantized projections'; the float parameters left
    return {"projections": len(ws), "packed_kernel": sum(w.kernel for w in ws), "quantized_bytes": held,
            "float_bytes": rest}  # fmt: skip


def run_model(path: str, requests: int, repeats: int, quick: bool) -> dict:
    import level3_prefix
    from level0_naive import SamplingParams

    from .workloads import make_workload

    engines = {q: level3_prefix.LLM(path, dtype="float32", quantization=q, max_num_seqs=1, enforce_eager=True)
               for q in SETTINGS}  # fmt: skip
    tok = engines[None].llm_engine.tokenizer
    work = make_workload("latency", requests, engines[None].llm_engine.model_config.vocab_size, quick=quick,
                         encode=(lambda s: tok.encode(s)) if tok is not None else None)  # fmt: skip
    prompts = [r.prompt for r in work.first]
    params = [SamplingParams(max_tokens=r.max_tokens, min_tokens=r.max_tokens, temperature=0, ignore_eos=True)
              for r in work.first]  # fmt: skip
    best = dict.fromkeys(engines, 0.0)
    for llm in engines.values():  # warm up
        llm.generate(prompts[:1], SamplingParams(max_tokens=4), progress=False)
    for _ in range(repeats):
        for q, llm in engines.items():
            t0 = time.perf_counter()
            n = sum(len(o.outputs[0].token_ids) for o in llm.generate(prompts, params, progress=False))
            best[q] = max(best[q], n / (time.perf_counter() - t0))
    return {"workload": work.description, "tokens_per_s": {str(q): v for q, v in best.items()},
            "over_float32": {q: best[q] / best[None] for q in SETTINGS[1:]},
            "kernels": {q: kernels(engines[q]) for q in SETTINGS[1:]}}  # fmt: skip


def run_kv(path: str, requests: int, kv_requests: int, repeats: int, quick: bool) -> dict:
    import level3_prefix
    from level0_naive import SamplingParams

    from .workloads import make_workload

    probe = level3_prefix.LLM(path, dtype="float32", enforce_eager=True)
    work = make_workload("spread", requests, probe.llm_engine.model_config.vocab_size, quick=quick)
    longest = max(len(r.prompt) + r.max_tokens for r in work.first)
    budget = kv_requests * longest * probe.llm_engine.bytes_per_token  # float32's bytes for kv_requests of them
    del probe
    engines = {dt: level3_prefix.LLM(path, dtype="float32", enforce_eager=True, kv_cache_memory=budget,
                                     kv_cache_dtype=dt, max_num_seqs=requests, enable_prefix_caching=False)
               for dt in ("auto", "fp8", "int8")}  # fmt: skip
    prompts = [r.prompt for r in work.first]
    params = [SamplingParams(max_tokens=r.max_tokens, min_tokens=r.max_tokens, temperature=0, ignore_eos=True)
              for r in work.first]  # fmt: skip
    best, shape = dict.fromkeys(engines, 0.0), {}
    for _ in range(repeats):
        for dt, llm in engines.items():
            e = llm.llm_engine
            e.step_log.clear()
            preempted, used, reserved = e.stats.preemptions, e.stats.kv_used_sum, e.stats.kv_reserved_sum
            t0 = time.perf_counter()
            n = sum(len(o.outputs[0].token_ids) for o in llm.generate(prompts, params, progress=False))
            best[dt] = max(best[dt], n / (time.perf_counter() - t0))
            batches = [len(r.request_ids) for r in e.step_log]
            held = e.stats.kv_reserved_sum - reserved  # this run's blocks' bytes, summed over its steps
            shape[dt] = {"blocks": e.num_blocks, "mean_batch": sum(batches) / len(batches),
                         "preemptions": e.stats.preemptions - preempted,
                         "kv_waste": 1 - (e.stats.kv_used_sum - used) / held if held else 0.0}  # fmt: skip
    return {"workload": work.description, "kv_cache_memory": budget, "tokens_per_s": best,
            "over_float32": {dt: best[dt] / best["auto"] for dt in ("fp8", "int8")}, "pools": shape}  # fmt: skip


def main(argv=None) -> dict:
    from rich.console import Console

    p = LadderParser(prog="python -m benchmarks.quantization", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--models", nargs="+", default=["100m", "tiny"], help="100m, tiny, or checkpoint paths")
    p.add_argument("--requests", type=positive_int, default=4, help="latency requests (default 4)")
    p.add_argument("--repeats", type=positive_int, default=2, help="runs of each, the best kept (default 2)")
    p.add_argument("--quick", action="store_true", help="short requests (a smoke run)")
    p.add_argument("--kv", action="store_true", help="also the 8-bit KV cache on `spread` (the built-in model)")
    p.add_argument("--kv-requests", type=positive_int, nargs="+", default=[2, 4, 8],
                   help="--kv: budgets, each holding this many of spread's longest requests in float32 (2 4 8)")
    p.add_argument("--spread-requests", type=positive_int, default=32, help="--kv: spread's requests (32)")
    p.add_argument("--out", default=None, help="where the JSON goes (default: the output folder)")
    args = p.parse_args(argv)
    result, console = {"args": vars(args), "models": {}}, Console()
    with torch_threads(1):
        for name in args.models:
            path = model_100m() if name == "100m" else str(resolve_path("tiny-shakespeare" if name == "tiny" else name))
            r = result["models"][name] = run_model(path, args.requests, args.repeats, args.quick)
            t = r["tokens_per_s"]
            console.print(f"{name} ({r['workload']}, batch 1, one thread): float32 {t['None']:.1f} tok/s, "
                          + ", ".join(f"{q} {t[q]:.1f} ({r['over_float32'][q]:.2f}x; packed kernel in "
                                      f"{r['kernels'][q]['packed_kernel']}/{r['kernels'][q]['projections']} projections)"
                                      for q in SETTINGS[1:]))  # fmt: skip
        for kv_requests in args.kv_requests if args.kv else ():
            r = run_kv(str(resolve_path("tiny-shakespeare")), args.spread_requests, kv_requests, args.repeats,
                       args.quick)  # fmt: skip
            result.setdefault("kv", {})[kv_requests] = r
            console.print(f"KV cache, tiny-shakespeare, {r['workload']}, {r['kv_cache_memory']:,} bytes for every "
                          f"pool ({kv_requests} of its longest requests in float32): "
                          + ", ".join(f"{dt} {r['tokens_per_s'][dt]:.0f} tok/s ({r['pools'][dt]['blocks']} blocks, "
                                      f"mean batch {r['pools'][dt]['mean_batch']:.1f}, "
                                      f"{r['pools'][dt]['preemptions']} preemptions, "
                                      f"KV waste {r['pools'][dt]['kv_waste']:.1%})" for dt in r["pools"])
                          + f"; fp8 {r['over_float32']['fp8']:.2f}x, int8 {r['over_float32']['int8']:.2f}x float32")  # fmt: skip
    save_result(result, args.out, "quantization.json")
    return result


if __name__ == "__main__":
    main()
