"""A host-memory tier under a simulated GPU's KV pool: a multi-turn chat that overflows HBM.

What it is: `python -m benchmarks.sim.offload`. The `chat` trace (serve.py: conversations of up to
four turns, each turn's prompt the whole exchange so far, users pausing between turns) on one
simulated GPU with prefix caching, without and with a host tier below the pool (`HostTier`: the
offloading connector's bookkeeping, features/kv_connectors/offloading.py, without tensors): a
block the pool evicts is kept by name in host memory (bounded, least recently used first), and a
later turn whose history the pool lost loads it back instead of computing it. A load costs its
bytes over PCIe (`--pcie-gbps`) on the clock before the step that needs it; a save is free (a GPU
copies it out while it computes).

Reported: the share of prompt tokens found (in HBM, or in the tier), the prompt tokens computed,
mean and p90 time to first token, at a rate (`--rate`, conversations start at rate / 4 per second).

What it is not: a model of PCIe contention with other traffic, of pinned-memory limits, or of a
disk tier.
"""

from __future__ import annotations

import argparse
import statistics
from collections import OrderedDict

from features.kv_connectors.base import KVConnectorBase
from level3_prefix.block_hash import block_hashes, hash_block

from .clock import SimClock
from .cost import gpu
from .serve import make_engine, play, trace, user_params


class HostTier(KVConnectorBase):
    """Block names the pool evicted, kept in host memory (LRU, `capacity` blocks); a prefix that misses
    the pool and hits here is loaded, its bytes' time on `clock`."""

    def __init__(self, capacity: int, block_size: int, block_bytes: int, clock: SimClock, bytes_per_s: float):
        self.capacity, self.block_size, self.block_bytes = capacity, block_size, block_bytes
        self.clock, self.bytes_per_s = clock, bytes_per_s
        self.names: OrderedDict[bytes, None] = OrderedDict()
        self.hits = 0  # tokens

    def block_evicted(self, block) -> None:
        self.names[block.block_hash] = None
        self.names.move_to_end(block.block_hash)
        while len(self.names) > self.capacity:
            self.names.popitem(last=False)

    def get_num_new_matched_tokens(self, req, num_computed_tokens: int) -> int:
        bs, start, usable = self.block_size, num_computed_tokens // self.block_size, (req.num_tokens - 1) // self.block_size
        found = 0
        for name in block_hashes(req, usable, bs, hash_block)[start:]:
            if name not in self.names:
                break
            found += 1
        return found * bs

    def update_state_after_alloc(self, req, blocks: list, num_external_tokens: int) -> None:
        n, start = num_external_tokens // self.block_size, (req.num_computed_tokens - num_external_tokens) // self.block_size
        for name in block_hashes(req, start + n, self.block_size, hash_block)[start:]:
            if name in self.names:  # (the allocation may have pushed it out since the lookup)
                self.names.move_to_end(name)  # used: the last to go (the blocks are fresh, unnamed until their step)
        self.hits += num_external_tokens
        self.clock.advance(n * self.block_bytes / self.bytes_per_s)  # the copy in, before the step


def run(rate: float, model: str, gpu_name: str, host_gib: float, pcie_gbps: float, num: int, seed: int) -> dict:
    clock = SimClock()
    engine = make_engine("vllm-prefix", model, gpu(gpu_name), clock)
    tier = None
    if host_gib:
        bs = engine.config.cache.block_size
        block_bytes = bs * engine.bytes_per_token
        tier = HostTier(int(host_gib * (1 << 30)) // block_bytes, bs, block_bytes, clock, pcie_gbps * 1e9)
        engine.kv.connector, engine.kv.pool.on_evict = tier, tier.block_evicted
    seqs = play(engine, trace("chat", num, rate, seed), user_params(engine.max_model_len))
    prompt = sum(len(s.prompt_token_ids) for s in seqs)
    in_hbm = engine.kv.hits
    ttft = sorted(s.metrics.ttft for s in seqs)
    return {"host_gib": host_gib, "requests": len(seqs), "prompt_tokens": prompt,
            "found_in_hbm": in_hbm / prompt, "found_in_host": (tier.hits if tier else 0) / prompt,
            "computed": engine.stats.prompt_tokens, "ttft_mean": statistics.mean(ttft),
            "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))], "preemptions": engine.stats.preemptions}  # fmt: skip


def main(argv=None) -> list[dict]:
    from rich.console import Console
    from rich.table import Table

    from ladder.cli import LadderParser, nonneg_float, positive_float, positive_int

    p = LadderParser(prog="python -m benchmarks.sim.offload", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default="opt-13b", help="a shipped shape (benchmarks/sim/models)")
    p.add_argument("--gpu", default="a100-40gb", help="a GPU of benchmarks/sim/gpus.json")
    p.add_argument("--rate", type=positive_float, default=2.0, help="requests/s offered (conversations start at rate/4)")
    p.add_argument("--requests", type=positive_int, default=400, help="turns in the trace (conversations x 4)")
    p.add_argument("--host-gib", type=nonneg_float, default=64.0, help="the host tier's size (0: no tier)")
    p.add_argument("--pcie-gbps", type=positive_float, default=25.0, help="GB/s a load from host memory reaches")
    p.add_argument("--seed", type=int, default=0, help="the trace's seed")
    args = p.parse_args(argv)
    rows = [run(args.rate, args.model, args.gpu, gib, args.pcie_gbps, args.requests, args.seed)
            for gib in (0.0, args.host_gib)]  # fmt: skip
    table = Table("host tier", "prompt tokens found in HBM", "in the tier", "prompt tokens computed", "TTFT mean",
                  "TTFT p90", "preemptions",
                  title=f"chat on {args.model}, {args.gpu}, {args.rate:g} requests/s")  # fmt: skip
    for r in rows:
        table.add_row(f"{r['host_gib']:g} GiB", f"{100 * r['found_in_hbm']:.1f} %", f"{100 * r['found_in_host']:.1f} %",
                      f"{r['computed']:,}", f"{r['ttft_mean']:.3f} s", f"{r['ttft_p90']:.3f} s", str(r["preemptions"]))
    Console(width=130).print(table)
    return rows


if __name__ == "__main__":
    main()
