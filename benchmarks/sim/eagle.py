"""`python -m benchmarks.sim.eagle`: what an EAGLE head would buy a batch-1 decode on a GPU, beside a draft model.

What it is: level 4's engine on the modelled clock (benchmarks/sim/engines.py's `SimulatedSpeculative`),
one request at a time (128 prompt tokens, 256 greedy output tokens), a Llama-2-7B target in bf16 on an
A100 and an H100, three ways:

    target alone      level 4 without speculation
    draft model       a 68M-parameter Llama (2 layers of 768: JackFram/llama-68m's shape, the draft vLLM's
                      examples pair with 7B Llamas), its own KV cache, k passes of its 2 layers per step
    EAGLE head        one decoder layer of the target's own shape plus the target's LM head (the head's fc
                      over [embedding; feature] is 2H x H more, 1 % of it: left out), its own one-layer cache

each with k = 1..5 guesses. A guess at position j is accepted with the probability measured on the
built-in pair (models/README.md): the head's per-position acceptance [0.826, 0.798, 0.808, 0.808, 0.796]
(models/train_eagle.py `acceptance`), and the draft model's per-token agreement with the target on its
greedy text, 0.783 at every position. That they carry over to a 7B target is the assumption (EAGLE's
paper reports 0.7-0.8 per position on 7-13B chat models; a 68M draft of a 7B target agrees less than
the built-in draft does with its target). Reported: tokens/s on the modelled clock, the speed-up over the
target alone, the mean tokens a step makes, and the speed-up Leviathan et al.'s formula predicts from
the mean tokens a step and the draft's cost c (a draft pass over a target pass):
speed-up = E[tokens] / (k c + 1).

What it is not: a measurement (no GPU has run level 4 here; the engine's EAGLE, level4_speculative/eagle.py,
is measured on this CPU in docs/level4_speculative.md).

Reference: Li et al., "EAGLE" (ICML 2024); Leviathan et al., "Fast Inference from Transformers via
Speculative Decoding" (ICML 2023).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from level0_naive import SamplingParams

from .clock import SimClock
from .cost import ModelShape, gpu, model_shape, step_time
from .engines import SimulatedContinuous, SimulatedSpeculative

EAGLE_ALPHA = [0.826, 0.798, 0.808, 0.808, 0.796]  # models/README.md, the head's acceptance by draft position
DRAFT_ALPHA = 0.783  # models/README.md, the draft model's agreement with the target on its greedy text
LLAMA_68M = ModelShape(name="llama-68m", num_layers=2, hidden=768, num_heads=12, num_kv_heads=12, head_dim=64,
                       intermediate=3072, vocab=32000, max_len=2048, gated_mlp=True, eos_token_id=2)  # fmt: skip


def eagle_shape(target: ModelShape) -> ModelShape:
    """The head as the cost model sees it: one layer of the target's shape, the target's (untied) LM head."""
    return replace(target, name="eagle head", num_layers=1)


def run_one(target: str, gpu_name: str, draft: ModelShape | None, alpha, k: int, prompt: int,
            output: int) -> tuple[float, float]:  # fmt: skip
    """(output tokens per second of the modelled clock, mean tokens a step) for one request, alone."""
    clock = SimClock()
    common = dict(hardware=gpu(gpu_name), clock=clock, kv_cache_memory=8 << 30)
    if draft is None:
        e = SimulatedContinuous(target, **common)
    else:
        e = SimulatedSpeculative(target, num_speculative_tokens=k, alpha=alpha, draft_shape=draft, seed=0, **common)
    e.targets["r"] = output
    e.add_request("r", list(range(5, 5 + prompt)), SamplingParams(max_tokens=output, temperature=0.0))
    while e.has_unfinished_requests():
        e.step()
    stats = getattr(e, "spec_stats", None)
    return output / clock.now, (stats.mean_acceptance_length if stats is not None else 1.0)


def pass_cost(gpu_name: str, shape: ModelShape, target: ModelShape) -> float:
    """c: one decode pass of `shape` at batch 1 over one of the target, on the cost model (context 256)."""
    hw = gpu(gpu_name)
    return step_time(hw, shape, [(256, 1)], 1, 1, 1) / step_time(hw, target, [(256, 1)], 1, 1, 1)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sim.eagle", description=__doc__.splitlines()[0])
    p.add_argument("--target", default="llama-2-7b")
    p.add_argument("--gpus", nargs="+", default=["a100-80gb", "h100-80gb"])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", type=int, default=256)
    args = p.parse_args(argv)
    target = model_shape(args.target)
    rows = []
    for g in args.gpus:
        alone, _ = run_one(args.target, g, None, None, 0, args.prompt, args.output)
        print(f"\n{args.target} on {g}, batch 1: the target alone {alone:.1f} tok/s")
        print(f"{'proposer':>12} {'k':>2} {'tok/s':>7} {'x alone':>8} {'tokens/step':>12} {'c':>6} {'formula':>8}")
        for name, draft, alpha in (("draft model", LLAMA_68M, DRAFT_ALPHA), ("EAGLE head", eagle_shape(target), EAGLE_ALPHA)):
            c = pass_cost(g, draft, target)
            for k in range(1, 6):
                tps, mean = run_one(args.target, g, draft, alpha, k, args.prompt, args.output)
                alphas = [alpha] * k if isinstance(alpha, float) else alpha[:k]
                expected, run = 1.0, 1.0
                for a in alphas:  # E[tokens a step] = 1 + a1 + a1 a2 + ...
                    run *= a
                    expected += run
                row = {"gpu": g, "proposer": name, "k": k, "tokens_per_s": tps, "speedup": tps / alone,
                       "tokens_per_step": mean, "draft_cost": c, "formula": expected / (k * c + 1)}  # fmt: skip
                rows.append(row)
                print(f"{name:>12} {k:>2} {tps:>7.1f} {tps / alone:>7.2f}x {mean:>12.2f} {c:>6.3f} {row['formula']:>7.2f}x")
    return rows


if __name__ == "__main__":
    main()
