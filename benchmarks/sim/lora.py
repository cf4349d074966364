"""Many LoRA adapters on one simulated GPU: S-LoRA's throughput against the number of adapters, in shape.

What it is: `python -m benchmarks.sim.lora`. S-LoRA's synthetic workload (its artifact's
`benchmarks/trace.py`) on Llama-2-7B and one A100-80GB: requests at 10 per second for 120 s
(Poisson), prompt and output lengths uniform in [8, 512), each request's adapter drawn from n
adapters by numpy's power law with alpha = 1, which is uniform (`--alpha` below 1 favours the
first adapters), adapters of rank 8 on q, k, v and o (S-LoRA's setting S1; `--ranks 64,32,16,8`
cycles four ranks over the adapters: S2). Served by the ladder's level 2 engine with
`enable_lora=True` on the modelled clock (`SimulatedLoRA`): the real Scheduler, its admission rule
the LoRA room's own (`LoRAManager.admits`: the running requests' distinct adapters and the
newcomer's at most `max_loras`), each step's adapters in slots (`SimSlots`, the manager's
bookkeeping without tensors: an adapter not in a slot is copied in from host memory at PCIe's rate
before the step, over the least recently used slot the step does not need), and each step's cost
with its LoRA term (lora_cost.py: the shrink and expand, each distinct adapter's A and B read once).

Reported per number of adapters n: throughput as S-LoRA counts it (requests / the time from the
start to the last one's end) at the offered rate and saturated (every request at once: the GPU's
capacity), with max_loras = `--max-loras` (256, the batch's limit: every running request may have
its own adapter, as S-LoRA's unified pool allows), beside S-LoRA's published numbers for the
setting; one adapter at a time (max_loras = 1: the head of the queue waits until no other adapter
runs) on the first `--baseline-requests` of the trace; the base model alone (n = 0), the ceiling.
The slots take their bytes from the KV cache by vLLM's rule, min(max_loras, n) slots each of the
largest rank (S-LoRA's unified pool charges only the running batch's adapters, each at its own rank:
the same at S1's one rank, far less than this at S2's mixed ranks).

Published (S-LoRA's artifact, github.com/S-LoRA/S-LoRA, `benchmarks/paper/`: the "a100-80-table"
suite behind Table 3, huggyllama/llama-7b, A100-80GB, rate 10, 120 s): S-LoRA S1 8.05, 7.99, 7.64,
7.61 req/s at 5, 100, 1000, 2000 adapters (`synthetic/slora/..._S1_slora_table.jsonl`); S2 7.48,
7.29, 6.69, 6.73; HF PEFT S1 0.88 and 0.25 at 5 and 100 (`peft/num_adapter_a100-80_S1_peft_fig3.jsonl`),
S2 0.87 and 0.24; vLLM-packed (one vLLM process per adapter) S2 2.04 at 5 (`synthetic/vllm/`).

What it is not: S-LoRA's scheduler (its router, LightLLM's, admits a request only if every running
request's whole remaining output still fits the pool, so it never preempts; this is vLLM's, which
admits on the next block and preempts by recompute), its prefetching of adapters, or a model of the
LoRA kernels' launches beyond the step's fixed overhead (docs/what_if.md).

Reference: Sheng et al., "S-LoRA: Serving Thousands of Concurrent LoRA Adapters" (MLSys 2024),
its evaluation's Table 3 and artifact; Chen et al., "Punica" (MLSys 2024).
"""

from __future__ import annotations

import argparse
import math
import random
from collections import OrderedDict

from features.lora.manager import LoRAManager
from features.lora.request import LoRAConfig

from .clock import SimClock, SimStep
from .cost import gpu, kv_budget, model_shape
from .engines import SimulatedContinuous
from .lora_cost import ATTENTION, SimAdapter, adapter_bytes
from .serve import SimRequest, play, user_params

S1, S2 = (8,), (64, 32, 16, 8)  # S-LoRA's settings on Llama-7B: the adapters' ranks, cycled over the adapters
SLORA = {S1: {5: 8.05, 100: 7.99, 1000: 7.64, 2000: 7.61}, S2: {5: 7.48, 100: 7.29, 1000: 6.69, 2000: 6.73}}
PEFT = {S1: {5: 0.88, 100: 0.25}, S2: {5: 0.87, 100: 0.24}}
VLLM_PACKED = {S2: {5: 2.04}}  # beyond 5 adapters: out of memory (the artifact has no S1 run)


def slora_trace(num_adapters: int, num: int, rate: float, ranks=S1, alpha: float = 1.0, cv: float = 1.0,
                lengths: tuple[int, int] = (8, 512), vocab: int = 32000, seed: int = 0) -> list[SimRequest]:  # fmt: skip
    """S-LoRA's `generate_requests`: `num` requests, gaps gamma-distributed with mean 1 / rate and coefficient
    of variation cv (1: Poisson); prompt and output lengths uniform in [lo, hi); adapter int(n * u ** (1 / alpha))
    for u uniform (numpy's `power(alpha)`), adapter i of rank ranks[i % len(ranks)] on q, k, v and o.
    num_adapters = 0: every request on the base model."""
    rng, t, reqs = random.Random(seed), 0.0, []
    adapters = [SimAdapter(i + 1, ranks[i % len(ranks)], ATTENTION) for i in range(num_adapters)]
    for _ in range(num):
        t += rng.gammavariate(1 / cv**2, cv**2 / rate) if rate != math.inf else 0.0  # (inf: all at once)
        which = min(int(num_adapters * rng.random() ** (1 / alpha)), num_adapters - 1)
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(*lengths))]
        reqs.append(SimRequest(t, prompt, rng.randrange(*lengths), lora_request=adapters[which] if adapters else None))
    return reqs


class SimSlots:
    """The LoRA manager (features/lora/manager.py) without tensors: `max_loras` slots, the room's admission
    rule, and each step's adapters put in slots by the manager's own placement, a load costing its bytes
    over PCIe on the clock."""

    # the room's own rule and placement, read from `self.config.max_loras` and `self.slot_of`: one of each, not two
    admits, place, _free_slot = LoRAManager.admits, LoRAManager.place, LoRAManager._free_slot

    def __init__(self, config: LoRAConfig, shape, clock: SimClock, pcie_bytes_per_s: float):
        self.config, self.shape, self.clock, self.pcie_bytes_per_s = config, shape, clock, pcie_bytes_per_s
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> its slot, least recently used first
        self.loads, self.load_seconds = 0, 0.0
        self.distinct: list[int] = []  # adapters per step that ran any

    def prepare(self, group: list, i: int) -> None:
        """A request's preparer: its adapter checked when it is added (the manager reads and checks the file)."""
        a = group[0].lora_request
        if a is not None and not isinstance(a, SimAdapter):
            raise ValueError(f"lora_request for prompt {i}: the simulator takes a SimAdapter, not {type(a).__name__}")
        if a is not None and a.rank > self.config.max_lora_rank:
            raise ValueError(f"adapter {a.lora_int_id}: rank {a.rank} > max_lora_rank={self.config.max_lora_rank}")

    def _load(self, adapter: SimAdapter, slot: int) -> None:
        """What `place` calls for an adapter not in a slot: its copy in over PCIe, before the step."""
        seconds = adapter_bytes(self.shape, adapter) / self.pcie_bytes_per_s
        self.clock.advance(seconds)
        self.slot_of[adapter.lora_int_id] = slot
        self.loads, self.load_seconds = self.loads + 1, self.load_seconds + seconds

    def prepare_step(self, scheduled: list) -> list[SimAdapter | None]:
        """(request, new tokens) per scheduled chunk -> each chunk's adapter, every adapter of the step in a slot
        first (the manager's `prepare_step`, without the mapping)."""
        wanted = {r.lora_request.lora_int_id: r.lora_request for r, _ in scheduled if r.lora_request is not None}
        self.place(wanted)
        if wanted:
            self.distinct.append(len(wanted))
        return [r.lora_request for r, _ in scheduled]


class SimulatedLoRA(SimulatedContinuous):
    """Level 2 with `enable_lora=True` on the modelled clock: `SimSlots` where the engine would put the room's
    manager (the same preparer and admission seams), each step's adapters handed to the cost model."""

    def __init__(self, model: str, *, pcie_bytes_per_s: float = 25e9, **kwargs):
        self.pcie_bytes_per_s = pcie_bytes_per_s
        super().__init__(model, **kwargs)

    def new_lora_manager(self, c) -> SimSlots:  # level 2's make_lora puts it in the same seams
        return SimSlots(LoRAConfig(c.max_loras, c.max_lora_rank, c.max_cpu_loras), self.shape, self.clock,
                        self.pcie_bytes_per_s)  # fmt: skip

    def prepare_input(self, sched) -> SimStep:
        step = super().prepare_input(sched)
        if self.lora is not None:
            step.adapters = self.lora.prepare_step(sched.scheduled)
        return step


def run(reqs: list[SimRequest], max_loras: int = 256, model: str = "llama-2-7b", gpu_name: str = "a100-80gb",
        pcie_gbps: float = 25.0) -> dict:  # fmt: skip
    """Serve `reqs` (arrivals and adapters) on one simulated GPU -> S-LoRA's throughput and what explains it."""
    hw, shape, clock = gpu(gpu_name), model_shape(model), SimClock()
    adapters = {r.lora_request.lora_int_id: r.lora_request for r in reqs if r.lora_request is not None}
    budget, lora = kv_budget(hw, shape), {}
    if adapters:
        rank, slot = max(a.rank for a in adapters.values()), max(adapter_bytes(shape, a) for a in adapters.values())
        budget -= min(max_loras, len(adapters)) * slot  # the slots' memory (vLLM's: each slot the largest rank)
        # every adapter in host memory, as S-LoRA's
        lora = dict(enable_lora=True, max_loras=max_loras, max_lora_rank=rank,
                    max_cpu_loras=max(max_loras, len(adapters)))  # fmt: skip
    engine = SimulatedLoRA(model, hardware=hw, clock=clock, kv_cache_memory=budget, max_num_seqs=256, block_size=16,
                           max_num_batched_tokens=2048, keep_trace=True, pcie_bytes_per_s=pcie_gbps * 1e9, **lora)  # fmt: skip
    # each request ends at its output length (EOS there): S-LoRA's ignore_eos with max_new_tokens = output_len
    seqs = play(engine, reqs, user_params(engine.max_model_len))
    end, trace, slots = max(s.metrics.finished_time for s in seqs), engine.worker.trace, engine.lora
    busy, per_step = sum(s.cost.total for s in trace), (slots.distinct if slots else []) or [0]
    return {"used": len(adapters), "max_loras": max_loras if adapters else 0, "requests": len(seqs),
            "throughput": len(seqs) / end, "latency": sum(s.metrics.e2e for s in seqs) / len(seqs),
            "batch": sum(s.cost.total * s.batch for s in trace) / busy, "lora_share": sum(s.cost.lora for s in trace) / busy,
            "distinct": sum(per_step) / len(per_step), "most_distinct": max(per_step),  # adapters in a step that ran any
            "loads": slots.loads if slots else 0, "load_share": (slots.load_seconds if slots else 0.0) / end,
            "kv_tokens": engine.num_blocks * engine.config.cache.block_size,
            "preemptions": engine.stats.preemptions}  # fmt: skip


def main(argv=None) -> list[dict]:
    from rich.console import Console
    from rich.table import Table

    from ladder.cli import LadderParser, nonneg_int, positive_float, positive_int

    p = LadderParser(prog="python -m benchmarks.sim.lora", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default="llama-2-7b", help="a shipped shape (benchmarks/sim/models)")
    p.add_argument("--gpu", default="a100-80gb", help="a GPU of benchmarks/sim/gpus.json")
    p.add_argument("--adapters", default="1,5,8,64,100,1000,2000", help="comma-separated numbers of adapters")
    p.add_argument("--ranks", default="8", help="comma-separated ranks, cycled over the adapters (S2: 64,32,16,8)")
    p.add_argument("--max-loras", type=positive_int, default=256, help="adapters one step may run (the slots)")
    p.add_argument("--rate", type=positive_float, default=10.0, help="requests/s offered")
    p.add_argument("--duration", type=positive_float, default=120.0, help="seconds of arrivals")
    p.add_argument("--alpha", type=positive_float, default=1.0, help="the adapters' power law (1: uniform)")
    p.add_argument("--baseline-requests", type=nonneg_int, default=100,
                   help="requests of the trace served one adapter at a time (max_loras 1); 0: no baseline")  # fmt: skip
    p.add_argument("--pcie-gbps", type=positive_float, default=25.0, help="GB/s an adapter's load from host reaches")
    p.add_argument("--seed", type=int, default=0, help="the trace's seed")
    p.add_argument("--quick", action="store_true", help="1, 8 and 64 adapters, 20 s of arrivals, 20 baseline requests")
    args = p.parse_args(argv)
    try:
        counts = [int(x) for x in args.adapters.split(",")]
        ranks = tuple(int(x) for x in args.ranks.split(","))
    except ValueError:
        p.error("argument --adapters/--ranks: comma-separated integers")
    if min(counts) < 1 or min(ranks) < 1:
        p.error("argument --adapters/--ranks: each must be >= 1")
    if args.quick:
        counts, args.duration, args.baseline_requests = [1, 8, 64], 20.0, min(args.baseline_requests, 20)
    num = int(args.rate * args.duration)
    serve = lambda reqs, k=args.max_loras: run(reqs, k, args.model, args.gpu, args.pcie_gbps)  # noqa: E731
    trace = lambda n, rate=args.rate: slora_trace(n, num, rate, ranks, args.alpha, seed=args.seed)  # noqa: E731
    rows = []
    for n in [0] + counts:  # 0: the base model alone, the ceiling
        row = {"adapters": n, "at_rate": serve(trace(n)), "saturated": serve(trace(n, math.inf)), "one_at_a_time": None}
        if args.baseline_requests and n > 1:  # (one adapter: max_loras changes nothing)
            row["one_at_a_time"] = serve(trace(n)[: args.baseline_requests], 1)
        rows.append(row)
    base = rows[0]["saturated"]["throughput"]
    published = lambda d, n: f"{d[ranks][n]:.2f}" if n in d.get(ranks, {}) else ""  # noqa: E731
    table = Table("adapters", f"req/s at {args.rate:g}", "S-LoRA (paper)", "req/s saturated", "/ base model",
                  "one at a time", "PEFT, vLLM-packed (paper)", "adapters / step", "LoRA time",
                  "loads (PCIe time)", "batch",
                  title=f"{args.model} on {args.gpu}: {num} requests, ranks {args.ranks} on q,k,v,o, lengths U[8, 512), "
                        f"alpha {args.alpha:g}, max_loras {args.max_loras}")  # fmt: skip
    for row in rows:
        n, r, s, one = row["adapters"], row["at_rate"], row["saturated"], row["one_at_a_time"]
        table.add_row(str(n) if n else "0 (base model)", f"{r['throughput']:.2f}", published(SLORA, n),
                      f"{s['throughput']:.2f}", f"{s['throughput'] / base:.3f}", f"{one['throughput']:.2f}" if one else "",
                      ", ".join(x for x in (published(PEFT, n), published(VLLM_PACKED, n)) if x), f"{s['distinct']:.1f}", f"{100 * s['lora_share']:.1f} %",
                      f"{s['loads']} ({100 * s['load_share']:.1f} %)", f"{s['batch']:.0f}")  # fmt: skip
    Console(width=180).print(table)
    print(f"req/s: requests / (the last one's end), as S-LoRA counts; at {args.rate:g}: arrivals over {args.duration:g} s, "
          f"saturated: all at once (the last four columns are its). One at a time: max_loras 1, the first "
          f"{args.baseline_requests} requests. KV cache: {rows[0]['saturated']['kv_tokens']:,} tokens without adapters, "
          f"{min(row['saturated']['kv_tokens'] for row in rows):,} with the most slots (S-LoRA's runs: 125,000).")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
