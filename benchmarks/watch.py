"""`python -m benchmarks.watch`: the live dashboard over an offline run or a simulated GPU.

What it is: the page the level-6 server shows at /dashboard (level6_serving/dashboard.py),
here over an engine that runs in this process, with nobody sending requests: a benchmark
workload on a real engine of level 2, 3 or 4 (the built-in tiny model, on this CPU, slowed
down by `--pace` so a person can follow it), or a paper trace on a simulated GPU
(`--simulate`: level 2's or 3's real scheduler and block manager on the modelled clock
of benchmarks/sim/, in step with the wall clock times `--speed`):

    python -m benchmarks.watch                                       # level 3, shared-prefix, http://127.0.0.1:8001/dashboard
    python -m benchmarks.watch --level 2 --workload spread           # long outputs in a small pool: preemptions
    python -m benchmarks.watch --level 4 --workload chat             # n-gram speculation: drafts kept and rejected
    python -m benchmarks.watch --simulate --gpu a100-40gb --model opt-13b --workload sharegpt --rate 2

It waits up to `--wait` seconds for a page to connect before it starts (so nothing is missed),
and keeps the page up after the run until Ctrl-C (`--no-hold`: exit when the run ends).

What it is not: a measurement (the pacing sleeps between steps; `benchmarks.throughput` measures),
or a picture of Orca's or FasterTransformer's memory (their reservations are not blocks: the
simulator's `--system` takes the paged ones only).
"""

from __future__ import annotations

import argparse
import sys
import time

from ladder.cli import LadderParser, nonneg_float, positive_float, positive_int, prog
from level6_serving.__main__ import byte_size, port

OFFLINE_WORKLOADS = ("shared-prefix", "uniform", "spread", "chat", "poisson")


def parser() -> argparse.ArgumentParser:
    from benchmarks.sim.cost import gpu_names
    from benchmarks.sim.serve import SYSTEMS, TRACES

    p = LadderParser(prog=prog("benchmarks.watch"), description=__doc__.split("\n\n")[1],
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    a = p.add_argument
    a("--host", default="127.0.0.1", help="the address the page listens on (default 127.0.0.1: this machine only)")
    a("--port", type=port, default=8001, help="the page's port (default 8001; 0: any free port)")
    a("--requests", type=positive_int, default=None, help="requests to run (default 32 offline, 300 simulated)")
    a("--wait", type=nonneg_float, default=30.0, help="seconds to wait for a page before starting (default 30)")
    a("--hold", action=argparse.BooleanOptionalAction, default=True, help="keep the page up after the run")
    a("--seed", type=int, default=0, help="the workload's random seed (default 0)")
    g = p.add_argument_group("an offline run of a real engine (the default)")
    g.add_argument("--level", type=int, choices=[2, 3, 4], default=3, help="the engine (default 3: prefix caching)")
    g.add_argument("--workload", default=None, help=f"offline: one of {', '.join(OFFLINE_WORKLOADS)} (default "
                   f"shared-prefix); simulated: one of {', '.join(TRACES)} (default sharegpt)")  # fmt: skip
    g.add_argument("--kv-cache-memory", type=byte_size, default=4 << 20,
                   help="the KV pool (default 4MiB: 42 blocks of the tiny model, a grid that fills up; it must "
                        "hold the workload's longest request: spread's takes 36 blocks)")  # fmt: skip
    g.add_argument("--pace", type=nonneg_float, default=0.05, help="seconds to sleep after each step (default 0.05)")
    g = p.add_argument_group("a simulated GPU (--simulate)")
    g.add_argument("--simulate", action="store_true", help="watch the what-if simulator on a modelled GPU instead")
    g.add_argument("--system", default="vllm", choices=[s for s in SYSTEMS if s in ("vllm", "vllm-prefix")],
                   help="the simulated scheduler (default vllm; vllm-prefix: with prefix caching)")  # fmt: skip
    g.add_argument("--gpu", default="a100-40gb", choices=gpu_names(), help="the GPU's spec from gpus.json (default a100-40gb)")
    g.add_argument("--model", default="opt-13b", help="a shape in benchmarks/sim/models (default opt-13b)")
    g.add_argument("--rate", type=positive_float, default=2.0, help="requests/s arriving (default 2)")
    g.add_argument("--speed", type=positive_float, default=1.0, help="simulated seconds per wall second (default 1)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    from benchmarks.sim.serve import TRACES

    p = parser()
    args = p.parse_args(argv)
    known = TRACES if args.simulate else OFFLINE_WORKLOADS
    args.workload = args.workload or ("sharegpt" if args.simulate else "shared-prefix")
    if args.workload not in known:
        p.error(f"argument --workload: {args.workload!r} is not one of {', '.join(known)}"
                f"{' (with --simulate)' if args.simulate else ''}")  # fmt: skip
    args.requests = args.requests or (300 if args.simulate else 32)
    return args


# --- the two runs ------------------------------------------------------------------------------------
def offline_engine(args):
    """A real engine of `args.level` over the built-in model, its pool `args.kv_cache_memory`."""
    import importlib

    from ladder.models import default_model

    module = importlib.import_module({2: "level2_continuous", 3: "level3_prefix", 4: "level4_speculative"}[args.level])
    kw = dict(kv_cache_memory=args.kv_cache_memory, max_model_len=512, seed=args.seed)
    if args.level == 4:  # n-gram guesses: no draft model to load, and chat's repeated turns give it hits
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    return module.LLMEngine(str(default_model()), **kw), "tiny-shakespeare"


def run_offline(engine, args, pace) -> int:
    """The workload's rounds on `engine` (chat: each turn once the last is answered; poisson: at its
    arrival times); returns how many requests finished."""
    from benchmarks.workloads import Request, make_workload
    from level0_naive.sampling_params import SamplingParams

    wl = make_workload(args.workload, args.requests, engine.model_config.vocab_size, args.seed)
    finished, counter = 0, iter(range(10**9))

    def run_round(reqs: list[Request]) -> list[list[int]]:
        nonlocal finished
        arrivals = wl.arrivals or [0.0] * len(reqs)
        ids, outs, start, i = [], {}, time.monotonic(), 0
        while i < len(reqs) or engine.has_unfinished_requests():
            while i < len(reqs) and arrivals[i] <= time.monotonic() - start:
                r = reqs[i]
                rid = f"{args.workload}-{next(counter)}"
                params = SamplingParams(max_tokens=r.max_tokens, min_tokens=r.max_tokens, temperature=0.0)
                engine.add_request(rid, r.prompt[: engine.max_model_len - r.max_tokens], params)
                ids.append(rid)
                i += 1
            if not engine.has_unfinished_requests():
                time.sleep(0.01)  # waiting for the next arrival
                continue
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out.outputs[0].token_ids
                    finished += 1
            pace()
        return [outs[rid] for rid in ids]

    wl.play(run_round)
    return finished


def sim_engine(args):
    from benchmarks.sim.clock import SimClock
    from benchmarks.sim.cost import gpu
    from benchmarks.sim.serve import make_engine

    return make_engine(args.system, args.model, gpu(args.gpu), SimClock()), args.model


def run_simulated(engine, args) -> int:
    """A paper trace arriving at `args.rate`, the simulated clock kept `args.speed` times the wall's."""
    from benchmarks.sim.serve import play, trace
    from level0_naive.sampling_params import RequestOutputKind, SamplingParams

    reqs = trace(args.workload, args.requests, args.rate, args.seed)
    wall0, step = time.monotonic(), engine.step

    def paced_step():  # the simulated engine's own step, then wait for the wall clock to catch up
        out = step()
        ahead = (engine.clock.now - reqs[0].arrival) / args.speed - (time.monotonic() - wall0)
        if ahead > 0:
            time.sleep(min(ahead, 5.0))
        return out

    engine.step = paced_step
    max_len = engine.max_model_len
    seqs = play(engine, reqs, lambda r: SamplingParams(max_tokens=max_len - len(r.prompt), temperature=0.0,
                                                       output_kind=RequestOutputKind.FINAL_ONLY))  # fmt: skip
    return sum(s.is_finished for s in seqs)


def main(argv=None) -> int:
    args = parse_args(argv)
    from level6_serving.api_server import ServerThread
    from level6_serving.dashboard import dashboard_app

    engine, name = sim_engine(args) if args.simulate else offline_engine(args)
    step_seconds = (lambda record: engine.worker.trace[-1].cost.total) if args.simulate else None
    app, feed = dashboard_app(engine, name, "simulator" if args.simulate else "offline", step_seconds=step_seconds)
    srv = ServerThread(app, args.host, args.port)
    hub = app.state.hub
    hub.closing = lambda: srv.server.should_exit  # open event streams end, so the server can stop
    try:
        with srv as url:
            print(f"dashboard: {url}/dashboard", file=sys.stderr, flush=True)
            deadline = time.monotonic() + args.wait
            while not hub.watched and time.monotonic() < deadline:  # start when someone is looking
                time.sleep(0.05)
            what = f"{args.system} on a simulated {args.gpu}, {args.model}" if args.simulate else f"level {args.level}"
            print(f"running {args.requests} {args.workload} requests on {what}", file=sys.stderr, flush=True)
            if args.simulate:
                done = run_simulated(engine, args)
            else:
                done = run_offline(engine, args, lambda: time.sleep(args.pace) if args.pace else None)
            if hub.watched:
                feed.capture(engine)  # the idle engine's last state (no more steps: the capped feed may have skipped it)
            print(f"done: {done} requests finished{'; Ctrl-C to stop' if args.hold else ''}", file=sys.stderr,
                  flush=True)  # fmt: skip
            while args.hold and srv.thread.is_alive():
                time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        close = getattr(engine, "shutdown", None)
        if close is not None:
            close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
