"""`python -m benchmarks.sim.validate`: can the simulator predict this machine? Calibrate, then predict the
committed CPU benchmark, row by row.

What it is: the check that makes the GPU what-if worth reading. The simulated engines are the
real ones with the forward replaced by a cost, so if the cost model is right for a machine,
the simulation must reproduce what the real engines measured there. Here the machine is this
CPU and the model the built-in one:

  1. the hardware: the matmul rates at each batch size and the memory bandwidths (DRAM's, for
     the KV cache, and the read rate at the weights' size) that the benchmark measured (its
     "roofline" section). Measuring now (the default), each level is
     measured alone and calibrated right after: a shared machine's speed drifts by tens of per
     cent over the minutes a whole benchmark takes, and a level's prediction should be held
     against the machine its calibration saw;
  2. the overhead: each simulated level's real engine runs a calibration workload (its own seeded
     requests, not the benchmark's: a crowd, a crowd sharing a prefix, two requests alone, small
     groups after a prefix hit, a crowd of short requests); for every step the roofline time of
     what it scheduled is subtracted from the step's wall time, and the rest is fitted as c0 + c1 *
     requests + c2 * new tokens + c3 * context tokens + c4 * context tokens read again in the step
     (in blocks another request read first: a shared prefix, which this CPU reads from its cache;
     zero at levels 0 and 2, which share no blocks) + c5 * chunks after a prefix hit (rows of more
     than 8 new tokens over a longer cache, which this CPU's attention takes one at a time through
     SDPA) (nonnegative least squares, relative errors): the Python and dispatch cost a CPU pays
     per step, per row and per token, and what its attention costs beyond the roofline's bytes;
     at level 4 also + d0 * the draft's forward passes + d1 * their new tokens, the draft's own
     fixed costs (each pass is a whole forward of its own: a step that guesses pays them, one
     that does not, above `disable_by_batch_size`, does not);
  3. the prediction: levels 0, 2, 3 and 4, simulated with that hardware, play each committed
     workload (uniform, spread, shared-prefix, chat, latency; poisson at its reference rate)
     with the benchmark's own settings (KV budget, max_num_seqs, exact output lengths; level
     4's draft acceptance per position is the one the benchmark measured, an input; its draft's
     passes cost their roofline plus d0 and d1), and their
     output tokens/s and mean TTFT are set beside the committed ones.

What it is not: a check of level 1 (static batches over blocks: not simulated) or of GPUs.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.throughput import tokenizer_encode
from benchmarks.workloads import make_workload
from level0_naive.sampling_params import RequestOutputKind, SamplingParams

from .clock import SimClock
from .cost import Hardware, ModelShape, cached_chunks, step_cost
from .engines import (
    SimulatedContinuous,
    SimulatedPrefix,
    SimulatedSpeculative,
    SimulatedStatic,
    dtype_bytes,
    read_again,
)
from .serve import SimRequest, play

ROOT = Path(__file__).resolve().parents[2]
LEVELS = {"level0_naive": SimulatedStatic, "level2_continuous": SimulatedContinuous, "level3_prefix": SimulatedPrefix,
          "level4_speculative": SimulatedSpeculative}  # fmt: skip


def spec_config(cfg: dict) -> dict:
    """Level 4 as the benchmark runs it (benchmarks/engines.py): its draft model, 2 guesses, off above 8 requests."""
    from benchmarks.engines import DISABLE_BY_BATCH_SIZE, NUM_SPECULATIVE_TOKENS

    draft = cfg.get("draft_model") or str(ROOT / "models" / "tiny-shakespeare-draft")
    if not Path(draft, "config.json").is_file():
        draft = str(ROOT / "models" / Path(draft).name)
    return {"model": draft, "num_speculative_tokens": NUM_SPECULATIVE_TOKENS, "disable_by_batch_size": DISABLE_BY_BATCH_SIZE}


def conditional_alphas(per_position: list[float]) -> list[float]:
    """P(guess i accepted | guesses before it accepted) from P(guesses 1..i all accepted), position by position."""
    out, before = [], 1.0
    for p in per_position:
        out.append(p / before if before else 0.0)
        before = p
    return out


def cpu_hardware(roofline: dict, overhead: dict | None = None) -> Hardware:
    """This CPU as the benchmark measured it: rates by batch, the KV's bandwidth and the weights' (measured at
    their size, which a cache may hold; a results JSON from before 2026-12-05 has none: the KV's); efficiencies
    1 (they are measured);
    `overhead`: a calibration's c0 (per step), c1 (per request), c2 (per new token), c3 (per context token),
    c4 (per context token read again in the step), c5 (per chunk after a prefix hit); `kv_reuse`: a block
    read again comes from the cache."""
    curve = tuple((p["batch"], p["flops_per_s"]) for p in roofline["sweep"])
    o = overhead or {"c0_s": 0.0, "c1_s": 0.0, "c2_s": 0.0, "c3_s": 0.0, "c4_s": 0.0}
    return Hardware("this CPU", curve[-1][1], roofline["bandwidth"], 1 << 40, compute_efficiency=1.0,
                    memory_efficiency=1.0, step_overhead_s=o["c0_s"], seq_overhead_s=o["c1_s"],
                    token_overhead_s=o["c2_s"], context_overhead_s=o["c3_s"],
                    shared_context_overhead_s=o.get("c4_s", o["c3_s"]), cached_chunk_overhead_s=o.get("c5_s", 0.0),
                    kv_reuse=True, flops_curve=curve, weight_bytes_per_s=roofline.get("weight_bandwidth"))  # fmt: skip


def exact(n: int) -> SamplingParams:
    """The benchmark's parameters: every output exactly n tokens."""
    return SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0,
                          output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip


def calibration_mix(seed: int = 123) -> list[list[tuple[list[int], int]]]:
    """The calibration's own requests (none of the benchmark's), in rounds run one after the other: 96
    prompts of 8-384 tokens with outputs of 8-200 at once (batches from 1 to about 90, contexts up to
    580); a prefix of 256 tokens alone, then 64 requests that start with it (8-64 tokens of their
    own, outputs of 8-120: with prefix caching their decodes read one copy of it); then two alone
    (batch 1, a long decode each); then twelve small groups (1 to 4 requests) that start with the
    prefix and add 9-96 tokens of their own: each group's prefill is a step of chunks after a prefix
    hit (c5's only witnesses otherwise are the one or two steps that prefill the 64); last, a short
    crowd, 32 requests of 8-48 prompt and 8-96 output tokens at once: batches up to 32 over contexts
    under 150, where `uniform` and `poisson` decode (the first crowd's contexts run to 580; with only
    those, a request's fixed cost and its context's cost move together, and the fit could not tell
    them apart: level 0 charged `poisson`'s short decodes 7-14 % too little). The fit sees the batch
    sizes, contexts and sharing the benchmark's workloads run at, without their requests."""
    rng = random.Random(seed)
    crowd = [([rng.randrange(32, 127) for _ in range(rng.randint(8, 384))], rng.randint(8, 200)) for _ in range(96)]
    prefix = [rng.randrange(32, 127) for _ in range(256)]
    sharing = [(prefix + [rng.randrange(32, 127) for _ in range(rng.randint(8, 64))], rng.randint(8, 120))
               for _ in range(64)]  # fmt: skip
    alone = [[([rng.randrange(32, 127) for _ in range(rng.randint(8, 48))], 96)] for _ in range(2)]
    hits = [[(prefix + [rng.randrange(32, 127) for _ in range(rng.randint(9, 96))], rng.randint(4, 16))
             for _ in range(k)] for k in (1, 2, 3, 4) * 3]  # fmt: skip
    short = [([rng.randrange(32, 127) for _ in range(rng.randint(8, 48))], rng.randint(8, 96)) for _ in range(32)]
    return [crowd, [(prefix, 1)], sharing, *alone, *hits, short]


Pass = tuple[list[tuple[int, int]], int]  # one forward of the draft: (cached, new) per row, logits rows
Step = tuple[list[tuple[int, int]], int, int, list[Pass], float]  # chunks, sampled rows, read again, draft, s


def measured_steps(level: str, model: str, dtype: str, cfg: dict) -> list[Step]:
    """Run the calibration mix on the real engine of `level`: per step (chunks, sampled rows, context
    tokens read again, the draft's forward passes, wall seconds). Level 4's step includes its draft's
    prompt chunks and guesses: each of their passes is recorded (the draft is another forward, with
    its own fixed cost: the fit gives it its own term)."""
    import importlib

    mod = importlib.import_module(level)
    shape = replace(ModelShape.from_hf(json.loads((Path(model) / "config.json").read_text())), dtype_bytes=4)
    budget = 24 * 600 * shape.kv_bytes_per_token  # 24 requests' worst case, in float32
    extra = {"speculative_config": spec_config(cfg)} if level == "level4_speculative" else {}
    llm = mod.LLM(model, dtype=dtype, kv_cache_memory=budget, max_model_len=-1, **extra)
    rounds = calibration_mix()
    llm.generate([[40] * 16], [exact(8)], progress=False)  # warm-up: first-call costs stay out
    engine, steps = llm.llm_engine, []
    if level == "level0_naive":  # no step(): its loop times each step for the stats; its forward says what ran
        inner_exec, inner_record = engine._execute, engine.stats.record_step
        shapes = []

        def execute(running, chunks):
            shapes.append(([(start, len(toks)) for toks, start in chunks], len(running), 0, []))  # slabs share nothing
            return inner_exec(running, chunks)

        def record(running, reserved, used, seconds):
            steps.append((*shapes[-1], seconds))
            return inner_record(running, reserved, used, seconds)

        engine._execute, engine.stats.record_step = execute, record
        for reqs in rounds:
            llm.generate([p for p, _ in reqs], [exact(n) for _, n in reqs], progress=False)
        return steps
    inner, passes = engine.schedule, []
    shapes = []

    def schedule(*args, **kwargs):
        out = inner(*args, **kwargs)
        shapes.append(([(r.num_computed_tokens, n) for r, n in out.scheduled],
                       sum(1 for r, n in out.scheduled if r.num_logits(n)), read_again(engine.kv, out.scheduled),
                       passes))  # fmt: skip
        return out

    engine.schedule = schedule
    if getattr(engine, "proposer", None) is not None and hasattr(engine.proposer, "worker"):
        draft = engine.proposer.worker
        inner_draft = draft.execute

        def draft_execute(inp):  # the batch says what the draft computed: new tokens and context per row
            new = (inp.query_start_loc[1:] - inp.query_start_loc[:-1]).tolist()
            passes.append(([(int(s) - n, n) for s, n in zip(inp.seq_lens.tolist(), new)], len(inp.logits_indices)))
            return inner_draft(inp)

        draft.execute = draft_execute
    for r, reqs in enumerate(rounds):
        for i, (prompt, n) in enumerate(reqs):
            engine.add_request(f"c{r}-{i}", prompt, exact(n))
        while engine.has_unfinished_requests():
            passes = []
            t0 = time.perf_counter()
            engine.step()
            steps.append((*shapes[-1], time.perf_counter() - t0))
    return steps


def nonnegative_lstsq(A: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """argmin |A x - b| with x >= 0, for a handful of columns: the best least-squares fit over every subset
    of columns allowed to be nonzero whose solution is nonnegative (a cost is never negative; an
    unconstrained fit trades a negative per-request cost against the others when they are collinear)."""
    import itertools

    n, best, best_err = A.shape[1], torch.zeros(A.shape[1], dtype=A.dtype), float((b**2).sum())
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            x = torch.linalg.lstsq(A[:, list(cols)], b[:, None]).solution[:, 0]
            if (x >= 0).all():
                err = float(((A[:, list(cols)] @ x - b) ** 2).sum())
                if err < best_err:
                    best, best_err = torch.zeros(n, dtype=A.dtype).index_put((torch.tensor(cols),), x), err
    return best


def calibrate(level: str, model: str, hw: Hardware, dtype: str = "float32", cfg: dict | None = None,
              repeats: int = 1) -> dict:  # fmt: skip
    """Fit what the roofline does not explain, wall - roofline = c0 + c1 * requests + c2 * new tokens + c3 *
    context tokens + c4 * context tokens read again + c5 * chunks after a prefix hit (+ d0 * draft passes +
    d1 * draft tokens at level 4),
    by least squares over the real engine's steps on the calibration mix (see the module docstring), each
    step's error relative to its time: a 3 ms decode alone counts as much as a 200 ms prefill. A level that
    shares no blocks has no c4 to fit: its shared tokens cost as others (c4 = c3). The roofline of a
    level-4 step counts its draft's passes too (the draft's shape on the same hardware). With `repeats`,
    the mix runs that many times and the fastest run is fitted, as the benchmark keeps its fastest repeat
    (a neighbour's load only slows a run down: both sides then see the least disturbed machine)."""
    shape = replace(ModelShape.from_hf(json.loads((Path(model) / "config.json").read_text())),
                    dtype_bytes=dtype_bytes(dtype))  # fmt: skip
    runs = [measured_steps(level, model, dtype, cfg or {}) for _ in range(repeats)]
    steps = min(runs, key=lambda run: sum(w for *_, w in run))
    draft = None
    if any(p for *_, p, _ in steps):
        draft_hf = json.loads((Path(spec_config(cfg or {})["model"]) / "config.json").read_text())
        draft = replace(ModelShape.from_hf(draft_hf), dtype_bytes=shape.dtype_bytes)
    X = torch.tensor([[1.0, len(c), sum(n for _, n in c), sum(a + n for a, n in c) - r, r,
                       len(p), sum(n for q, _ in p for _, n in q), cached_chunks(c)]
                      for c, _, r, p, _ in steps], dtype=torch.float64)  # fmt: skip
    roof = torch.tensor([step_cost(hw, shape, c, k, shared=r).total
                         + sum(step_cost(hw, draft, q, m).total for q, m in p) for c, k, r, p, _ in steps],
                        dtype=torch.float64)  # fmt: skip
    wall = torch.tensor([w for *_, w in steps], dtype=torch.float64)
    cols = [0, 1, 2, 3] + ([4] if X[:, 4].any() else []) + ([5, 6] if draft else []) + ([7] if X[:, 7].any() else [])
    coef = torch.zeros(8, dtype=torch.float64)  # (only the columns that occur are fitted)
    coef[cols] = nonnegative_lstsq(X[:, cols] / wall[:, None], (wall - roof) / wall)
    fit = roof + X @ coef
    c4 = coef[4].item() if 4 in cols else coef[3].item()
    return {"level": level, "c0_s": coef[0].item(), "c1_s": coef[1].item(), "c2_s": coef[2].item(), "c3_s": coef[3].item(),
            "c4_s": c4, "c5_s": coef[7].item(), "d0_s": coef[5].item(), "d1_s": coef[6].item(),
            "steps": len(steps), "wall_s": wall.sum().item(), "roofline_share": (roof.sum() / wall.sum()).item(),
            "fit_error": ((fit - wall).abs().sum() / wall.sum()).item()}  # fmt: skip


def predict(level: str, name: str, committed: dict, cfg: dict, cal: dict, model: str, dtype: str,
            hw: Hardware | None = None) -> dict:  # fmt: skip
    """One level on one committed workload, simulated with its calibration `cal` on this CPU (or on `hw`, a
    GPU's spec, uncalibrated: benchmarks/sim/gpu_check.py): output tokens/s and mean TTFT."""
    w, roof = committed["workloads"][name], roofline_of(committed, level)
    hw = hw or cpu_hardware(roof, cal)
    wl = make_workload(name, cfg["num_requests"], 259, cfg["seed"], cfg["quick"], tokenizer_encode(model))
    clock = SimClock()
    kw = dict(hardware=hw, clock=clock, dtype=dtype, kv_cache_memory=w["kv_cache_memory"],
              max_num_seqs=wl.max_num_seqs or cfg["max_num_seqs"], max_model_len=-1, keep_trace=True)  # fmt: skip
    if level == "level4_speculative":  # the guesses' acceptance is an input: the measured one, per position
        spec = committed_row(committed, name, level)["spec"]
        sc = spec_config(cfg)
        draft = replace(ModelShape.from_hf(json.loads((Path(sc["model"]) / "config.json").read_text())),
                        dtype_bytes=dtype_bytes(dtype))  # fmt: skip
        own = {"c0_s": cal["d0_s"], "c1_s": 0.0, "c2_s": cal["d1_s"], "c3_s": 0.0}  # the draft's terms: per pass, token
        kw.update(num_speculative_tokens=sc["num_speculative_tokens"], disable_by_batch_size=sc["disable_by_batch_size"],
                  alpha=conditional_alphas(spec["per_position"]), draft_shape=draft,
                  draft_hardware=cpu_hardware(roof, own))  # fmt: skip
    engine = LEVELS[level](model, **kw)
    seqs, rounds = [], iter(range(1 << 30))

    def serve(reqs, arrivals):  # the workload's requests (prompt, exact length) arriving at these times
        sim = [SimRequest(at, r.prompt, r.max_tokens) for r, at in zip(reqs, arrivals)]
        return play(engine, sim, lambda r: exact(r.output_len), prefix=f"t{next(rounds)}-")

    if wl.arrivals is not None:
        rate = reference_rate(w, level)
        seqs = serve(wl.first, [a / rate for a in wl.arrivals])
    else:

        def run_round(reqs):  # chat's turns: one round after another on the same engine
            done = serve(reqs, [clock.now] * len(reqs))
            seqs.extend(done)
            return [list(s.output_token_ids) for s in done]

        wl.play(run_round)
    out_tokens = sum(len(s.output_token_ids) for s in seqs)
    return {"output_tokens_per_s": out_tokens / clock.now,
            "ttft_s": statistics.mean(s.metrics.ttft for s in seqs), "steps": len(engine.worker.trace),
            "preemptions": engine.stats.preemptions}  # fmt: skip


def side_by_side(name: str, level: str, real: dict, sim: dict) -> dict:
    """One row of a validation table: the measured row's tokens/s, mean TTFT and steps beside the prediction's."""
    row = {"workload": name, "level": level, "real_tok_s": real["output_tokens_per_s"],
           "sim_tok_s": sim["output_tokens_per_s"], "real_ttft_s": real["ttft_s"]["mean"],
           "sim_ttft_s": sim["ttft_s"], "real_steps": real.get("steps"), "sim_steps": sim["steps"]}  # fmt: skip
    row["tok_s_error"] = row["sim_tok_s"] / row["real_tok_s"] - 1
    row["ttft_error"] = row["sim_ttft_s"] / row["real_ttft_s"] - 1
    return row


def row_line(row: dict, width: int = 14) -> str:
    """A `side_by_side` row as the tables print it: tokens/s and TTFT, measured, simulated, error."""
    return (f"{row['workload']:{width}s} {row['level']:18s} {row['real_tok_s']:10.0f} {row['sim_tok_s']:8.0f} "
            f"{100 * row['tok_s_error']:+6.1f}%   {row['real_ttft_s']:9.3f} {row['sim_ttft_s']:8.3f} "
            f"{100 * row['ttft_error']:+6.1f}%")  # fmt: skip


def summarise(rows: list[dict]) -> dict:
    """The median and the worst |error| of tokens/s and of TTFT over the rows."""
    tok = sorted(abs(r["tok_s_error"]) for r in rows)
    ttft = sorted(abs(r["ttft_error"]) for r in rows)
    return {"tok_s_median": statistics.median(tok), "tok_s_worst": tok[-1],
            "ttft_median": statistics.median(ttft), "ttft_worst": ttft[-1]}  # fmt: skip


def reference_rate(w: dict, level: str) -> float:
    """The poisson workload's rate for `level`: its own when each level was measured alone (`merge`)."""
    return w.get("reference_rates", {}).get(level, w["reference_rate"])


def roofline_of(committed: dict, level: str) -> dict:
    """The roofline the level's rows were measured with: its own when each level was measured alone."""
    return committed.get("rooflines", {}).get(level, committed["roofline"])


def committed_row(committed: dict, name: str, level: str) -> dict | None:
    w = committed["workloads"][name]
    if "sweep" in w:  # poisson: the committed row at the reference rate
        rows = [r for r in w["sweep"].get(level, []) if r["request_rate"] == reference_rate(w, level)]
        return rows[0] if rows else None
    return w["results"].get(level)


def measure_now(level: str, out: Path, threads: int, quick: bool = False, repeats: int = 1) -> dict:
    """The benchmark's workloads on this machine now for one level, the fastest of `repeats` runs each (no HF,
    no sweeps; poisson at 0.9x the level's own capacity, the harness's base when level 1 does not run, its
    least delayed of `repeats` runs): what the level's predictions are held against."""
    from benchmarks import throughput

    argv = ["--all", "--engines", level, "--hf-sweep", "none", "--rate-multiples", "0.9",
            "--threads", str(threads), "--repeats", str(repeats), "--no-progress", "--out", str(out)]  # fmt: skip
    throughput.main(argv + (["--quick"] if quick else []))
    return json.loads(out.read_text())


def merge(runs: dict[str, dict]) -> dict:
    """One results dict from runs that measured one level each: every level's rows, and beside them the
    poisson rate (`reference_rates`) and the roofline (`rooflines`) each level was measured with."""
    merged = copy.deepcopy(next(iter(runs.values())))
    merged["rooflines"] = {level: run["roofline"] for level, run in runs.items()}
    for level, run in runs.items():
        for name, w in run["workloads"].items():
            into = merged["workloads"][name]
            into["results"][level] = w["results"][level]
            if "sweep" in w:
                into["sweep"][level] = w["sweep"][level]
                into.setdefault("reference_rates", {})[level] = w["reference_rate"]
    return merged


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sim.validate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--results", default=None, help="a results JSON to predict (default: measure now; "
                   "benchmarks/results/latest.json is the committed run)")  # fmt: skip
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as the committed run)")
    p.add_argument("--quick", action="store_true", help="measure the benchmark's quick workloads (a smoke run)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each measurement and of each calibration, the "
                   "fastest kept (poisson's: the least delayed; default 2, about 25 minutes; 1 halves it, and a shared machine's drift shows)")  # fmt: skip
    p.add_argument("--out", default=None, help="the JSON (default: outside the repository; the committed one: "
                   "benchmarks/results/what_if_validation.json)")  # fmt: skip
    args = p.parse_args(argv)
    from ladder.cli import output_dir

    args.out = args.out or str(output_dir() / "what_if_validation.json")
    torch.set_num_threads(args.threads)
    committed = json.loads(Path(args.results).read_text()) if args.results else None
    cals, runs = {}, {}
    for level in LEVELS:
        if args.results is None:  # measured, then calibrated at once: the same minutes of a drifting machine
            runs[level] = measure_now(level, output_dir() / f"what_if_measured_{level}.json", args.threads,
                                      args.quick, args.repeats)  # fmt: skip
            torch.set_num_threads(args.threads)
        source = committed or runs[level]  # what this level's predictions are held against
        cfg = source["config"]
        model, dtype = cfg["model"], cfg["dtype"]
        if not Path(model, "config.json").is_file():  # the committed path is another checkout's: the same model here
            model = str(ROOT / "models" / cfg["model_name"])
        cals[level] = calibrate(level, model, cpu_hardware(roofline_of(source, level)), dtype, cfg, args.repeats)
    committed = committed or merge(runs)
    print("calibration on the real engines (the calibration mix; wall - roofline = c0 + c1 * requests + c2 * new tokens"
          " + c3 * context tokens + c4 * context tokens read again + c5 * chunks after a prefix hit, per step;"
          " level 4's draft: d0 a pass, d1 a token)")  # fmt: skip
    for level, cal in cals.items():
        draft = f" the draft {cal['d0_s'] * 1e3:.2f} ms a pass, {cal['d1_s'] * 1e6:.1f} us a token;"
        draft = draft if level == "level4_speculative" else ""
        print(f"  {level:18s} c0 {cal['c0_s'] * 1e3:5.2f} ms  c1 {cal['c1_s'] * 1e6:6.1f} us  c2 {cal['c2_s'] * 1e6:5.1f} us"
              f"  c3 {cal['c3_s'] * 1e9:5.0f} ns  c4 {cal['c4_s'] * 1e9:5.0f} ns  c5 {cal['c5_s'] * 1e3:5.2f} ms;"
              f"{draft} {cal['steps']} steps, the roofline explains {100 * cal['roofline_share']:.0f} % of their time,"
              f" the fit's error {100 * cal['fit_error']:.1f} %")  # fmt: skip
    rows = []
    print(f"\n{'workload':14s} {'level':18s} {'tok/s real':>10s} {'sim':>8s} {'err':>7s}   "
          f"{'TTFT real':>9s} {'sim':>8s} {'err':>7s}")  # fmt: skip
    for name in committed["workloads"]:
        for level in LEVELS:
            real = committed_row(committed, name, level)
            if real is None:
                continue
            row = side_by_side(name, level, real, predict(level, name, committed, cfg, cals[level], model, dtype))
            rows.append(row)
            print(row_line(row))
    summary = summarise(rows)
    print(f"\n|error| tokens/s: median {100 * summary['tok_s_median']:.1f} %, worst {100 * summary['tok_s_worst']:.1f} %;"
          f" TTFT: median {100 * summary['ttft_median']:.1f} %, worst {100 * summary['ttft_worst']:.1f} %"
          "  (goal: median <= 10 %, worst <= 20 %)")  # fmt: skip
    result = {"calibration": cals, "rows": rows, "summary": summary, "results": args.results or "measured now"}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"json: {args.out}")
    return result


if __name__ == "__main__":
    main()
