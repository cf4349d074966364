"""`python -m features.kv_connectors.demo`: a chat that outgrows the device pool, with and without a host tier.

    python -m features.kv_connectors.demo                  # 32 conversations x 4 turns (a minute or two)
    python -m features.kv_connectors.demo --quick          # 8 x 2, a small model's worth (seconds)
    python -m features.kv_connectors.demo --host-blocks 16 # a host tier of 16 blocks instead of plenty

What it is: the harness's `chat` workload (benchmarks/workloads.py: each turn's prompt is the
whole conversation so far plus the user's new words) played on two level-3 engines with the same
small device pool (`--kv-requests` of its longest requests, 4 by default), one alone and one with
the offloading connector's host tier below the pool (docs/kv_connectors.md). Printed for each:
the prompt tokens it computed (and what share of the prompts' tokens that is), the prefix hits
from the pool and from the tier, the bytes the tier saved and loaded, and the time the whole play
took; then whether the two gave the same tokens (greedy: they must).

What it is not: the benchmark (`benchmarks.throughput --workload chat --engines
level3_prefix,level3_prefix:offload --kv-requests 4` measures the same with TTFT and repeats). The
lab's experiment runs it (lab 3c).
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.workloads import make_workload
from ladder.models import default_model
from level0_naive import SamplingParams
from level0_naive.kv_cache import kv_bytes_per_token
from level0_naive.loader import load_metadata
from level1_paged.block_table import blocks_for
from level3_prefix import LLM


def play(llm, workload) -> tuple[list[list[int]], int, float]:
    """Every turn of every conversation (a turn's requests at once); (each request's tokens, the
    prompts' tokens, seconds)."""
    outputs, prompt_tokens = [], []

    def run_round(requests):
        prompt_tokens.extend(len(r.prompt) for r in requests)
        params = [SamplingParams(max_tokens=r.max_tokens, min_tokens=r.max_tokens, temperature=0, ignore_eos=True)
                  for r in requests]  # fmt: skip
        answers = [o.outputs[0].token_ids for o in llm.generate([r.prompt for r in requests], params, progress=False)]
        outputs.extend(answers)
        return answers

    t0 = time.perf_counter()
    workload.play(run_round)
    return outputs, sum(prompt_tokens), time.perf_counter() - t0


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m features.kv_connectors.demo", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the built-in tiny Shakespeare model)")
    p.add_argument("--quick", action="store_true", help="8 conversations of 2 short turns")
    p.add_argument("--kv-requests", type=int, default=4, help="the pool holds this many of the longest requests")
    p.add_argument("--host-blocks", type=int, default=None, help="the host tier's size in blocks (default: plenty)")
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model = args.model or str(default_model())
    config = load_metadata(model).config
    workload = make_workload("chat", 16 if args.quick else 128, config.vocab_size, seed=0, quick=args.quick)
    longest = max(len(r.prompt) + r.max_tokens for r in workload.first) * (2 if args.quick else 4)  # its last turn, about
    per_token = kv_bytes_per_token(config, torch.float32)  # what the engines' float32 cache takes a token
    pool = args.kv_requests * blocks_for(longest, args.block_size) * args.block_size * per_token
    block_bytes = args.block_size * per_token
    host = (args.host_blocks or 100_000) * block_bytes
    kw = dict(dtype="float32", max_model_len=-1, block_size=args.block_size, kv_cache_memory=pool, seed=0)
    print(f"chat: {len(workload.first)} conversations x {1 + len(workload.follow_ups)} turns; a device pool of "
          f"{pool / 2**20:.1f} MiB ({pool // block_bytes} blocks of {args.block_size} tokens)")  # fmt: skip
    rows, tokens = {}, {}
    for name, extra in [("pool alone", {}),
                        ("pool + host tier", {"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                                                                     "kv_connector_extra_config": {"cpu_bytes_to_use": host}}})]:  # fmt: skip
        llm = LLM(model, **kw, **extra)
        tokens[name], prompts, seconds = play(llm, workload)
        engine, stats = llm.llm_engine, llm.prefix_stats()
        tier = engine.kv_connector_stats()
        rows[name] = dict(computed=engine.stats.prompt_tokens, pool_hits=stats["prefix_cache_hits"],
                          tier_hits=tier.get("hits_host_tokens", 0), saved=tier.get("bytes_saved", 0),
                          loaded=tier.get("bytes_loaded", 0), tier_blocks=tier.get("host_blocks", 0),
                          seconds=seconds)  # fmt: skip
    print(f"the prompts hold {prompts:,} tokens in all")
    print(f"{'':18} {'prompt tokens computed':>24} {'pool hits':>10} {'tier hits':>10} {'saved MB':>9} "
          f"{'loaded MB':>10} {'tier blocks':>12} {'seconds':>8}")  # fmt: skip
    for name, r in rows.items():
        print(f"{name:18} {r['computed']:>24,} {r['pool_hits']:>10,} {r['tier_hits']:>10,} {r['saved'] / 1e6:>9.1f} "
              f"{r['loaded'] / 1e6:>10.1f} {r['tier_blocks']:>12,} {r['seconds']:>8.2f}")  # fmt: skip
    same = tokens["pool alone"] == tokens["pool + host tier"]
    print(f"the same tokens both ways: {same}")
    return {"rows": rows, "same_tokens": same, "prompt_tokens": prompts}


if __name__ == "__main__":
    main()
