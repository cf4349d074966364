"""Serve a workload on a simulated GPU: arrivals, the engine's steps, and what came out.

What it is: the paper's two traces as seeded synthetic workloads, and `simulate`, which feeds
one to a simulated system (engines.py) as requests arrive and reports what the PagedAttention
paper plots:

    sharegpt        prompts mean 161 tokens, outputs mean 338 (the paper's table 1), long-tailed
    alpaca          prompts mean 19, outputs mean 58
    shared-prefix   the project's (benchmarks/workloads.py): one 384-token system prompt and
                    8-32 tokens of each request's own, outputs 32-64: level 3's case

    normalized latency   mean over requests of (finish - arrival) / output tokens (s/token)
    batched requests     the time-weighted mean number of requests in a step
    KV holding tokens    the time-weighted share of the reserved KV memory that holds a token

Lengths are log-normal (sigma 0.9 for prompts, 0.8 for outputs: the published traces' long
tails), scaled so the sample means equal the published ones, and clipped so that prompt +
output fits the model's 2048 positions; arrivals are a Poisson process at `rate` requests/s.

What it is not: the traces themselves (they are not shipped: nothing here downloads), or
a latency model of the network and the server.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ladder.progress import GenerateProgress
from level0_naive.sampling import RequestOutputKind, SamplingParams

from .cost import Hardware, gpu, kv_budget, model_shape
from .engines import (
    SimClock,
    SimulatedContinuous,
    SimulatedOrca,
    SimulatedPrefix,
    SimulatedSpeculative,
    SimulatedStatic,
)

TRACES = {"sharegpt": (161.0, 338.0), "alpaca": (19.0, 58.0), "shared-prefix": (404.0, 48.0)}  # mean prompt, output
SYSTEMS = ("vllm", "vllm-prefix", "vllm-spec", "orca-oracle", "orca-pow2", "orca-max", "ft")


@dataclass
class SimRequest:
    arrival: float
    prompt: list[int]
    output_len: int


def lengths(rng: random.Random, n: int, mean: float, sigma: float, cap: int) -> list[int]:
    """n log-normal lengths in [1, cap] whose mean is `mean` (scaled after clipping, a few rounds)."""
    raw = [rng.lognormvariate(0.0, sigma) for _ in range(n)]
    scale = mean / (sum(raw) / n)
    for _ in range(20):
        out = [min(cap, max(1, round(x * scale))) for x in raw]
        scale *= mean / (sum(out) / n)
    return out


def trace(name: str, num: int, rate: float, seed: int = 0, vocab: int = 50272, max_len: int = 2048) -> list[SimRequest]:
    """`num` requests of a paper-like trace arriving as a Poisson process at `rate` per second."""
    if name not in TRACES:
        raise ValueError(f"unknown trace {name!r}; known: {', '.join(TRACES)}")
    rng = random.Random(seed)
    if name == "shared-prefix":  # the project's workload: one 384-token system prompt + 8-32 own tokens
        prefix, t, reqs = [rng.randrange(3, vocab) for _ in range(384)], 0.0, []
        for _ in range(num):
            t += rng.expovariate(rate) if rate != math.inf else 0.0
            own = [rng.randrange(3, vocab) for _ in range(rng.randint(8, 32))]
            reqs.append(SimRequest(t, prefix + own, rng.randint(32, 64)))
        return reqs
    mean_in, mean_out = TRACES[name]
    prompts = lengths(rng, num, mean_in, 0.9, max_len // 2)
    outputs = lengths(rng, num, mean_out, 0.8, max_len // 2)
    t, reqs = 0.0, []
    for p, o in zip(prompts, outputs):
        t += rng.expovariate(rate) if rate != math.inf else 0.0
        reqs.append(SimRequest(t, [rng.randrange(3, vocab) for _ in range(p)], o))
    return reqs


@dataclass
class SimResult:
    system: str
    rate: float
    requests: int
    duration: float  # simulated seconds, first arrival to last finish
    normalized_latency: float  # s/token
    mean_ttft: float
    mean_batch: float  # requests per step, time-weighted
    kv_token_share: float  # of the KV memory reserved, the share holding tokens (time-weighted)
    kv_pool_share: float  # of the whole KV pool, the share holding tokens (the paper's figure 2 denominator)
    preemptions: int
    steps: int
    tokens_per_s: float
    drain_rate: float  # requests finished per second while some were still queued (the saturated rate)


def make_engine(system: str, model: str, hw: Hardware, clock: SimClock, tp: int = 1, pp: int = 1, **kwargs):
    budget = kv_budget(hw, model_shape(model), tp * pp)  # per GPU
    if kwargs.get("draft_shape") is not None:  # every GPU holds the draft's weights too
        budget -= kwargs["draft_shape"].weight_bytes
    budget *= tp * pp  # the engine counts whole-model bytes per token
    common = dict(hardware=hw, clock=clock, tp=tp, pp=pp, kv_cache_memory=budget, max_num_seqs=256, keep_trace=True)
    if system == "ft":
        return SimulatedStatic(model, **common, **kwargs)
    if system.startswith("orca-"):
        return SimulatedOrca(model, reservation=system[5:], max_num_batched_tokens=2048, **common, **kwargs)
    if system in ("vllm", "vllm-prefix", "vllm-spec"):  # vllm-spec: kwargs num_speculative_tokens, alpha, draft_shape
        cls = {"vllm": SimulatedContinuous, "vllm-prefix": SimulatedPrefix, "vllm-spec": SimulatedSpeculative}[system]
        return cls(model, block_size=16, max_num_batched_tokens=2048, **common, **kwargs)
    raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")


def play(engine, reqs: list[SimRequest], params_for, prefix: str = "r") -> list:
    """Feed `reqs` to a simulated engine as they arrive (each request's id `prefix` + its index, its
    SamplingParams `params_for(req)`, its output length the workload's), and run it until all are done:
    their sequences. A static engine (level 0) forms its rounds from the arrivals itself."""
    ids = [f"{prefix}{i}" for i in range(len(reqs))]
    for rid, r in zip(ids, reqs):
        engine.targets[rid] = r.output_len
    if isinstance(engine, SimulatedStatic):
        seqs = []
        for rid, r in zip(ids, reqs):
            seq = engine.inputs.make_group(r.prompt, params_for(r), request_id=rid)[0]
            seq.metrics.arrival_time = r.arrival
            seqs.append(seq)
        engine.run(seqs, GenerateProgress(len(seqs), enabled=False))
        return seqs
    clock, seqs, i = engine.clock, [], 0
    while i < len(reqs) or engine.has_unfinished_requests():
        while i < len(reqs) and reqs[i].arrival <= clock.now:
            engine.add_request(ids[i], reqs[i].prompt, params_for(reqs[i]), arrival_time=reqs[i].arrival)
            seqs += engine.requests[ids[i]]
            i += 1
        if engine.has_unfinished_requests():
            engine.step()
        else:  # idle: on to the next arrival
            clock.now = reqs[i].arrival
    return seqs


def simulate(system: str, reqs: list[SimRequest], gpu_name: str = "a100-40gb", model: str = "opt-13b", tp: int = 1,
             rate: float = 0.0, hardware: Hardware | None = None, engine=None, pp: int = 1,
             **engine_kwargs) -> SimResult:  # fmt: skip
    """Serve `reqs` (arrivals included) with `system` on a simulated GPU; `engine` (made here if None, with
    `engine_kwargs`)."""
    clock = engine.clock if engine is not None else SimClock()
    engine = engine or make_engine(system, model, hardware or gpu(gpu_name), clock, tp, pp, **engine_kwargs)
    max_len = engine.max_model_len

    def params_for(r: SimRequest) -> SamplingParams:  # what a user sends: room to the end, EOS decides
        return SamplingParams(max_tokens=max_len - len(r.prompt), temperature=0.0,
                              output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip

    return summarize(system, rate, engine, play(engine, reqs, params_for), reqs)


def summarize(system: str, rate: float, engine, seqs, reqs: list[SimRequest]) -> SimResult:
    trace_ = engine.worker.trace
    busy = sum(s.cost.total for s in trace_) or 1.0
    norm = [s.metrics.e2e / len(s.output_token_ids) for s in seqs]
    ttft = [s.metrics.ttft for s in seqs]
    start, end = min(r.arrival for r in reqs), max(s.metrics.finished_time for s in seqs)
    held = [(s.cost.total, s.stored / s.allocated) for s in trace_ if s.allocated]
    pool = engine.kv_budget // engine.bytes_per_token
    queued_until = max(s.metrics.first_scheduled_time for s in seqs)  # the queue is empty from here on
    drained = sum(s.metrics.finished_time <= queued_until for s in seqs)
    return SimResult(
        system=system, rate=rate, requests=len(seqs), duration=end - start,
        normalized_latency=sum(norm) / len(norm), mean_ttft=sum(ttft) / len(ttft),
        mean_batch=sum(s.cost.total * s.batch for s in trace_) / busy,
        kv_token_share=sum(t * f for t, f in held) / (sum(t for t, _ in held) or 1.0),
        kv_pool_share=sum(s.cost.total * s.stored for s in trace_) / busy / pool,
        preemptions=engine.stats.preemptions, steps=len(trace_),
        tokens_per_s=sum(len(s.output_token_ids) for s in seqs) / max(end - start, 1e-9),
        # (nothing finished while requests queued: all fit at once; then N / duration, a lower bound)
        drain_rate=drained / (queued_until - start) if drained else len(seqs) / max(end - start, 1e-9),
    )  # fmt: skip
