"""The clock and step-observer seam (levels 2 and 3): what a dashboard or a simulator sees.

What it is: property tests over random workloads (tight KV budgets, so preemption; shared
prefixes, so level 3's ref counts above 1 and cached free blocks):

  - an observer is called exactly once for every step that ran, with that step's own record
    (the one appended to the step log) and a snapshot equal, at that moment, to the KV
    manager's state and the scheduler's queues: free blocks, each running request's block
    table, per-block ref counts (= how many running tables hold the block), cached free
    blocks (free, named, in the pool's eviction order; none at level 2);
  - a snapshot is a copy (frozen, tuples): keeping one costs the engine nothing later;
  - observing changes no token;
  - the engine's clock is the one every request time and step record is read from (a fake
    clock that ticks by 1 gives integer TTFTs and step times).

What it is not: the dashboard or the simulator themselves (issues 24 and 25 build them on this).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_equivalence import kv_bytes

import level2_continuous
import level3_prefix
from level0_naive import SamplingParams

pytestmark = [pytest.mark.level2, pytest.mark.level3]

BLOCK = 4
LEVELS = {"level2": level2_continuous.LLMEngine, "level3": level3_prefix.LLMEngine}


class Recorder:
    """An observer that checks each snapshot against the engine it came from, as it arrives."""

    def __init__(self):
        self.engine, self.calls, self.snapshots = None, 0, []

    def __call__(self, record, snap):
        e = self.engine
        self.calls += 1
        assert record is e.step_log[-1]  # this step's own record
        assert (snap.num_blocks, snap.block_size, snap.num_free_blocks) == (e.num_blocks, BLOCK, e.kv.num_free_blocks)
        running, waiting = list(e.scheduler.running), list(e.scheduler.waiting)
        assert snap.running == tuple(r.request_id for r in running)
        assert snap.waiting == tuple(r.request_id for r in waiting)
        held = [0] * e.num_blocks
        for r, rb in zip(running, snap.requests):
            assert (rb.request_id, rb.index, rb.block_ids) == (r.request_id, r.index, tuple(e.kv.block_table(r)))
            for b in rb.block_ids:
                held[b] += 1
        assert list(snap.ref_counts) == held  # a block's ref count is how many running requests hold it
        assert snap.num_free_blocks == held.count(0)
        assert set(snap.cached_free) <= {b for b, n in enumerate(held) if n == 0}
        if isinstance(e, level3_prefix.LLMEngine):
            evictable = [b.block_id for b in e.kv.pool.free_queue if b.block_hash is not None]
            assert list(snap.cached_free) == evictable  # in the order they will be evicted
        else:
            assert snap.cached_free == ()
        self.snapshots.append(snap)


@pytest.fixture(scope="module")
def engines(checkpoint_factory):
    path = checkpoint_factory("llama")
    made = {}
    for name, cls in LEVELS.items():
        rec = Recorder()
        engine = cls(path, dtype="float64", block_size=BLOCK, kv_cache_memory=kv_bytes(path, 12 * BLOCK),
                     max_num_seqs=4, max_num_batched_tokens=16, step_log_size=10_000, observers=[rec])  # fmt: skip
        rec.engine = engine
        plain = cls(path, dtype="float64", block_size=BLOCK, kv_cache_memory=kv_bytes(path, 12 * BLOCK),
                    max_num_seqs=4, max_num_batched_tokens=16)  # fmt: skip
        made[name] = (engine, rec, plain)
    return made


workloads = st.lists(st.tuples(st.integers(0, 2), st.integers(1, 14), st.integers(1, 12)), min_size=1, max_size=6)


@pytest.mark.parametrize("level", LEVELS)
@given(workload=workloads)
def test_an_observer_sees_every_step_once_and_the_kv_state_as_it_is(engines, level, workload):
    engine, rec, plain = engines[level]
    prefixes = [[7, 3, 9, 1, 4, 4, 2, 8], [5] * 8, []]  # shared prefixes: level 3 shares blocks
    requests = [(prefixes[p] + [10 + i] * n, m) for i, (p, n, m) in enumerate(workload)]
    ids = itertools.count()

    def run(e):
        out = {}
        for prompt, m in requests:
            e.add_request(f"r{next(ids)}", prompt, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
        steps_before = len(e.step_log)
        while e.has_unfinished_requests():
            for o in e.step():
                if o.finished:
                    out[o.request_id] = o.outputs[0].token_ids
        return [out[k] for k in sorted(out, key=lambda k: int(k[1:]))], len(e.step_log) - steps_before

    calls_before = rec.calls
    observed, steps = run(engine)
    assert rec.calls - calls_before == steps > 0  # one call per step that ran
    assert observed == run(plain)[0]  # observing changes no token
    snap = rec.snapshots[-1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.num_free_blocks = 0
    assert all(isinstance(x, tuple) for x in (snap.requests, snap.ref_counts, snap.cached_free))


def test_the_engine_clock_is_what_request_times_and_step_records_read(checkpoint_factory):
    path = checkpoint_factory("llama")
    ticks = itertools.count()
    engine = level2_continuous.LLMEngine(path, dtype="float64", block_size=BLOCK, clock=lambda: float(next(ticks)))
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    m = done[0].metrics
    for t in (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time):
        assert t == int(t)  # read from the fake clock, nothing else
    assert m.arrival_time < m.first_scheduled_time < m.first_token_time <= m.last_token_time <= m.finished_time
    times = [r.time for r in engine.step_log]
    assert times == sorted(times) and all(t == int(t) for t in times) and len(times) == 4
