"""Serve a workload on a simulated GPU: arrivals, the engine's steps, and what came out.

What it is: the paper's two traces as seeded synthetic workloads, and `simulate`, which feeds
one to a simulated system (engines.py, orca.py) as requests arrive and reports what the PagedAttention
paper plots:

    sharegpt        prompts mean 161 tokens, outputs mean 338 (the paper's table 1), long-tailed
    alpaca          prompts mean 19, outputs mean 58
    shared-prefix   the project's (benchmarks/workloads.py): one 384-token system prompt and
                    8-32 tokens of each request's own, outputs 32-64: level 3's case
    chat            conversations of up to 4 turns (a 32-token system prompt of their own; user
                    turns drawn with mean 64 tokens, answers 200; a conversation ends early when
                    its next turn would not fit the model), each turn's prompt the whole exchange
                    so far plus the user's new text, sent THINK_S seconds (mean, exponential)
                    after the previous answer ended: closed loop, so a slow engine also slows its
                    users' next turns; conversations start at rate / 4 per second, so that the
                    offered load is at most about `rate` requests/s. Level 3's case across calls

    normalized latency   mean over requests of (finish - arrival) / output tokens (s/token)
    batched requests     the time-weighted mean number of requests in a step
    KV holding tokens    the time-weighted share of the reserved KV memory that holds a token

Lengths are log-normal (sigma 0.9 for prompts, 0.8 for outputs: the published traces' long
tails), scaled so the sample means equal the published ones, and clipped so that prompt +
output fits the model's 2048 positions; arrivals are a Poisson process at `rate` requests/s.
A static engine (`ft`) does not play `chat`: it takes its whole workload up front, and a
conversation's next turn exists only once the engine has answered the last.

What it is not: the traces themselves (they are not shipped: nothing here downloads), or
a latency model of the network and the server.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

from ladder.progress import GenerateProgress
from level0_naive.sampling_params import RequestOutputKind, SamplingParams

from .clock import SimClock
from .cost import Hardware, gpu, kv_budget, model_shape, quantized
from .engines import SimulatedContinuous, SimulatedPipeline, SimulatedPrefix, SimulatedSpeculative, SimulatedStatic
from .orca import SimulatedOrca

TRACES = {"sharegpt": (161.0, 338.0), "alpaca": (19.0, 58.0), "shared-prefix": (404.0, 48.0),  # mean prompt, output
          "chat": (64.0, 200.0)}  # chat: a user turn's new tokens (the prompt adds up the exchange), an answer
TURNS, SYSTEM_TOKENS, THINK_S = 4, 32, 5.0  # chat: turns per conversation, its system prompt, a user's pause (mean)
SYSTEMS = ("vllm", "vllm-prefix", "vllm-spec", "orca-oracle", "orca-pow2", "orca-max", "ft")


@dataclass
class SimRequest:
    arrival: float
    prompt: list[int]
    output_len: int
    # A conversation's next turn, sent once this one is answered: its `arrival` is the pause after the answer
    # ends, its `prompt` the user's new tokens (play() puts the whole exchange before them).
    then: SimRequest | None = None
    lora_request: object | None = None  # its adapter (benchmarks/sim/lora_cost.py's SimAdapter), None: the base model


def lengths(rng: random.Random, n: int, mean: float, sigma: float, cap: int) -> list[int]:
    """n log-normal lengths in [1, cap] whose mean is `mean` (scaled after clipping, a few rounds)."""
    raw = [rng.lognormvariate(0.0, sigma) for _ in range(n)]
    scale = mean / (sum(raw) / n)
    for _ in range(20):
        out = [min(cap, max(1, round(x * scale))) for x in raw]
        scale *= mean / (sum(out) / n)
    return out


def trace(name: str, num: int, rate: float, seed: int = 0, vocab: int = 50272, max_len: int = 2048) -> list[SimRequest]:
    """`num` requests of a paper-like trace arriving as a Poisson process at `rate` per second (chat: `num`
    // 4 conversations, their first turns; the later ones hang from each as `then`)."""
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
    if name == "chat":  # num / TURNS conversations; one ends early when its next turn would not fit max_len
        convs = max(1, num // TURNS)
        cap = (max_len - SYSTEM_TOKENS) // 2  # so that a first turn always fits
        users = lengths(rng, convs * TURNS, mean_in, 0.9, cap)
        answers = lengths(rng, convs * TURNS, mean_out, 0.8, cap)
        t, reqs = 0.0, []
        for c in range(convs):
            u, a = users[c * TURNS : (c + 1) * TURNS], answers[c * TURNS : (c + 1) * TURNS]
            turns, used = 1, SYSTEM_TOKENS + u[0] + a[0]
            while turns < TURNS and used + u[turns] + a[turns] <= max_len:
                used, turns = used + u[turns] + a[turns], turns + 1
            turn = None
            for k in reversed(range(1, turns)):  # the last turn first: each points to the next
                turn = SimRequest(rng.expovariate(1 / THINK_S), [rng.randrange(3, vocab) for _ in range(u[k])], a[k], turn)
            t += rng.expovariate(rate / TURNS) if rate != math.inf else 0.0
            prompt = [rng.randrange(3, vocab) for _ in range(SYSTEM_TOKENS + u[0])]
            reqs.append(SimRequest(t, prompt, a[0], turn))
        return reqs
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
    drain_rate: float  # requests finished per second while some were still queued (the saturated rate), or,
    # when fewer than a quarter finished before the queue emptied, all of them over the run
    prefix_hit_share: float = 0.0  # prompt tokens found in the prefix cache / prompt tokens (level 3's hits)


def make_engine(system: str, model: str, hw: Hardware, clock: SimClock, tp: int = 1, pp: int = 1, **kwargs):
    shape = quantized(model_shape(model), kwargs.get("quantization"))  # (quantized weights leave more for KV)
    budget = kv_budget(hw, shape, tp * pp)  # per GPU
    if kwargs.get("draft_shape") is not None:  # every GPU holds the draft's weights too
        budget -= kwargs["draft_shape"].weight_bytes
    budget *= tp * pp  # the engine counts whole-model bytes per token
    common = dict(hardware=hw, clock=clock, tp=tp, pp=pp, kv_cache_memory=budget, max_num_seqs=256, keep_trace=True)
    if system == "ft":
        return SimulatedStatic(model, **common, **kwargs)
    if system.startswith("orca-"):
        return SimulatedOrca(model, reservation=system[5:], max_num_batched_tokens=2048, **common, **kwargs)
    if system in ("vllm", "vllm-prefix") and pp > 1:  # level 5's batch queue: pp micro-batches in flight
        # (the other systems with pp > 1, vllm-spec included, run one step at a time: stages in turn).
        # vLLM's max_num_seqs counts every running request, in flight or not; level 5's counts those of
        # one micro-batch: 256 / pp each keeps vLLM's 256 in all. The token budget stays per micro-batch, as
        # vLLM's is per scheduled batch.
        common["max_num_seqs"] = 256 // pp
        return SimulatedPipeline(model, block_size=16, max_num_batched_tokens=2048,
                                 enable_prefix_caching=system == "vllm-prefix", **common, **kwargs)  # fmt: skip
    if system in ("vllm", "vllm-prefix", "vllm-spec"):  # vllm-spec: kwargs num_speculative_tokens, alpha, draft_shape
        cls = {"vllm": SimulatedContinuous, "vllm-prefix": SimulatedPrefix, "vllm-spec": SimulatedSpeculative}[system]
        return cls(model, block_size=16, max_num_batched_tokens=2048, **common, **kwargs)
    raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")


def user_params(max_len: int):
    """What a user sends with each request: room to the end of the context (`max_len` less the prompt), greedy,
    the final output only; the request's output length (EOS there) decides where it ends. play()'s params_for."""
    return lambda r: SamplingParams(max_tokens=max_len - len(r.prompt), temperature=0.0,
                                    output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip


def play(engine, reqs: list[SimRequest], params_for, prefix: str = "r") -> list:
    """Feed `reqs` to a simulated engine as they arrive (each request's id `prefix` + its index, its
    SamplingParams `params_for(req)`, its output length the workload's), and run it until all are done:
    their sequences. A request's follow-up (`then`, a conversation's next turn) arrives its pause after the
    request's answer, its prompt the request's prompt + answer + the follow-up's own tokens. A static
    engine (level 0) forms its rounds from the arrivals itself, so it takes no follow-ups."""
    ids = [f"{prefix}{i}" for i in range(len(reqs))]
    if isinstance(engine, SimulatedStatic):
        if any(r.then for r in reqs):
            raise ValueError("a static engine takes its whole workload up front: no conversation's next turn")
        seqs = []
        for rid, r in zip(ids, reqs):
            engine.targets[rid] = r.output_len
            seq = engine.inputs.make_group(r.prompt, params_for(r), request_id=rid)[0]
            seq.metrics.arrival_time = r.arrival
            seqs.append(seq)
        engine.run(seqs, GenerateProgress(len(seqs), enabled=False))
        return seqs
    clock, seqs, sent, answered = engine.clock, [], {}, {}  # sent: {id: request}; answered: {id: its sequence}
    arriving = [(r.arrival, i, rid, r) for i, (rid, r) in enumerate(zip(ids, reqs))]  # (time, tie, id, request)
    heapq.heapify(arriving)
    while arriving or engine.has_unfinished_requests():
        while arriving and arriving[0][0] <= clock.now:
            at, _, rid, r = heapq.heappop(arriving)
            engine.targets[rid] = r.output_len
            engine.add_request(rid, r.prompt, params_for(r), arrival_time=at, lora_request=r.lora_request)
            seqs += engine.requests[rid]
            sent[rid], answered[rid] = r, engine.requests[rid][0]
        if engine.has_unfinished_requests():
            for out in engine.step():
                r = sent[out.request_id]
                if out.finished and r.then is not None:  # the user reads, thinks, and sends the next turn
                    nxt = r.then
                    answer = list(answered[out.request_id].output_token_ids)
                    follow = SimRequest(clock.now + nxt.arrival, r.prompt + answer + nxt.prompt, nxt.output_len,
                                        nxt.then, r.lora_request)  # fmt: skip
                    fid = f"{prefix}{len(sent) + len(arriving)}"
                    heapq.heappush(arriving, (follow.arrival, len(sent) + len(arriving), fid, follow))
        else:  # idle: on to the next arrival
            clock.now = arriving[0][0]
    return seqs


def simulate(system: str, reqs: list[SimRequest], gpu_name: str = "a100-40gb", model: str = "opt-13b", tp: int = 1,
             rate: float = 0.0, hardware: Hardware | None = None, engine=None, pp: int = 1,
             **engine_kwargs) -> SimResult:  # fmt: skip
    """Serve `reqs` (arrivals included) with `system` on a simulated GPU; `engine` (made here if None, with
    `engine_kwargs`)."""
    clock = engine.clock if engine is not None else SimClock()
    engine = engine or make_engine(system, model, hardware or gpu(gpu_name), clock, tp, pp, **engine_kwargs)
    return summarize(system, rate, engine, play(engine, reqs, user_params(engine.max_model_len)), reqs)


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
        # (fewer than a quarter finished while requests queued, when nearly all fit at once: a rate from so few
        # is noise, N / duration a lower bound)
        drain_rate=drained / (queued_until - start) if drained >= len(seqs) / 4 else len(seqs) / max(end - start, 1e-9),
        prefix_hit_share=getattr(getattr(engine, "kv", None), "hits", 0) / sum(len(s.prompt_token_ids) for s in seqs),
    )  # fmt: skip
