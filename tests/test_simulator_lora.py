"""LoRA on the GPU what-if (benchmarks/sim/lora_cost.py, benchmarks/sim/lora.py): the cost, the slots, the figure.

What it is:
  - the cost model: a step's LoRA term is zero without adapters (the step costs what it cost before),
    grows by exactly one adapter's bytes per extra distinct adapter (memory-bound), by its FLOPs where
    compute binds, and with the rank; the projections' shapes are the LoRA room's own;
  - the simulated engine: with LoRA off it is level 2's simulated engine, step for step; its admission rule
    is the room's (`LoRAManager.admits`), so no step runs more than max_loras adapters, each loaded once
    while it stays in its slot; a bad adapter is refused when it is added;
  - S-LoRA's trace (uniform adapters at alpha 1, ranks cycled, lengths in range), and
    `python -m benchmarks.sim.lora --quick`: its table prints, throughput falls (a little) as adapters
    grow, and one adapter at a time falls far below.

What it is not: a check of S-LoRA's numbers (the benchmark prints them beside the simulated ones).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import replace

import pytest

from benchmarks.sim.clock import SimClock, SimStep, SimulatedExecutor
from benchmarks.sim.cost import gpu, model_dir, model_shape, step_cost
from benchmarks.sim.engines import engine_model_config
from benchmarks.sim.lora import SimSlots, SimulatedLoRA, main, run, slora_trace
from benchmarks.sim.lora_cost import ALL, ATTENTION, SimAdapter, adapter_bytes, lora_cost, projections
from benchmarks.sim.serve import make_engine, play
from features.lora.adapter import shapes
from features.lora.manager import LoRAManager
from level0_naive.sampling_params import SamplingParams

pytestmark = pytest.mark.bench

HW, SHAPE = gpu("a100-80gb"), model_shape("llama-2-7b")
DECODES = [(300, 1)] * 64  # 64 requests decoding over 300 cached tokens each


def test_no_adapter_costs_nothing_and_the_step_is_unchanged():
    plain = step_cost(HW, SHAPE, DECODES, 64)
    for adapters in (None, [], [None] * 64):
        cost = step_cost(HW, SHAPE, DECODES, 64, adapters=adapters)
        assert cost.lora == 0.0 and cost == plain
    assert lora_cost(HW, SHAPE, [(0, SimAdapter(1, 8))]) == 0.0  # a row with no new tokens runs no matmul


def test_each_distinct_adapter_adds_its_weights_read_and_rank_grows_the_cost():
    """Memory-bound (rank 8: about 8 FLOPs a byte): 64 rows on one adapter against 64 rows on eight differ by
    exactly seven adapters' A and B read at the bandwidth; the rows' activations are the same."""
    one = [SimAdapter(1, 8)] * 64
    eight = [SimAdapter(1 + i % 8, 8) for i in range(64)]
    c1, c8 = (step_cost(HW, SHAPE, DECODES, 64, adapters=a).lora for a in (one, eight))
    bw = HW.bytes_per_s * HW.memory_efficiency
    assert 0 < c1 < c8 and c8 - c1 == pytest.approx(7 * adapter_bytes(SHAPE, one[0]) / bw, rel=1e-9)
    costs = [lora_cost(HW, SHAPE, [(1, SimAdapter(1 + i, r)) for i in range(64)]) for r in (4, 8, 16, 64)]
    assert costs == sorted(costs) and len(set(costs)) == 4
    assert lora_cost(HW, SHAPE, [(1, SimAdapter(1, 8, ATTENTION))]) < lora_cost(HW, SHAPE, [(1, SimAdapter(1, 8))])
    # where compute binds (a GPU of 1 GFLOP/s), the term is the shrink's and expand's FLOPs: 2 n r (in + out)
    slow = replace(HW, flops=1e9)
    a, width = SimAdapter(1, 8), sum(i + o for i, o in projections(SHAPE).values())
    assert lora_cost(slow, SHAPE, [(100, a)]) == pytest.approx(
        2 * 100 * 8 * width * SHAPE.num_layers / (1e9 * HW.compute_efficiency), rel=1e-9)  # fmt: skip


def test_the_projections_are_the_lora_rooms_and_an_slora_adapter_is_16_mb():
    hf = json.loads((model_dir("llama-2-7b") / "config.json").read_text())
    assert projections(SHAPE) == shapes(engine_model_config(hf))
    assert adapter_bytes(SHAPE, SimAdapter(1, 8, ATTENTION)) == 4 * 8 * (4096 + 4096) * 32 * 2  # 16 MiB
    assert "gate_proj" not in projections(model_shape("opt-13b"))
    with pytest.raises(ValueError, match="gate_proj"):
        adapter_bytes(model_shape("opt-13b"), SimAdapter(1, 8, ALL))
    with pytest.raises(ValueError, match=">= 1"):
        SimAdapter(0, 8)


def test_a_pipelines_stages_carry_the_lora_term():
    adapters = [SimAdapter(1 + i, 8) for i in range(64)]
    for pp in (1, 2):
        times = []
        for a in (None, adapters):
            ex = SimulatedExecutor(0, HW, SHAPE, SimClock(), pp=pp)
            ex.execute(SimStep(DECODES, 64, adapters=a))
            times.append(ex.clock.now)
        cost = step_cost(HW, SHAPE, DECODES, 64, pp=pp, adapters=adapters)
        assert times[1] - times[0] == pytest.approx(cost.lora, rel=1e-6)  # a step alone: each stage its share, in turn


def test_slora_trace_is_uniform_over_adapters_at_alpha_one_with_ranks_cycled():
    reqs = slora_trace(4, 4000, 10.0, ranks=(64, 32, 16, 8), seed=1)
    counts = Counter(r.lora_request.lora_int_id for r in reqs)
    assert set(counts) == {1, 2, 3, 4} and max(counts.values()) / min(counts.values()) < 1.15
    assert {r.lora_request.lora_int_id: r.lora_request.rank for r in reqs} == {1: 64, 2: 32, 3: 16, 4: 8}
    assert all(8 <= len(r.prompt) < 512 and 8 <= r.output_len < 512 for r in reqs)
    assert reqs[-1].arrival == pytest.approx(400, rel=0.1)  # 4000 requests at 10/s
    skewed = Counter(r.lora_request.lora_int_id for r in slora_trace(4, 4000, 10.0, alpha=0.3, seed=1))
    assert skewed[1] > 2 * skewed[4]  # alpha < 1 favours the first adapters
    assert {r.arrival for r in slora_trace(3, 20, math.inf)} == {0.0}
    assert all(r.lora_request is None for r in slora_trace(0, 20, 10.0))


def test_without_adapters_it_is_level_2s_simulated_engine_step_for_step():
    reqs = slora_trace(0, 60, 20.0, seed=2)
    ref = make_engine("vllm", "llama-2-7b", HW, SimClock())
    seqs = play(ref, reqs, lambda r: SamplingParams(max_tokens=ref.max_model_len - len(r.prompt), temperature=0.0))
    got = run(reqs)
    assert got["throughput"] == len(seqs) / max(s.metrics.finished_time for s in seqs)
    assert got["lora_share"] == got["loads"] == 0


def test_the_admission_rule_is_the_rooms_and_no_step_runs_more_adapters_than_slots():
    assert SimSlots.admits is LoRAManager.admits
    reqs = slora_trace(6, 80, math.inf, seed=3)
    for k in (1, 2, 6):
        r = run(reqs, max_loras=k)
        assert r["most_distinct"] == k and r["requests"] == 80  # (the step raises if it is ever more)
    wide, narrow = run(reqs, max_loras=6), run(reqs, max_loras=1)
    assert wide["loads"] == 6 and narrow["loads"] > 6  # six slots: each adapter copied in once; one: again and again
    assert narrow["throughput"] < wide["throughput"] / 3


def test_a_bad_adapter_is_refused_when_it_is_added():
    engine = SimulatedLoRA("llama-2-7b", hardware=HW, clock=SimClock(), kv_cache_memory=10**10, enable_lora=True,
                           max_loras=2, max_lora_rank=16)  # fmt: skip
    with pytest.raises(ValueError, match="rank 64 > max_lora_rank=16"):
        engine.add_request("a", [5] * 8, SamplingParams(max_tokens=4), lora_request=SimAdapter(1, 64))
    with pytest.raises(ValueError, match="SimAdapter"):
        engine.add_request("b", [5] * 8, SamplingParams(max_tokens=4), lora_request=object())
    assert not engine.has_unfinished_requests()


def test_the_quick_benchmark_prints_its_table_and_adapters_cost_throughput(capsys):
    rows = main(["--quick"])
    out = capsys.readouterr().out
    assert "S-LoRA" in out and "one at a time" in out and "saturated" in out
    assert [r["adapters"] for r in rows] == [0, 1, 8, 64]
    saturated = [r["saturated"]["throughput"] for r in rows]
    assert saturated == sorted(saturated, reverse=True) and saturated[-1] > 0.9 * saturated[0]  # a small cost
    shares = [r["saturated"]["lora_share"] for r in rows]
    assert shares[0] == 0 < shares[1] < shares[3]
    for r in rows[2:]:  # one adapter at a time: far below mixing them
        assert r["one_at_a_time"]["throughput"] < r["saturated"]["throughput"] / 5
