"""Disaggregated prefill and decode on simulated GPUs: DistServe's comparison, in shape.

What it is: `python -m benchmarks.sim.disagg`. Two ways to serve OPT-13B on A100s, each the
ladder's real scheduler on the modelled clock (engines.py):

    colocated       vLLM V1: one engine per GPU, prefill chunks and decodes in the same steps (a
                    token budget of 2048: chunked prefill), the ladder's level 2
    colocated, V0   vLLM as DistServe measured it (2023): a step with waiting prompts runs those
                    prompts alone, whole, and every running request's decode waits for it
                    (`PrefillFirst`)
    disaggregated   a prefill engine (its own GPUs, `--prefill-tp`) and a decode engine (`--decode-tp`):
                    a request is prefilled there (one token, which the client gets as its first),
                    its KV crosses a link (`--link`: NVLink, PCIe, a 100 or 400 Gb/s network) in
                    prompt bytes / bandwidth + latency, and the decode engine admits it with its
                    prompt already computed (a connector that says so: `ArrivedKV`) and generates
                    the rest

and the figure DistServe is about, **goodput**: the highest request rate per GPU at which at least
90 % of requests meet both a time-to-first-token SLO and a time-per-output-token SLO (TPOT: the
mean gap between a request's tokens after its first). For OPT-13B on ShareGPT-like traffic
DistServe's artifact uses TTFT <= 0.25 s, TPOT <= 0.1 s, and two prefill GPUs (TP=2) with one decode
GPU against vLLM on one GPU (`evaluation/ae-scripts/e2e/_plot.py`, `2-start-api-server.py`); those
are the defaults. The rate is searched by bisection on seeded Poisson traces.

`--workload` picks DistServe's workload (its Table 1; the artifact's placements, `2-start-api-server.py`):

    chatbot         OPT-13B, TTFT <= 0.25 s, TPOT <= 0.1 s; vLLM on 1 GPU, 2P (TP=2) + 1D; DistServe's own
                    ShareGPT requests (drawn from their lengths' quantiles, `CHATBOT_PROMPT`: prompts mean 759
                    tokens, outputs 191 here and 186 in the data: the top twentieth is drawn evenly)
    sharegpt        the same on serve.py's `sharegpt` trace (the PagedAttention paper's statistics: prompts
                    mean 161 tokens, outputs 338: the chatbot's work turned around)
    summarization   LongBench: OPT-66B, TTFT <= 15 s, TPOT <= 0.15 s; vLLM on 4 GPUs (TP=4) against a
                    prefill engine of TP=4 and a decode engine of TP=2 x PP=2 (8 GPUs). Prompts are
                    documents truncated as the artifact's `0-prepare-dataset.py` does (to a random
                    1,900-2,048 tokens, and to 2,040 - the answer): log-normal document lengths
                    (sigma 0.9) cut there, scaled so the prompts' mean is 1,738 tokens; answers
                    log-normal (sigma 0.8), mean 91 tokens (the means are LongBench's as commonly
                    cited for DistServe; its figure 7 draws the distributions as an image we could
                    not read, so they are not checked against it)

The flags name the other settings; each left out takes the workload's. `--speeds measured` plays each system
at the speed DistServe's artifact measured for it (`MEASURED_SPEEDS`, fitted by distserve_fit.py to single
requests: vLLM of 2023 for the colocated rows, DistServe's engine for the pair; OPT-13B on an A100-80GB
only); the default gives every system the cost model's.

The two engines run on two clocks, stepped in time order (always the one whose next step comes
first), so a prefill that ends at t arrives at the decode engine at t + transfer, and a decode
step never sees a request before it arrived.

What it is not: DistServe's placement search (it picks the parallelism of each phase per
workload; here they are given), pipeline parallelism on the prefill side (the decode engine's is
level 5's batch queue), or its batching of transfers. Each transfer has the link's full
bandwidth, however many overlap (no contention). With a loose TTFT SLO (summarization's 15 s) a
system can run above its prefill capacity for as long as a trace lasts, so that goodput grows as
`--requests` shrinks.

Reference: Zhong et al., "DistServe" (OSDI 2024), section 6 and its artifact
(github.com/LLMServe/DistServe); Patel et al., "Splitwise" (ISCA 2024).
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
from dataclasses import dataclass

from features.kv_connectors.base import KVConnectorBase
from level2_continuous.scheduler import Scheduler, SchedulerOutput

from .clock import SimClock
from .cost import gpu
from .engines import SimulatedContinuous
from .serve import SimRequest, lengths, make_engine, play, trace, user_params

# bytes/s one way, seconds per transfer: NVLink 3 (A100 SXM), PCIe 4.0 x16 (what a copy reaches), Ethernet/IB
LINKS = {"nvlink": (300e9, 5e-6), "pcie": (25e9, 10e-6), "100gbps": (12.5e9, 50e-6), "400gbps": (50e9, 50e-6)}


@dataclass(frozen=True)
class Workload:
    """One of DistServe's workloads: the model, the SLOs, vLLM's GPUs and the disaggregated placement."""

    model: str
    ttft_slo: float
    tpot_slo: float
    colocated_tp: int
    prefill_tp: int
    decode_tp: int
    decode_pp: int = 1
    lo: float = 0.05  # the bisection's lowest rate per GPU


WORKLOADS = {"chatbot": Workload("opt-13b", 0.25, 0.1, 1, 2, 1),
             "sharegpt": Workload("opt-13b", 0.25, 0.1, 1, 2, 1),
             "summarization": Workload("opt-66b", 15.0, 0.15, 4, 4, 2, 2, lo=0.005)}  # fmt: skip
LONGBENCH = (1738.0, 91.0)  # mean prompt and answer tokens (not checked against DistServe's figure 7: an image)

# DistServe's own ShareGPT requests (OPT's tokenizer), as its artifact served them: the 5 % quantiles (0 %, 5 %,
# ..., 100 %) of the prompt and output lengths of the 1,600 requests in its simulator's ground truth,
# simdistserve/benchmarks/alignment/data-ground-truth/opt-13b-sharegpt/distserve-c21d12-1600-16.exp (commit
# 20a1633). Means 759 and 186 tokens, medians 680 and 76; the two are nearly independent (correlation -0.13).
CHATBOT_PROMPT = (2, 25, 89, 165, 244, 311, 375, 453, 512, 600, 680, 768, 857, 947, 1042, 1147, 1272, 1420, 1543,
                  1723, 2031)  # fmt: skip
CHATBOT_OUTPUT = (1, 6, 9, 12, 15, 18, 22, 28, 36, 52, 76, 113, 158, 211, 258, 304, 349, 406, 507, 648, 1809)


# Each system's speed as DistServe's artifact measured it on OPT-13B, A100-80GB (`python -m
# benchmarks.sim.distserve_fit DIR` on its ground truth, see there): the cost model's efficiencies and the time a
# request spends outside the engine before its first token (client, HTTP, tokenizer). `--speeds measured` plays
# colocated vLLM at vLLM's and the disaggregated pair at DistServe's; `model` (the default) gives both cost.py's.
MEASURED_SPEEDS = {"vllm": dict(compute_efficiency=0.60, memory_efficiency=0.49, client_s=0.014),
                   "distserve": dict(compute_efficiency=0.52, memory_efficiency=0.53, client_s=0.005)}  # fmt: skip


def hardware(gpu_name: str, speed: dict | None) -> tuple:
    """(the GPU at a system's measured speed, or the model's, the client's seconds before the first token)."""
    speed = dict(speed or {})
    client_s = speed.pop("client_s", 0.0)
    return gpu(gpu_name, **speed), client_s


def quantile_draw(rng: random.Random, quantiles: tuple[int, ...]) -> int:
    """A length drawn from a distribution given by evenly spaced quantiles (linear between them)."""
    x = rng.random() * (len(quantiles) - 1)
    i = min(int(x), len(quantiles) - 2)
    return max(1, round(quantiles[i] + (x - i) * (quantiles[i + 1] - quantiles[i])))


def cut_lengths(rng: random.Random, caps: list[int], mean: float, sigma: float) -> list[int]:
    """Log-normal lengths, each cut at its cap, scaled (a few rounds) so that their mean is `mean`."""
    raw = [rng.lognormvariate(0.0, sigma) for _ in caps]
    scale = mean / (sum(raw) / len(raw))
    for _ in range(40):
        out = [min(cap, max(1, round(x * scale))) for x, cap in zip(raw, caps)]
        scale *= mean / (sum(out) / len(out))
    return out


def requests(workload: str, num: int, rate: float, seed: int = 0, vocab: int = 50272) -> list[SimRequest]:
    """`num` requests of the workload arriving as a Poisson process at `rate` per second."""
    if workload == "sharegpt":
        return trace("sharegpt", num, rate, seed)
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
    rng = random.Random(seed)
    if workload == "chatbot":  # DistServe's ShareGPT lengths; prompt + output within OPT's 2,048 positions
        t, reqs = 0.0, []
        for _ in range(num):
            t += rng.expovariate(rate)
            p = quantile_draw(rng, CHATBOT_PROMPT)
            a = min(quantile_draw(rng, CHATBOT_OUTPUT), 2048 - p)
            reqs.append(SimRequest(t, [rng.randrange(3, vocab) for _ in range(p)], a))
        return reqs
    answers = lengths(rng, num, LONGBENCH[1], 0.8, 1024)
    caps = [min(rng.randint(1900, 2048), 2040 - a) for a in answers]  # the artifact's truncation
    prompts = cut_lengths(rng, caps, LONGBENCH[0], 0.9)
    t, reqs = 0.0, []
    for p, a in zip(prompts, answers):
        t += rng.expovariate(rate)
        reqs.append(SimRequest(t, [rng.randrange(3, vocab) for _ in range(p)], a))
    return reqs


class ArrivedKV(KVConnectorBase):
    """The decode engine's connector on the modelled clock: each request's prompt arrived before the
    request did (the link's time is in its arrival), so at admission every whole block of it but the
    one with the prompt's last token counts as computed; nothing moves (there are no tensors)."""

    def __init__(self, block_size: int):
        self.block_size, self.loaded = block_size, set()

    def get_num_new_matched_tokens(self, req, num_computed_tokens: int) -> int:
        if req.seq_id in self.loaded:  # preempted after its load: the KV is gone, it computes
            return 0
        usable = (len(req.prompt_token_ids) - 1) // self.block_size * self.block_size
        return max(0, usable - num_computed_tokens)

    def update_state_after_alloc(self, req, blocks: list, num_external_tokens: int) -> None:
        if num_external_tokens:
            self.loaded.add(req.seq_id)


class PrefillFirst(Scheduler):
    """vLLM V0's default schedule: while prompts wait and fit, a step admits them alone (whole
    prompts, up to the token budget); decodes run only in steps no prompt wants."""

    def schedule(self) -> SchedulerOutput:
        self.num_admissible, out = 0, SchedulerOutput()
        self._admit(out, self.max_num_batched_tokens, list(self.running))
        return out if out.scheduled else super().schedule()


class SimulatedV0(SimulatedContinuous):
    scheduler_class = PrefillFirst


@dataclass
class Timing:
    """One request as its client saw it (seconds on the modelled clock)."""

    arrival: float
    first_token: float
    finished: float
    output_len: int

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        return 0.0 if self.output_len <= 1 else (self.finished - self.first_token) / (self.output_len - 1)


def colocated(reqs: list[SimRequest], model: str, gpu_name: str, v0: bool = False, tp: int = 1,
              v0_tokens: int = 2048, speed: dict | None = None) -> list[Timing]:  # fmt: skip
    """vLLM on `tp` GPUs; `v0`: its 2023 schedule, whole prompts up to `v0_tokens` a step; `speed`: a
    `MEASURED_SPEEDS` entry (None: the cost model's)."""
    hw, client_s = hardware(gpu_name, speed)
    engine = make_engine("vllm", model, hw, SimClock(), tp=tp)
    if v0:  # the same engine's settings, its scheduler swapped
        engine = SimulatedV0(model, hardware=hw, clock=SimClock(), tp=tp, kv_cache_memory=engine.kv_budget,
                             max_num_seqs=256, block_size=16, max_num_batched_tokens=v0_tokens)  # fmt: skip
    seqs = play(engine, reqs, user_params(engine.max_model_len))
    # (the client's time comes before the engine sees a request: its TTFT grows by it, its TPOT does not)
    return [Timing(s.metrics.arrival_time - client_s, s.metrics.first_token_time, s.metrics.finished_time,
                   len(s.output_token_ids)) for s in seqs]  # fmt: skip


def disaggregated(reqs: list[SimRequest], model: str, gpu_name: str, link: str = "nvlink", prefill_tp: int = 1,
                  decode_tp: int = 1, decode_pp: int = 1, speed: dict | None = None) -> list[Timing]:  # fmt: skip
    hw, client_s = hardware(gpu_name, speed)
    bandwidth, latency = LINKS[link]
    prefill = make_engine("vllm", model, hw, SimClock(), tp=prefill_tp)
    decode = make_engine("vllm-prefix", model, hw, SimClock(), tp=decode_tp, pp=decode_pp)
    connector = ArrivedKV(decode.config.cache.block_size)
    decode.kv.connector, decode.kv.pool.on_evict = connector, connector.block_evicted
    params = user_params(prefill.max_model_len)
    per_token = prefill.shape.kv_bytes_per_token
    timings: dict[str, Timing] = {}
    waiting = {"p": [(r.arrival, i, r) for i, r in enumerate(reqs)], "d": []}  # (time, index, request)
    heapq.heapify(waiting["p"])
    engines = {"p": prefill, "d": decode}

    def next_time(side: str) -> float:
        e = engines[side]
        if e.has_unfinished_requests():
            return e.clock.now
        return waiting[side][0][0] if waiting[side] else math.inf

    while (t := min(next_time("p"), next_time("d"))) < math.inf:
        side = "p" if next_time("p") <= next_time("d") else "d"
        e = engines[side]
        e.clock.now = max(e.clock.now, t)
        while waiting[side] and waiting[side][0][0] <= e.clock.now:
            at, i, r = heapq.heappop(waiting[side])
            rid = str(i)
            if side == "p":
                e.targets[rid] = 1  # the prefill engine's one token: the client's first
                timings[rid] = Timing(r.arrival - client_s, 0.0, 0.0, r.output_len)
            else:
                e.targets[rid] = r.output_len - 1  # the rest, after the prompt's KV arrived
            e.add_request(rid, r.prompt, params(r), arrival_time=at)
        for out in e.step():
            if not out.finished:
                continue
            rid, now = out.request_id, e.clock.now
            r = reqs[int(rid)]
            if side == "p":
                timings[rid].first_token = timings[rid].finished = now
                if r.output_len > 1:  # the KV crosses the link at its full bandwidth
                    # (each pair of GPUs moves its share: as many links as the smaller side has GPUs)
                    pairs = min(prefill_tp, decode_tp * decode_pp)
                    arrive = now + latency + len(r.prompt) * per_token / pairs / bandwidth
                    heapq.heappush(waiting["d"], (arrive, int(rid), r))
            else:
                timings[rid].finished = now
    return [timings[str(i)] for i in range(len(reqs))]


def attainment(timings: list[Timing], ttft_slo: float, tpot_slo: float) -> float:
    """The share of requests within both SLOs."""
    return sum(t.ttft <= ttft_slo and t.tpot <= tpot_slo for t in timings) / len(timings)


def goodput(serve, gpus: int, ttft_slo: float, tpot_slo: float, num: int, seed: int, target: float = 0.9,
            lo: float = 0.05, hi: float = 200.0, rounds: int = 12,
            workload: str = "sharegpt") -> tuple[float, float]:  # fmt: skip
    """The highest rate per GPU whose trace of `num` requests meets both SLOs for `target` of them
    (bisection between lo and hi requests/s per GPU) -> (rate per GPU, its attainment)."""

    def ok(rate: float) -> float:
        return attainment(serve(requests(workload, num, rate * gpus, seed)), ttft_slo, tpot_slo)

    if ok(lo) < target:
        return 0.0, ok(lo)
    best = (lo, ok(lo))
    for _ in range(rounds):
        mid = math.sqrt(lo * hi)  # (rates span decades: bisect their logarithm)
        a = ok(mid)
        if a >= target:
            lo, best = mid, (mid, a)
        else:
            hi = mid
    return best


def main(argv=None) -> dict:
    from rich.console import Console
    from rich.table import Table

    from ladder.cli import LadderParser, positive_float, positive_int

    p = LadderParser(prog="python -m benchmarks.sim.disagg", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--workload", default="chatbot", choices=list(WORKLOADS),
                   help="DistServe's workload: its model, SLOs and placements unless flags say otherwise")  # fmt: skip
    p.add_argument("--model", help="a shipped shape (benchmarks/sim/models)")
    p.add_argument("--gpu", default="a100-80gb", help="a GPU of benchmarks/sim/gpus.json")
    p.add_argument("--ttft-slo", type=positive_float, help="seconds to the first token")
    p.add_argument("--tpot-slo", type=positive_float, help="seconds per output token after the first")
    p.add_argument("--colocated-tp", type=positive_int, help="vLLM's GPUs (tensor parallel)")
    p.add_argument("--prefill-tp", type=positive_int, help="the prefill engine's GPUs (tensor parallel)")
    p.add_argument("--decode-tp", type=positive_int, help="the decode engine's tensor parallel size")
    p.add_argument("--decode-pp", type=positive_int, help="the decode engine's pipeline stages (its GPUs: tp x pp)")
    p.add_argument("--v0-tokens", type=positive_int, default=2048,
                   help="vLLM V0's prompt tokens a step (DistServe's artifact ran vLLM with 16384)")  # fmt: skip
    p.add_argument("--speeds", default="model", choices=["model", "measured"],
                   help="the cost model's speed for every system, or each system's as DistServe's artifact "
                        "measured it (MEASURED_SPEEDS: OPT-13B on A100-80GB)")  # fmt: skip
    p.add_argument("--links", default=",".join(LINKS), help=f"comma-separated, of {', '.join(LINKS)}")
    p.add_argument("--requests", type=positive_int, default=400, help="requests per trace")
    p.add_argument("--seed", type=int, default=0, help="the traces' seed")
    args = p.parse_args(argv)
    w = WORKLOADS[args.workload]
    for name in ("model", "ttft_slo", "tpot_slo", "colocated_tp", "prefill_tp", "decode_tp", "decode_pp"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(w, name))
    if args.speeds != "model" and (args.model, args.gpu) != ("opt-13b", "a100-80gb"):
        p.error(f"argument --speeds: {args.speeds} was measured for opt-13b on a100-80gb only, not {args.model} "
                f"on {args.gpu}")  # fmt: skip
    links = [x.strip() for x in args.links.split(",")]
    if bad := [x for x in links if x not in LINKS]:
        p.error(f"argument --links: unknown {', '.join(bad)}; known: {', '.join(LINKS)}")
    search = dict(ttft_slo=args.ttft_slo, tpot_slo=args.tpot_slo, num=args.requests, seed=args.seed, lo=w.lo,
                  workload=args.workload)  # fmt: skip
    ctp = args.colocated_tp
    # whose speed each system runs at: vLLM's for the colocated rows, DistServe's engine's for the pair
    speed = {k: (k if args.speeds == "measured" else "model") for k in ("vllm", "distserve")}
    vllm, distserve = (MEASURED_SPEEDS.get(speed[k]) for k in ("vllm", "distserve"))
    rows = [(f"vLLM{' V0' * v0}, colocated", ctp,
             *goodput(lambda r, v0=v0: colocated(r, args.model, args.gpu, v0, ctp, args.v0_tokens, vllm), ctp,
                      **search), speed["vllm"])
            for v0 in (False, True)]  # fmt: skip
    decode_gpus = args.decode_tp * args.decode_pp
    gpus = args.prefill_tp + decode_gpus
    layout = f"{args.prefill_tp}P+{decode_gpus}D" + (f" (decode TP={args.decode_tp} x PP={args.decode_pp})"
                                                     if args.decode_pp > 1 else "")  # fmt: skip
    placement = (args.prefill_tp, args.decode_tp, args.decode_pp)
    for link in links:
        serve = lambda r, link=link: disaggregated(r, args.model, args.gpu, link, *placement, distserve)  # noqa: E731
        rows.append((f"disaggregated {layout}, {link}", gpus, *goodput(serve, gpus, **search), speed["distserve"]))
    label = {"chatbot": "DistServe's ShareGPT", "sharegpt": "ShareGPT-like", "summarization": "LongBench-like"}[
        args.workload] + (", measured speeds" if args.speeds == "measured" else "")
    table = Table("system", "GPUs", "goodput / GPU (req/s)", "attainment there", "/ vLLM V1", "/ vLLM V0",
                  title=f"{args.model} on {args.gpu}, {label}, TTFT <= {args.ttft_slo:g} s and TPOT <= "
                        f"{args.tpot_slo:g} s for 90 % of requests")  # fmt: skip
    for name, n, rate, att, _ in rows:
        ratios = [f"{rate / base:.2f}x" if base else "" for base in (rows[0][2], rows[1][2])]
        table.add_row(name, str(n), f"{rate:.2f}", f"{100 * att:.0f} %", *ratios)
    Console(width=130).print(table)
    return {"args": vars(args), "rows": [{"system": n, "gpus": g, "goodput_per_gpu": r, "attainment": a, "speed": s}
                                         for n, g, r, a, s in rows]}  # fmt: skip


if __name__ == "__main__":
    main()
