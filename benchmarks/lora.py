"""`python -m benchmarks.lora`: what mixing adapters in one batch buys, and what an adapter costs.

What it is: the issue's two ratios, side by side in one run on one engine (level 3, one torch
thread, the built-in model unless `--model`), with `--adapters` random PEFT adapters of rank
`--rank` on every projection (built once with `peft` into the cache folder; random weights: the
cost of an adapter does not depend on what it learned):

    mixed          every request at once, requests spread evenly over the adapters: one batch,
                   each row on its own adapter (`max_loras` = the number of adapters)
    one at a time  the same requests, each adapter's as a batch of its own, one after another, on
                   an engine with one slot (`max_loras=1`): what serving without multi-LoRA does
    base           the same requests on the base model alone (an engine without LoRA)
    base one at a time   the base model on the one-at-a-time batches: base / this is what batching
                   alone buys, what mixing would make if adapters cost nothing (per row they cost a small batch more)

Output tokens/s, best of `--repeats`, each request exactly `--max-tokens` tokens; and each repeat's own
two ratios (its runs side by side), whose spread says how far a best-of figure can be trusted.

The LoRA engines run the default delta ("auto": on a CPU the compiled loop, features/lora/cpu_ops.py,
where it builds). `--paths auto,stacked` runs both LoRA layouts once per path in every repeat (the
same engines, their path switched), so the paths compare side by side; the headline ratios are the
first path's.

What it is not: a GPU figure (there the kernels would be Triton's, triton_ops.py, never run yet).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time

import torch

from ladder.cli import LadderParser, cache_dir, positive_int, save_result, torch_threads
from ladder.models import resolve_path


def make_adapters(base: str, n: int, rank: int) -> list[str]:
    """n random rank-`rank` adapters on every projection of `base` (built once, kept in the cache folder)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(n):
        out = cache_dir() / "lora-bench" / f"{hashlib.sha256(base.encode()).hexdigest()[:12]}-r{rank}-{i}"
        if not (out / "adapter_model.safetensors").is_file():
            torch.manual_seed(i)
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
            peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                    init_lora_weights=False))  # fmt: skip
            peft.save_pretrained(out)
        paths.append(str(out))
    return paths


def tokens_per_s(llm, prompts, params, loras, one_at_a_time: bool, adapters: bool = True) -> float:
    """`adapters=False`: the same batches on the base model (the engine has no LoRA): what batching alone buys."""
    t0 = time.perf_counter()
    if one_at_a_time:
        done = 0
        for lora in dict.fromkeys(loras):  # each adapter's requests as a batch of their own
            mine, ask = [p for p, q in zip(prompts, loras) if q == lora], lora if adapters else None
            done += sum(len(o.outputs[0].token_ids) for o in llm.generate(mine, params, lora_request=ask, progress=False))
    else:
        done = sum(len(o.outputs[0].token_ids) for o in llm.generate(prompts, params, lora_request=loras, progress=False))
    return done / (time.perf_counter() - t0)


def main(argv=None) -> dict:
    from rich.console import Console

    import level3_prefix
    from level0_naive import SamplingParams
    from level0_naive.loader import load_metadata
    from level3_prefix import LoRARequest

    p = LadderParser(prog="python -m benchmarks.lora", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default="tiny-shakespeare", help="the base model")
    p.add_argument("--adapters", type=positive_int, default=8, help="how many adapters (default 8)")
    p.add_argument("--rank", type=positive_int, default=8, help="each adapter's rank (default 8)")
    p.add_argument("--requests", type=positive_int, default=64, help="requests, spread evenly (default 64)")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="tokens per request (default 64)")
    p.add_argument("--repeats", type=positive_int, default=2, help="runs of each, the best kept (default 2)")
    p.add_argument("--paths", default="auto", help="the LoRA engines' delta paths, comma-separated (default auto; "
                   "features/lora/slots.py's DELTAS; the first gives the headline ratios)")
    p.add_argument("--out", default=None, help="where the JSON goes (default: the output folder)")
    args = p.parse_args(argv)
    base = str(resolve_path(args.model))
    adapters = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(make_adapters(base, args.adapters, args.rank))]
    rng = random.Random(0)
    vocab = load_metadata(base).config.vocab_size
    prompts = [[rng.randrange(3, min(250, vocab)) for _ in range(32)] for _ in range(args.requests)]
    loras = [adapters[i % len(adapters)] for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, min_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    settings = dict(dtype="float32", enforce_eager=True, max_num_seqs=args.requests, enable_prefix_caching=False)
    with torch_threads(1):
        lora_llm = level3_prefix.LLM(base, enable_lora=True, max_loras=len(adapters), max_lora_rank=args.rank, **settings)
        one_llm = level3_prefix.LLM(base, enable_lora=True, max_loras=1, max_lora_rank=args.rank,
                                    max_cpu_loras=len(adapters), **settings)  # fmt: skip
        base_llm = level3_prefix.LLM(base, **settings)
        paths, names = args.paths.split(","), {}
        for path in paths:  # refused here, in one line, not after the first runs; "auto" named by what it chose
            lora_llm.llm_engine.lora.path = one_llm.llm_engine.lora.path = path
            names[path] = path if path != "auto" else f"auto ({lora_llm.llm_engine.lora.path})"
        runs, by_path = [], {path: [] for path in paths}
        for _ in range(args.repeats):  # alternating, so a busy moment hurts each layout alike
            for path in paths:
                lora_llm.llm_engine.lora.path = one_llm.llm_engine.lora.path = path
                by_path[path].append({"mixed": tokens_per_s(lora_llm, prompts, params, loras, False),
                                      "one_at_a_time": tokens_per_s(one_llm, prompts, params, loras, True)})  # fmt: skip
            runs.append({**by_path[paths[0]][-1], "base": tokens_per_s(base_llm, prompts, params, [None] * len(prompts), False),
                         "base_one_at_a_time": tokens_per_s(base_llm, prompts, params, loras, True, adapters=False)})
    best = {k: max(r[k] for r in runs) for k in runs[0]}
    pairs = [(r["mixed"] / r["one_at_a_time"], r["mixed"] / r["base"]) for r in runs]  # each repeat's own ratios
    result = {"args": vars(args), "tokens_per_s": best, "mixed_over_one_at_a_time": best["mixed"] / best["one_at_a_time"],
              "lora_over_base": best["mixed"] / best["base"], "runs": runs,
              "base_batching": best["base"] / best["base_one_at_a_time"],  # mixing's ratio if adapters cost nothing
              "per_repeat": {"mixed_over_one_at_a_time": [a for a, _ in pairs], "lora_over_base": [b for _, b in pairs]},
              "by_path": {names[p]: {k: max(r[k] for r in rs) for k in rs[0]} for p, rs in by_path.items()}}  # fmt: skip
    Console().print(f"{args.requests} requests x {args.max_tokens} tokens over {len(adapters)} adapters of rank "
                    f"{args.rank} ({args.model}, one thread, the {names[paths[0]]} path): mixed {best['mixed']:.0f} tok/s, "
                    f"one adapter at a time "
                    f"{best['one_at_a_time']:.0f} ({result['mixed_over_one_at_a_time']:.2f}x), base model "
                    f"{best['base']:.0f} (LoRA costs: {result['lora_over_base']:.2f}x); each repeat's own ratios: "
                    f"{min(a for a, _ in pairs):.2f}-{max(a for a, _ in pairs):.2f}x and "
                    f"{min(b for _, b in pairs):.2f}-{max(b for _, b in pairs):.2f}x")  # fmt: skip
    Console().print(f"the base model, the same batches one after another: {best['base_one_at_a_time']:.0f} tok/s, so batching "
                    f"alone buys {result['base_batching']:.2f}x (what mixing would make if adapters cost nothing)")
    if len(paths) > 1:
        Console().print("mixed / one adapter at a time, tok/s (best of each), by path: " + "; ".join(
            f"{name} {r['mixed']:.0f} / {r['one_at_a_time']:.0f}" for name, r in result["by_path"].items()))  # fmt: skip
    save_result(result, args.out, "lora.json")
    return result


if __name__ == "__main__":
    main()
