"""The GPU what-if (benchmarks/sim): the simulated engines decide as the real ones, and the clock is sane.

What it is:
  - levels 0, 2 and 3 on a random checkpoint, real and simulated, on one workload whose outputs
    are forced to the same lengths: the same requests in every step with the same token counts,
    the same preemptions, the same prefix hits (the simulator replaces the time, nothing else);
    level 5 with two pipeline stages (two rank processes) likewise, micro-batch by micro-batch;
  - the pipeline's stages overlap: N micro-batches in flight take N + pp - 1 stage times;
  - a shared prefix: the context tokens a step reads again (blocks another request read first)
    are counted, and cost what the hardware says (a CPU's cache: no bytes, the calibrated rate);
  - cost-model properties: a step grows with its tokens and its context, tensor parallelism
    shortens a large step and adds its all-reduces, pipeline parallelism adds its sends (and
    splits the weights: OPT-66B runs on four A100-40GBs), and a memory-bound batch-1 decode costs
    the weights' read (Llama-2-7B on an A100: 13.5 GB / 1.555 TB/s, about 8.7 ms);
  - Orca's contiguous reservations: the three sizes, and the external fragmentation of first fit;
  - the chat trace, closed loop: a turn's prompt is the previous exchange and the user's new tokens,
    sent its pause after the answer, and level 3 finds exactly the exchange's whole blocks cached;
  - `python -m benchmarks.simulate` on a small trace: vLLM sustains the highest rate, then Orca
    Oracle, Pow2, Max, and FasterTransformer, the paper's order.

What it is not: a check of the paper's figures (the closing note and docs/what_if.md report
them) or of the simulator's speed.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from dataclasses import replace
from pathlib import Path

import pytest
from test_equivalence import kv_bytes

import level0_naive
import level2_continuous
import level3_prefix
import level5_multigpu
from benchmarks.sim.clock import SimClock, SimStep, SimulatedExecutor
from benchmarks.sim.cost import Hardware, gpu, kv_budget, model_shape, repeated_context, step_cost, step_time
from benchmarks.sim.engines import SimulatedContinuous, SimulatedPipeline, SimulatedPrefix, SimulatedStatic
from benchmarks.sim.orca import ReservingKVCacheManager, next_power_of_two
from benchmarks.sim.serve import TURNS, make_engine, simulate, trace
from benchmarks.sim.serve import play as serve
from level0_naive import SamplingParams
from level2_continuous.request import Request

pytestmark = pytest.mark.bench

SHARED = list(range(10, 26))  # 16 tokens: four blocks of 4, shared by half the prompts


def workload(seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [((SHARED if i % 2 else []) + [rng.randrange(30, 60) for _ in range(rng.randint(2, 9))], rng.randint(3, 24))
            for i in range(10)]  # fmt: skip


def exact(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)


def record(engine) -> list[tuple]:
    """Every step's decision: (scheduled (id, tokens), preempted ids, prefix hits so far)."""
    steps, inner = [], engine.schedule

    def schedule(*args, **kwargs):
        out = inner(*args, **kwargs)
        hits = getattr(engine.kv, "hits", 0)
        steps.append(([(r.request_id, n) for r, n in out.scheduled], [r.request_id for r in out.preempted], hits))
        return out

    engine.schedule = schedule
    return steps


def play(engine, reqs, targets: dict | None = None) -> None:
    for i, (prompt, n) in enumerate(reqs):
        if targets is not None:
            targets[f"r{i}"] = n
        engine.add_request(f"r{i}", prompt, exact(n))
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("level,sim_class", [(level2_continuous, SimulatedContinuous), (level3_prefix, SimulatedPrefix)],
                         ids=["level2", "level3"])  # fmt: skip
def test_simulated_and_real_engines_make_the_same_decisions(llama_dir, level, sim_class):
    kw = dict(block_size=4, kv_cache_memory=kv_bytes(llama_dir, 4 * 14), max_num_batched_tokens=12, max_num_seqs=5)
    real = level.LLMEngine(llama_dir, dtype="float64", **kw)
    sim = sim_class(llama_dir, hardware=gpu("a100-40gb"), clock=SimClock(), dtype="float64", **kw)
    assert sim.num_blocks == real.num_blocks == 14
    want, got = record(real), record(sim)
    play(real, workload())
    play(sim, workload(), sim.targets)
    assert got == want
    assert real.stats.preemptions > 0, "the workload must preempt"
    if level is level3_prefix:
        assert real.kv.hits > 0, "and hit the prefix cache"
    assert sim.clock.now > 0 and sim.worker.steps == len(want)


def test_a_simulated_pipeline_makes_level5s_micro_batches(llama_dir):
    """Level 5 with two pipeline stages, real (two rank processes) and simulated: the same micro-batches
    (disjoint requests, two in flight), the same preemptions, in the same order."""
    kw = dict(block_size=4, max_num_batched_tokens=12, max_num_seqs=5, enable_prefix_caching=False)
    whole = kv_bytes(llama_dir, 4 * 14)  # each rank holds half the layers, so half the bytes a token
    with level5_multigpu.LLM(llama_dir, dtype="float64", pipeline_parallel_size=2, kv_cache_memory=whole // 2,
                             **kw) as llm:  # fmt: skip
        real = llm.llm_engine
        want = record(real)
        play(real, workload())
    sim = SimulatedPipeline(llama_dir, hardware=gpu("a100-40gb"), clock=SimClock(), dtype="float64", pp=2,
                            kv_cache_memory=whole, **kw)  # fmt: skip
    got = record(sim)
    play(sim, workload(), sim.targets)
    assert sim.num_blocks == real.num_blocks == 14
    assert got == want
    assert real.stats.preemptions > 0, "the workload must preempt"
    scheduled = [ids for ids, _, _ in want if ids]  # (an empty one: the pipeline could not be filled)
    disjoint = [not {r for r, _ in a} & {r for r, _ in b} for a, b in zip(scheduled, scheduled[1:])]
    assert sum(disjoint) > len(disjoint) / 2, "two micro-batches in flight: the next one shares no request"
    assert sim.worker.steps == len(scheduled)
    # one stage: level 3's engine (here without caching), decision for decision and second for second
    flat, ref = (cls(llama_dir, hardware=gpu("a100-40gb"), clock=SimClock(), dtype="float64", kv_cache_memory=whole, **kw)
                 for cls in (SimulatedPipeline, SimulatedPrefix))  # fmt: skip
    decisions = [record(flat), record(ref)]
    for engine in (flat, ref):
        play(engine, workload(), engine.targets)
    assert decisions[0] == decisions[1] and flat.clock.now == ref.clock.now


def test_pipeline_stages_overlap_their_micro_batches_as_gpipe_draws_them():
    """N equal micro-batches over pp stages (no sends, no overhead, no LM head) take (N + pp - 1) stage times
    when they are all in flight, and N * pp when each is waited for before the next (a level that calls
    `execute`): the bubble is pp - 1 stage times, whatever N. With the sends, the LM head and the driver's
    overhead: one at a time, each step costs its whole `step_cost` (sends included); all in flight, the first
    finishes at that cost (or when the driver is done submitting) and the others one period apart, the
    period being the slower of the last stage (its layers and the LM head) and the driver (its overhead a
    step)."""
    shape, step, n = model_shape("llama-2-13b"), SimStep([(500, 1)] * 8, 0), 6
    bare = replace(gpu("a100-40gb"), step_overhead_s=0.0, link_latency_s=0.0, link_bytes_per_s=1e30)
    cost = step_cost(bare, shape, step.chunks, 0)
    for pp in (2, 4):
        stage = (cost.linear + cost.attention) / pp
        piped, serial = (SimulatedExecutor(1, bare, shape, SimClock(), pp=pp) for _ in range(2))
        for _ in range(n):
            piped.submit(step)
            serial.execute(step)
        for _ in range(n):
            piped.collect()
        assert piped.clock.now == pytest.approx((n + pp - 1) * stage)
        assert serial.clock.now == pytest.approx(n * pp * stage) and piped.steps == serial.steps == n
    sampled = SimStep([(500, 1)] * 8, 8)  # the LM head on the last stage
    for overhead in (2e-3, 50e-3):  # the last stage is the bottleneck; then the driver is
        hw = replace(bare, step_overhead_s=overhead)
        whole = step_cost(hw, shape, sampled.chunks, 8, pp=2)
        period = max(overhead, (whole.linear + whole.attention) / 2 + whole.lm_head)
        piped, serial = (SimulatedExecutor(1, hw, shape, SimClock(), pp=2) for _ in range(2))
        for _ in range(n):
            piped.submit(sampled)
            serial.execute(sampled)
        piped.collect()  # (the driver has paid n overheads to submit them all)
        assert piped.clock.now == pytest.approx(max(whole.total, n * overhead))
        for _ in range(n - 1):
            piped.collect()
        assert piped.clock.now == pytest.approx(whole.total + (n - 1) * period)
        assert serial.clock.now == pytest.approx(n * whole.total)
    linked = gpu("a100-40gb")  # NVLink's sends between the stages (not inside them), and its overhead
    whole = step_cost(linked, shape, sampled.chunks, 8, pp=4)
    assert whole.send > 0 and whole.comm == pytest.approx(3 * whole.send)
    period = max(whole.overhead, (whole.linear + whole.attention) / 4 + whole.lm_head)
    piped, serial = (SimulatedExecutor(1, linked, shape, SimClock(), pp=4) for _ in range(2))
    for _ in range(n):
        piped.submit(sampled)
        serial.execute(sampled)
    for _ in range(n):
        piped.collect()
    assert serial.clock.now == pytest.approx(n * whole.total)
    assert piped.clock.now == pytest.approx(whole.total + (n - 1) * period)
    assert isinstance(make_engine("vllm", "opt-13b", gpu("a100-40gb"), SimClock(), pp=2), SimulatedPipeline)


def test_simulated_static_batches_are_level0s(llama_dir):
    """FasterTransformer is level 0: the same batches (who runs each step, with how many new tokens)."""
    reqs = workload(1)
    budget = kv_bytes(llama_dir, 3 * 40)  # about three requests' slabs at a time
    real = level0_naive.LLM(llama_dir, dtype="float64", kv_cache_memory=budget)
    seen, inner = [], real.llm_engine._execute

    def execute(running, chunks):
        seen.append([(start, len(toks)) for toks, start in chunks])
        return inner(running, chunks)

    real.llm_engine._execute = execute
    real.generate([p for p, _ in reqs], [exact(n) for _, n in reqs], progress=False)
    sim = SimulatedStatic(llama_dir, hardware=gpu("a100-40gb"), clock=SimClock(), dtype="float64", kv_cache_memory=budget)
    seqs = []
    for i, (p, n) in enumerate(reqs):
        sim.targets[f"r{i}"] = n
        seqs.append(sim.inputs.make_group(p, exact(n), request_id=f"r{i}")[0])
        seqs[-1].metrics.arrival_time = 0.0
    steps, inner_sim = [], sim.worker.execute
    sim.worker.execute = lambda step: (steps.append(step.chunks), inner_sim(step))[1]
    from ladder.progress import GenerateProgress

    sim.run(seqs, GenerateProgress(len(seqs), enabled=False))
    assert steps == seen and len({len(s) for s in seen}) > 1  # batches of several sizes
    assert [len(s.output_token_ids) for s in seqs] == [n for _, n in reqs]


def test_a_step_costs_more_with_tokens_and_context_and_less_with_tp():
    hw, shape = gpu("a100-80gb"), model_shape("llama-2-13b")
    decode = step_time(hw, shape, [(500, 1)] * 8, 8)
    assert step_time(hw, shape, [(500, 1)] * 8 + [(0, 1024)], 9) > decode  # a prefill joins the batch
    assert step_time(hw, shape, [(1500, 1)] * 8, 8) > decode  # longer contexts: more KV to read
    assert step_time(hw, shape, [(0, 4096)], 1) > step_time(hw, shape, [(0, 1024)], 1)  # compute-bound prefill
    big = [(0, 2048)] * 2
    tp1, tp2, tp4 = (step_cost(hw, shape, big, 2, tp) for tp in (1, 2, 4))
    assert tp1.total > tp2.total > tp4.total  # a large step splits across ranks ...
    assert tp1.comm == 0 < tp2.comm < tp4.comm  # ... and pays for its all-reduces
    pp2 = step_cost(hw, shape, big, 2, 1, pp=2)  # stages one after another: the same work, plus one send
    assert pp2.linear == tp1.linear and pp2.attention == tp1.attention and 0 < pp2.comm < tp2.comm
    opt66 = model_shape("opt-66b")  # too big for one A100-40GB, fine over four as TP 2 x PP 2
    assert simulate("vllm", trace("alpaca", 30, rate=math.inf), model="opt-66b", tp=2, pp=2).requests == 30
    assert kv_budget(gpu("a100-40gb"), opt66, 4) > 0


def test_a_shared_prefix_is_read_once_where_the_cache_holds_it():
    # Blocks 0 and 1 (a 32-token prefix) in both tables: the second request reads them again; a
    # third request's last block is shared but only 3 of its tokens are context.
    assert repeated_context([[0, 1, 2], [0, 1, 5], [7]], [40, 36, 3], 16) == 32
    assert repeated_context([[0, 1, 2], [0, 1, 5], [0]], [40, 36, 3], 16) == 32 + 3
    assert repeated_context([[0, 1], [2, 3]], [20, 20], 16) == 0  # nothing shared
    assert repeated_context([[0, 1, 2, 3]], [20], 16) == 0  # blocks past the context are not read
    shape = model_shape("llama-2-7b")
    decodes = [(400, 1)] * 64
    gpu_hw, cpu_like = gpu("a100-80gb"), Hardware("cpu", 1e11, 2e10, 1 << 40, kv_reuse=True, context_overhead_s=1e-6,
                                                  shared_context_overhead_s=2e-7)  # fmt: skip
    for hw in (gpu_hw, cpu_like):
        alone, shared = step_cost(hw, shape, decodes, 64), step_cost(hw, shape, decodes, 64, shared=63 * 384)
        if hw.kv_reuse:  # the 63 later readers of a 384-token prefix find it in the cache ...
            assert shared.attention < alone.attention and shared.overhead < alone.overhead
            assert alone.overhead - shared.overhead == pytest.approx(63 * 384 * (1e-6 - 2e-7))
        else:  # ... a GPU's paged attention reads it from HBM per request: the same cost
            assert shared.total == alone.total


def test_a_chunk_after_a_prefix_hit_pays_its_own_row_cost():
    """A CPU's attention sends a query of more than LONG_QUERY tokens over a longer cache to SDPA alone, row by
    row: the cost model charges such a row `cached_chunk_overhead_s`, and no other kind of row."""
    from benchmarks.sim.cost import CACHED_CHUNK
    from features.cpu_kernels.attention import LONG_QUERY

    assert CACHED_CHUNK == LONG_QUERY  # the model follows the backend's rule
    shape, per_row = model_shape("llama-2-7b"), 5e-4
    hw = Hardware("cpu", 1e11, 2e10, 1 << 40, kv_reuse=True, cached_chunk_overhead_s=per_row)
    plain = replace(hw, cached_chunk_overhead_s=0.0)
    rows = {"chunk after a hit": (384, 20), "decode": (400, 1), "verification": (400, 8), "prefill": (0, 300),
            "chunk longer than its cache": (100, 200)}  # fmt: skip
    charged = {k: step_cost(hw, shape, [r], 1).overhead - step_cost(plain, shape, [r], 1).overhead for k, r in rows.items()}
    assert charged == pytest.approx({k: per_row if k == "chunk after a hit" else 0.0 for k in rows})
    batch = [(384, 20)] * 3 + [(400, 1)] * 5
    assert step_cost(hw, shape, batch, 8).overhead - step_cost(plain, shape, batch, 8).overhead == pytest.approx(3 * per_row)


def test_a_batch_one_decode_reads_the_weights():
    """Memory-bound: one token's step is the weights over the bandwidth (plus a little KV and activation)."""
    shape = model_shape("llama-2-7b")
    hw = Hardware("ideal A100", 312e12, 1.555e12, 40 << 30, compute_efficiency=1.0, memory_efficiency=1.0,
                  step_overhead_s=0.0)  # fmt: skip
    weights = shape.weight_bytes - shape.vocab * shape.hidden * shape.dtype_bytes  # the embedding is not read whole
    t = step_time(hw, shape, [(128, 1)], 1)
    assert t == pytest.approx(weights / hw.bytes_per_s, rel=0.01)
    assert 8.0e-3 < t < 9.0e-3  # 6.7 B parameters in bf16 over 1.555 TB/s


def test_the_weights_are_read_at_their_own_rate_where_a_cache_holds_them():
    """A CPU's calibration reads the weights at the rate measured at their size (`weight_bytes_per_s`) and the
    KV at DRAM's: a memory-bound decode's weights cost half at twice the rate; its KV reads, the attention,
    cost what they did; the validation's hardware takes the rate from the results' roofline."""
    from benchmarks.sim.validate import cpu_hardware

    shape = model_shape("llama-2-7b")
    dram = Hardware("cpu", 1e15, 1e11, 1 << 40, compute_efficiency=1.0, memory_efficiency=1.0, step_overhead_s=0.0)
    cached = replace(dram, weight_bytes_per_s=2e11)
    rows = [(4000, 1)]  # one decode over a long context: weights and KV both read
    a, b = step_cost(dram, shape, rows, 1), step_cost(cached, shape, rows, 1)
    weights = shape.num_layers * shape.layer_params * shape.dtype_bytes
    assert a.linear - b.linear == pytest.approx(weights / 1e11 / 2, rel=1e-9)  # the activations' bytes: DRAM's
    assert b.attention == a.attention > 0 and b.lm_head == pytest.approx(a.lm_head / 2)
    roof = {"sweep": [{"batch": 1, "flops_per_s": 1e10}], "bandwidth": 1e10}
    assert cpu_hardware(roof).weight_bytes_per_s is None  # a results JSON from before the field: the KV's rate
    assert cpu_hardware(dict(roof, weight_bandwidth=3e10)).weight_bytes_per_s == 3e10


def test_the_weights_read_rate_is_measured_at_their_size_up_to_the_cap(monkeypatch):
    from benchmarks import roofline

    sizes = []
    monkeypatch.setattr(roofline, "read_bandwidth", lambda nbytes, device: sizes.append(nbytes) or 1e10)
    roofline.weight_bandwidth(24 << 20)
    roofline.weight_bandwidth(13 << 30)  # a 7B model in bfloat16: no cache holds it, DRAM's rate at the cap
    assert sizes == [24 << 20, roofline.DRAM_PROBE_BYTES] and roofline.DRAM_PROBE_BYTES == 256 << 20


def test_the_calibration_mix_decodes_many_short_requests_at_once():
    """The validation's fit sees large batches over short contexts, where `uniform` and `poisson` decode, and
    not only over the first crowd's long ones: with those alone a request's fixed cost and its context's
    rise together and the fit cannot tell them apart (level 0 then undercharged `poisson`'s decodes)."""
    from benchmarks.sim.validate import calibration_mix

    rounds = calibration_mix()
    assert max(len(r) for r in rounds if max(len(p) + n for p, n in r) <= 150) >= 32
    assert calibration_mix() == rounds  # seeded: every calibration fits the same requests


def test_the_kv_budget_is_what_utilization_leaves():
    hw, shape = gpu("a100-40gb"), model_shape("opt-13b")
    budget = kv_budget(hw, shape, gpu_memory_utilization=0.9, activation_reserve=0.05)
    assert budget == int(hw.memory_bytes * 0.85 - shape.weight_bytes)
    assert kv_budget(hw, shape, tp=2) > 2 * budget  # half the weights each: more than twice the room
    with pytest.raises(ValueError, match="does not fit"):
        kv_budget(hw, model_shape("opt-66b"))


def test_orca_reserves_max_pow2_or_oracle_and_first_fit_fragments():
    assert [next_power_of_two(n) for n in (1, 2, 3, 200, 256, 257)] == [1, 2, 4, 256, 256, 512]
    kv = ReservingKVCacheManager(100, reserve=lambda r: r.size)
    reqs = []
    for i, size in enumerate([30, 40, 30]):
        r = Request(i, f"r{i}", 0, None, [1], exact(1), 100, [], None)
        r.size = size
        reqs.append(r)
        assert kv.allocate_slots(r, 1, [])
    kv.free(reqs[0])
    kv.free(reqs[2])  # 60 tokens free in all, but as holes of 30 and 30
    wide = Request(3, "r3", 0, None, [1], exact(1), 100, [], None)
    wide.size = 50
    assert kv.num_free_blocks == 60 and not kv.allocate_slots(wide, 1, [])  # external fragmentation
    wide.size = 30
    assert kv.allocate_slots(wide, 1, []) and kv.regions[3] == (0, 30)  # first fit: the lowest hole


def test_the_papers_order_at_one_rate():
    """300 ShareGPT-like requests at 1.5 req/s on an A100-40GB with OPT-13B: normalized latency and the KV
    memory holding tokens rank the systems as the paper does (vLLM, Orca Oracle, Pow2, Max, FasterTransformer)."""
    reqs = trace("sharegpt", 300, rate=1.5)
    runs = [simulate(s, reqs, rate=1.5) for s in ("vllm", "orca-oracle", "orca-pow2", "orca-max", "ft")]
    latency = [r.normalized_latency for r in runs]
    assert latency == sorted(latency), latency
    held = [r.kv_token_share for r in runs]
    assert held == sorted(held, reverse=True) and held[0] > 0.9, held


def test_the_command_writes_its_table(tmp_path):
    import benchmarks.simulate as cli

    out = cli.main(["--trace", "alpaca", "--requests", "40", "--points", "2", "--tp", "1", "2", "--pp", "1", "2",
                    "--link-gbytes", "25", "--out", str(tmp_path / "a.json"), "--img-dir", str(tmp_path)])  # fmt: skip
    assert set(out["sustainable"]) == {"vllm", "orca-oracle", "orca-pow2", "orca-max", "ft"}
    assert all(r > 0 for r in out["sustainable"].values())
    assert [(c["tp"], c["pp"]) for c in out["capacity"]] == [(1, 1), (2, 1), (1, 2), (2, 2)]
    assert all(c["rate_per_replica"] > 0 for c in out["capacity"]) and out["link_bytes_per_s"] == 25e9
    assert json.loads((tmp_path / "a.json").read_text())["capacity"] == out["capacity"]
    assert (tmp_path / "what_if_a100-40gb_opt-13b_alpaca.png").stat().st_size > 10_000


def test_levels_measured_alone_keep_their_own_rate_and_roofline():
    """`validate.merge`: runs that measured one level each (each then calibrated at once) become one results
    dict in which each level's poisson row is the one at its own rate and its roofline is its own."""
    from benchmarks.sim import validate

    def run(level, rate, flops):
        return {"config": {}, "roofline": {"flops": flops},
                "workloads": {"uniform": {"results": {level: {"tok": flops}}},
                              "poisson": {"reference_rate": rate, "results": {level: {"request_rate": rate}},
                                          "sweep": {level: [{"request_rate": 0.5}, {"request_rate": rate, "of": level}]}}}}  # fmt: skip

    merged = validate.merge({"a": run("a", 1.5, 10), "b": run("b", 3.0, 20)})
    for level, rate, flops in (("a", 1.5, 10), ("b", 3.0, 20)):
        assert validate.committed_row(merged, "poisson", level) == {"request_rate": rate, "of": level}
        assert validate.committed_row(merged, "uniform", level) == {"tok": flops}
        assert validate.roofline_of(merged, level) == {"flops": flops}
    assert validate.committed_row(merged, "poisson", "c") is None


def test_traces_have_the_papers_means():
    for name, (p, o) in {"sharegpt": (161, 338), "alpaca": (19, 58)}.items():
        reqs = trace(name, 2000, rate=1.0)
        assert abs(sum(len(r.prompt) for r in reqs) / 2000 - p) < 0.02 * p
        assert abs(sum(r.output_len for r in reqs) / 2000 - o) < 0.02 * o
        assert all(len(r.prompt) + r.output_len <= 2048 for r in reqs)
    arrivals = [r.arrival for r in trace("alpaca", 2000, rate=5.0)]
    assert arrivals == sorted(arrivals) and abs(arrivals[-1] / 2000 - 0.2) < 0.02  # Poisson at 5 req/s
    result = simulate("vllm", trace("alpaca", 50, rate=math.inf, vocab=32000), model="llama-2-7b")
    assert result.requests == 50 and result.kv_token_share > 0.5 and result.preemptions == 0


def test_a_conversations_next_turn_follows_its_answer():
    """chat, closed loop: each turn's prompt is the previous turn's prompt + its answer + the user's new
    tokens, sent the user's pause after that answer ended; level 3 finds the previous exchange in its
    cache; a static engine, which takes its workload up front, refuses."""
    convs = trace("chat", 8 * TURNS, rate=4.0, vocab=32000)
    turns = 0
    for c in convs:
        t, used = c, 0
        while t is not None:  # each turn: its user tokens (the system prompt's too) and its answer
            turns, used, t = turns + 1, used + len(t.prompt) + t.output_len, t.then
        assert used <= 2048  # a conversation ends before it would outgrow the model
    assert len(convs) == 8 and TURNS < turns <= 8 * TURNS
    for system in ("vllm", "vllm-prefix"):
        engine = make_engine(system, "llama-2-7b", gpu("a100-80gb"), SimClock())
        seqs = serve(engine, convs, lambda r: SamplingParams(max_tokens=2048 - len(r.prompt), temperature=0.0))
        assert len(seqs) == turns and all(len(s.output_token_ids) for s in seqs)
        held = 0  # the previous exchanges' whole blocks, which level 3 should find in its cache
        for first in convs:
            turn, seq = first, next(s for s in seqs if s.prompt_token_ids == first.prompt)
            while turn.then is not None:
                turn = turn.then
                exchange = seq.prompt_token_ids + seq.output_token_ids
                nxt = next(s for s in seqs if s.prompt_token_ids == exchange + turn.prompt)
                assert nxt.metrics.arrival_time == pytest.approx(seq.metrics.finished_time + turn.arrival)
                assert len(nxt.output_token_ids) == turn.output_len
                held += (len(exchange) - 1) // engine.config.cache.block_size * engine.config.cache.block_size  # (no K/V yet
                # for the answer's last token: it was sampled, never fed back)
                seq = nxt
        if system == "vllm-prefix":  # (80 GB: room for every conversation, nothing evicted)
            assert engine.kv.hits == held > 0
    with pytest.raises(ValueError, match="static"):
        serve(make_engine("ft", "llama-2-7b", gpu("a100-80gb"), SimClock()), convs, lambda r: exact(4))


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_simulated_speculation_accepts_at_alpha_per_position(alpha):
    """Level 4's engine with guesses accepted with probability alpha each: outputs keep their lengths,
    P(the first i guesses accepted) is alpha ** i, and a step emits (1 - alpha ** (k + 1)) / (1 - alpha) tokens."""
    from benchmarks.sim.engines import SimulatedSpeculative

    k, target = 3, 200
    e = SimulatedSpeculative("llama-2-7b", hardware=gpu("a100-80gb"), clock=SimClock(), kv_cache_memory=8 << 30,
                             num_speculative_tokens=k, alpha=alpha, seed=1)  # fmt: skip
    for i in range(6):
        e.targets[f"r{i}"] = target
        e.add_request(f"r{i}", list(range(5, 40)), SamplingParams(max_tokens=1000, temperature=0.0))
    groups = dict(e.requests)
    while e.has_unfinished_requests():
        e.step()
    assert all(len(g[0].output_token_ids) == target for g in groups.values())
    per_pos = e.spec_stats.per_position()
    for i, p in enumerate(per_pos, start=1):
        assert p == pytest.approx(alpha**i, abs=0.05)
    want = (k + 1) if alpha == 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    assert e.spec_stats.mean_acceptance_length == pytest.approx(want, rel=0.06)


def test_a_simulated_draft_takes_its_share_of_the_kv_budget(llama_dir, checkpoint_factory):
    """Level 4 with a draft model splits the budget between the two caches; the simulated one, given the
    draft's shape, holds the same number of blocks."""
    import level4_speculative
    from benchmarks.sim.cost import ModelShape
    from benchmarks.sim.engines import SimulatedSpeculative

    draft = checkpoint_factory("llama", seed=7, hidden_size=32, head_dim=8, num_hidden_layers=1)
    budget = kv_bytes(llama_dir, 4 * 40)
    real = level4_speculative.LLMEngine(llama_dir, dtype="float64", block_size=4, kv_cache_memory=budget,
                                        speculative_config={"model": str(draft), "num_speculative_tokens": 2})  # fmt: skip
    shape = ModelShape.from_hf(json.loads((draft / "config.json").read_text()))
    sim = SimulatedSpeculative(llama_dir, hardware=gpu("a100-40gb"), clock=SimClock(), dtype="float64", block_size=4,
                               kv_cache_memory=budget, num_speculative_tokens=2, draft_shape=shape)  # fmt: skip
    alone = SimulatedSpeculative(llama_dir, hardware=gpu("a100-40gb"), clock=SimClock(), dtype="float64",
                                 block_size=4, kv_cache_memory=budget, num_speculative_tokens=2)  # fmt: skip
    assert sim.num_blocks == real.num_blocks < alone.num_blocks == 40


def test_a_simulated_draft_runs_the_real_drafts_passes(llama_dir):
    """Level 4 with the target as its own draft (every greedy guess accepted) against the simulated one at
    alpha 1: the same steps, and one draft pass on the clock for each forward the real draft ran (its
    prompt chunks and k guesses): what the validation's calibration charges each pass for."""
    import level4_speculative
    from benchmarks.sim.cost import ModelShape
    from benchmarks.sim.engines import SimulatedSpeculative

    kw = dict(dtype="float64", block_size=4, kv_cache_memory=kv_bytes(llama_dir, 4 * 60), max_num_seqs=3)
    real = level4_speculative.LLMEngine(llama_dir, speculative_config={"model": llama_dir, "num_speculative_tokens": 2},
                                        **kw)  # fmt: skip
    passes, inner = [], real.proposer.worker.execute
    real.proposer.worker.execute = lambda inp: passes.append(len(inp.seq_lens)) or inner(inp)
    pass_cost = 1000.0  # seconds a draft pass: the clock counts them (everything else costs milliseconds)
    shape = ModelShape.from_hf(json.loads((Path(llama_dir) / "config.json").read_text()))
    sim = SimulatedSpeculative(llama_dir, hardware=gpu("a100-40gb"), clock=SimClock(), num_speculative_tokens=2,
                               alpha=1.0, draft_shape=shape, draft_hardware=gpu("a100-40gb", step_overhead_s=pass_cost),
                               **kw)  # fmt: skip
    want, got = record(real), record(sim)
    reqs = workload(2)[:6]
    play(real, reqs)
    play(sim, reqs, sim.targets)
    assert real.spec_stats.per_position() == [1.0, 1.0], "the target drafting for itself: every guess accepted"
    assert got == want
    assert len(passes) > len(want) and int(sim.clock.now // pass_cost) == len(passes)


def test_the_gpu_check_measures_and_predicts_the_same_run(tmp_path):
    """`python -m benchmarks.sim.gpu_check` (the device script's second step) dry-run on this CPU: it builds
    its model, measures HF and levels 0-3 through the benchmark, and simulates levels 0, 2 and 3 on the
    very workload it measured, with the same decisions (as many steps as the real engines took)."""
    from benchmarks.sim import gpu_check

    parts = "model,throughput,predict,throughput_level1"  # the correctness parts run in tests/test_gpu_check.py
    result = gpu_check.main(["--device", "cpu", "--small", "--out", str(tmp_path), "--parts", parts])
    rows = {r["level"]: r for r in result["rows"]}
    assert set(rows) == set(gpu_check.SIMULATED)
    for r in rows.values():
        assert r["real_steps"] == r["sim_steps"] > 0, r
        assert r["real_tok_s"] > 0 and r["sim_tok_s"] > 0 and r["sim_ttft_s"] > 0
    measured = json.loads(Path(result["measured"]).read_text())
    assert set(measured["workloads"]["uniform"]["results"]) >= set(gpu_check.MEASURED)
    assert measured["config"]["dtype"] == "bfloat16"
    assert json.loads((tmp_path / "gpu_check.json").read_text())["rows"] == result["rows"]


# --- disaggregated prefill and decode (benchmarks/sim/disagg.py) ----------------------------------------


def test_a_disaggregated_request_crosses_the_link_once_and_its_tokens_come_after():
    """One request alone: its first token when the prefill engine's step ends, then the link's time
    (prompt bytes / bandwidth + latency, nothing else differs between two links), then the decode
    engine's steps: the slow link's request ends exactly that much later, its TTFT unchanged."""
    from benchmarks.sim.disagg import LINKS, disaggregated

    (r,) = trace("sharegpt", 1, 1.0, seed=3)
    fast, slow = (disaggregated([r], "opt-13b", "a100-80gb", link)[0] for link in ("nvlink", "100gbps"))
    assert fast.ttft == slow.ttft > 0 and fast.output_len == slow.output_len == r.output_len
    per_token = model_shape("opt-13b").kv_bytes_per_token
    crossing = {k: LINKS[k][1] + len(r.prompt) * per_token / LINKS[k][0] for k in ("nvlink", "100gbps")}
    assert slow.finished - fast.finished == pytest.approx(crossing["100gbps"] - crossing["nvlink"], rel=1e-6)
    assert fast.finished > fast.first_token + crossing["nvlink"]  # every later token is the decode engine's


def test_goodput_is_a_rate_that_meets_the_slos_and_v0_stalls_decodes_for_prompts():
    from benchmarks.sim.disagg import attainment, colocated, goodput

    reqs = trace("sharegpt", 60, 4.0, seed=1)
    rate, att = goodput(lambda r: colocated(r, "opt-13b", "a100-80gb"), 1, 0.25, 0.1, 60, seed=1, rounds=4)
    assert att >= 0.9 and rate > 0
    assert attainment(colocated(trace("sharegpt", 60, rate, seed=1), "opt-13b", "a100-80gb"), 0.25, 0.1) == att
    v1, v0 = colocated(reqs, "opt-13b", "a100-80gb"), colocated(reqs, "opt-13b", "a100-80gb", v0=True)
    assert [t.output_len for t in v1] == [t.output_len for t in v0] == [r.output_len for r in reqs]
    assert max(t.tpot for t in v0) > max(t.tpot for t in v1)  # a decode waits for whole prompts in V0


def test_the_summarization_workload_is_longbench_cut_as_distserve_cut_it():
    """Prompts mean 1,738 tokens and answers 91 (DistServe's figure 7), each prompt within the artifact's cut
    (a random 1,900-2,048, and 2,040 - the answer); the sharegpt workload is serve.py's sharegpt trace."""
    from benchmarks.sim.disagg import LONGBENCH, requests

    reqs = requests("summarization", 2000, 2.0, seed=5)
    prompts, answers = [len(r.prompt) for r in reqs], [r.output_len for r in reqs]
    assert sum(prompts) / len(reqs) == pytest.approx(LONGBENCH[0], rel=0.01)
    assert sum(answers) / len(reqs) == pytest.approx(LONGBENCH[1], rel=0.02)
    assert max(p + a for p, a in zip(prompts, answers)) <= 2040 and max(prompts) <= 2048 and min(answers) >= 1
    assert sum(p >= 1900 for p in prompts) > len(reqs) / 2  # most documents are longer than the cut
    assert [(r.arrival, r.prompt, r.output_len) for r in requests("sharegpt", 30, 2.0, seed=5)] == \
        [(r.arrival, r.prompt, r.output_len) for r in trace("sharegpt", 30, 2.0, seed=5)]  # fmt: skip


def test_the_summarization_comparison_runs_with_distserves_placements():
    """A quick run of `--workload summarization`: OPT-66B, vLLM on 4 GPUs, 4 prefill GPUs and a decode engine
    of TP=2 x PP=2, each system's goodput a rate that meets its SLOs."""
    from benchmarks.sim.disagg import main

    out = main(["--workload", "summarization", "--links", "nvlink", "--requests", "16"])
    a = out["args"]
    assert (a["model"], a["ttft_slo"], a["tpot_slo"], a["colocated_tp"], a["prefill_tp"], a["decode_tp"],
            a["decode_pp"]) == ("opt-66b", 15.0, 0.15, 4, 4, 2, 2)  # fmt: skip
    assert [r["gpus"] for r in out["rows"]] == [4, 4, 8]
    assert all(r["goodput_per_gpu"] > 0 and r["attainment"] >= 0.9 for r in out["rows"])


def test_the_chatbot_workload_draws_distserves_sharegpt_lengths():
    """Prompts and outputs drawn from the quantiles of DistServe's own ShareGPT requests: the draws' medians are the
    data's (680 and 76 tokens), the workload's prompts mean the data's 759, its outputs 191 (the data's 186, and the
    top twentieth drawn evenly up to 1,809, then cut), and every request fits OPT's 2,048 positions."""
    from benchmarks.sim.disagg import CHATBOT_OUTPUT, CHATBOT_PROMPT, quantile_draw, requests

    rng = random.Random(2)
    for quantiles in (CHATBOT_PROMPT, CHATBOT_OUTPUT):
        draws = sorted(quantile_draw(rng, quantiles) for _ in range(40_000))
        assert draws[len(draws) // 2] == pytest.approx(quantiles[10], rel=0.03)
        assert draws[len(draws) // 20] == pytest.approx(quantiles[1], rel=0.15, abs=1)
        assert min(draws) == max(1, quantiles[0]) and max(draws) == quantiles[-1]
    reqs = requests("chatbot", 4000, 3.0, seed=2)
    assert sum(len(r.prompt) for r in reqs) / len(reqs) == pytest.approx(759, rel=0.03)
    assert sum(r.output_len for r in reqs) / len(reqs) == pytest.approx(191, rel=0.06)
    assert max(len(r.prompt) + r.output_len for r in reqs) <= 2048 and min(r.output_len for r in reqs) >= 1
    assert {quantile_draw(rng, (5, 5)) for _ in range(20)} == {5}  # a point mass stays one


def test_the_fit_recovers_the_speeds_that_made_the_latencies(tmp_path):
    """distserve_fit on requests made by the cost model itself at known efficiencies and client time gives them
    back, though a twin of every request waited 0.3 s longer for its first token (the fit reads the fastest of
    each band) and a third of them decoded 3x slower (it reads the median TPOT, and Little's law counts each
    request's output after its first token); its reader takes a ground-truth file (a list, then a summary)."""
    from benchmarks.sim.cost import step_time
    from benchmarks.sim.distserve_fit import decode_load, fit, load

    shape, true = model_shape("opt-13b"), replace(gpu("a100-80gb"), compute_efficiency=0.61, memory_efficiency=0.47)
    rng, recs = random.Random(4), []
    for _ in range(150):
        p, out = rng.randint(10, 2000), rng.randint(21, 40)
        ttft = 1e3 * (0.017 + step_time(true, shape, [(0, p)], 1, 2))
        recs += [{"prompt_len": p, "output_len": out, "ttft_ms": ttft + late} for late in (0.0, 300.0)]
    context = round(sum(r["prompt_len"] for r in recs) / 300 + sum(r["output_len"] for r in recs) / 600)
    tpot = step_time(true, shape, [(context, 1)] * 40, 40)
    for i, r in enumerate(recs):
        r["tpot_ms"] = 1e3 * tpot * (3 if i % 3 == 0 else 1)
    rate = 40 / (sum((r["output_len"] - 1) * r["tpot_ms"] / 1e3 for r in recs) / 300)
    assert decode_load(recs, rate) == (pytest.approx(tpot), 40, context)
    got = fit(recs, "opt-13b", gpu("a100-80gb"), 2, 1, rate)
    assert (got["compute_efficiency"], got["memory_efficiency"]) == (0.61, 0.47)
    assert got["client_s"] == pytest.approx(0.017) and got["prefill_rms"] < 1e-3
    path = tmp_path / "vllm-3-1.exp"
    path.write_text(repr(recs[:3]) + "\n{\n\tnum_requests: 3\n}")
    assert load(path) == recs[:3]


def test_measured_speeds_slow_each_system_and_reach_its_clients_first_token():
    """`--speeds measured`: colocated vLLM at vLLM's fitted speed, the pair at DistServe's; a request's TTFT
    grows by the client's time and its TPOT does not (one request alone, on either layout); the rows say whose
    speed ran them, and the fitted speeds are slower than the model's; other models and GPUs are refused."""
    from benchmarks.sim.disagg import MEASURED_SPEEDS, colocated, disaggregated, goodput, main, requests

    (r,) = requests("chatbot", 1, 1.0, seed=1)
    for name, run in (("vllm", lambda s: colocated([r], "opt-13b", "a100-80gb", speed=s)[0]),
                      ("distserve", lambda s: disaggregated([r], "opt-13b", "a100-80gb", "nvlink", 2, 1, 1, s)[0])):  # fmt: skip
        zero = dict(MEASURED_SPEEDS[name], client_s=0.0)
        plain, fitted, slow = run(None), run(zero), run(MEASURED_SPEEDS[name])
        assert slow.ttft == pytest.approx(fitted.ttft + MEASURED_SPEEDS[name]["client_s"]) and slow.tpot == fitted.tpot
        assert fitted.ttft > plain.ttft and fitted.tpot > plain.tpot  # the fitted efficiencies are below the model's
    args = ["--workload", "chatbot", "--links", "nvlink", "--requests", "12"]
    model, measured = main(args), main(args + ["--speeds", "measured"])
    assert [r["speed"] for r in model["rows"]] == ["model"] * 3
    assert [r["speed"] for r in measured["rows"]] == ["vllm", "vllm", "distserve"]
    assert [r["gpus"] for r in measured["rows"]] == [1, 1, 3]
    assert all(r["goodput_per_gpu"] > 0 and r["attainment"] >= 0.9 for r in measured["rows"])
    assert all(m["goodput_per_gpu"] < p["goodput_per_gpu"] for m, p in zip(measured["rows"], model["rows"]))
    v0 = goodput(lambda reqs: colocated(reqs, "opt-13b", "a100-80gb", v0=True, speed=MEASURED_SPEEDS["vllm"]), 1,
                 0.25, 0.1, 12, seed=0, workload="chatbot")  # fmt: skip
    assert (measured["rows"][1]["goodput_per_gpu"], measured["rows"][1]["attainment"]) == v0  # vLLM's own speed
    for other in (["--workload", "summarization"], ["--gpu", "a100-40gb"]):  # fitted on OPT-13B, A100-80GB alone
        with pytest.raises(SystemExit):
            main(other + ["--speeds", "measured"])


def test_validation_replays_each_measured_run_and_counts_its_attainment(tmp_path):
    """distserve_fit --validate: each ground-truth file's requests (lengths, arrival times) on the simulator as
    DistServe's artifact ran each system (vLLM: V0's schedule, 16,384 tokens a step; DistServe: 2P at TP=2 +
    1D), the measured attainment counted from the file, the rate per GPU from its name."""
    from benchmarks.sim.disagg import MEASURED_SPEEDS, attainment, colocated, disaggregated
    from benchmarks.sim.distserve_fit import validate
    from benchmarks.sim.serve import SimRequest

    rng, written = random.Random(6), {}
    for name in ("vllm-12-1.exp", "distserve-c21d11-12-3.exp"):
        written[name] = recs = [{"prompt_len": rng.randint(5, 1900), "output_len": rng.randint(1, 60),
                                 "issue_time": 100 + rng.uniform(0, 0.5), "ttft_ms": rng.choice([80.0, 300.0]),
                                 "tpot_ms": rng.choice([40.0, 120.0])} for _ in range(12)]  # fmt: skip
        (tmp_path / name).write_text(repr(recs) + "\n{\n\tnum_requests: 12\n}")
    rows = validate(tmp_path, MEASURED_SPEEDS)
    assert [(r["system"], r["requests"], r["rate_per_gpu"]) for r in rows] == [("vllm", 12, 1.0), ("distserve", 12, 1.0)]
    for r, name in zip(rows, ("vllm-12-1.exp", "distserve-c21d11-12-3.exp")):
        recs = sorted(written[name], key=lambda x: x["issue_time"])
        assert r["measured"] == sum(x["ttft_ms"] <= 250 and x["tpot_ms"] <= 100 for x in recs) / 12
        t0 = recs[0]["issue_time"]  # the same requests at the same times, built here on their own
        reqs = [SimRequest(x["issue_time"] - t0, [rng.randrange(3, 50272) for _ in range(x["prompt_len"])],
                           x["output_len"]) for x in recs]  # (other tokens: no prompt shares a block)  # fmt: skip
        speed = MEASURED_SPEEDS[r["system"]]
        if r["system"] == "vllm":
            sim = colocated(reqs, "opt-13b", "a100-80gb", v0=True, v0_tokens=16384, speed=speed)
        else:
            sim = disaggregated(reqs, "opt-13b", "a100-80gb", "nvlink", 2, 1, 1, speed=speed)
        assert r["simulated"] == attainment(sim, 0.25, 0.1)
        assert r["ttft_p50"][1] == pytest.approx(statistics.median(t.ttft for t in sim))


def test_a_host_tier_hands_a_chat_back_the_history_hbm_lost():
    """The chat trace on a 40 GB A100 overflows the pool: with a host tier the later turns load their
    history instead of computing it (fewer prompt tokens computed, by at least what the tier handed
    back), and a tier of 8 blocks never holds more."""
    from benchmarks.sim.offload import HostTier, run

    plain, tiered = (run(2.0, "opt-13b", "a100-40gb", gib, 25.0, 120, seed=0) for gib in (0.0, 64.0))
    assert plain["found_in_host"] == 0 < tiered["found_in_host"]
    assert plain["prompt_tokens"] == tiered["prompt_tokens"]  # the same conversations, the same answers
    assert tiered["computed"] <= plain["computed"] - tiered["found_in_host"] * tiered["prompt_tokens"] * 0.9
    tier = HostTier(8, 16, 1, SimClock(), 1.0)
    for i in range(50):
        tier.block_evicted(type("Block", (), {"block_hash": bytes([i])})())
        assert len(tier.names) <= 8
    assert list(tier.names) == [bytes([i]) for i in range(42, 50)]


def test_the_eagle_what_if_runs_and_agrees_with_leviathans_formula():
    """benchmarks/sim/eagle.py on an A100: every proposer and k speeds a batch-1 decode up, within 10 % of
    E[tokens a step] / (k c + 1), and the head's cost c is one layer and the LM head of the target's step."""
    from benchmarks.sim import eagle

    rows = eagle.main(["--gpus", "a100-80gb"])
    assert len(rows) == 10 and {r["proposer"] for r in rows} == {"draft model", "EAGLE head"}
    for r in rows:
        assert r["speedup"] > 1.2 and abs(r["speedup"] / r["formula"] - 1) < 0.1, r
    target = eagle.model_shape("llama-2-7b")
    head = eagle.eagle_shape(target)
    assert head.num_layers == 1 and head.hidden == target.hidden and head.vocab == target.vocab
    assert 1 / target.num_layers < rows[-1]["draft_cost"] < 0.5  # a layer of 32, plus the LM head, plus a pass's overhead
