"""Lab 2's own checks: the scheduler alone, driven step by step with a stand-in for the model.

What it is: pytest tests that `python -m labs check 2` runs next to level 2's own tests.
They build a `Scheduler` over level 2's `SimpleKVCacheManager`, call `schedule()`, and
do what the engine does after a forward (the scheduled tokens are now cached; a chunk
that reached the end samples a token), so a failure names the scheduling rule that
broke, in a few milliseconds, without a model.

What it is not: a test of the engine around the scheduler (level 2's tests are).

Reference: vLLM `tests/v1/core/test_scheduler.py` (schedulers tested without a model).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from level0_naive.sampling_params import SamplingParams
from level2_continuous.kv_cache_manager import SimpleKVCacheManager
from level2_continuous.request import Request, RequestStatus
from level2_continuous.scheduler import Scheduler

TOKEN = 7  # what the stand-in model always samples


def request(seq_id: int, prompt_len: int, max_tokens: int = 64) -> Request:
    prompt = [1 + (seq_id * 31 + i) % 90 for i in range(prompt_len)]
    return Request(seq_id, f"r{seq_id}", 0, None, prompt, SamplingParams(max_tokens=max_tokens), 10_000, [], None)


def scheduler(num_blocks=16, budget=64, seats=8, block_size=4, policy="fcfs") -> Scheduler:
    return Scheduler(SimpleKVCacheManager(num_blocks, block_size), budget, seats, policy)


def step(s: Scheduler):
    """schedule(), then the engine's bookkeeping; requests that reach max_tokens finish."""
    out = s.schedule()
    for req, n in out.scheduled:
        req.num_computed_tokens += n
        s.kv.cache_blocks(req)
        if req.num_computed_tokens == req.num_tokens:
            req.output_token_ids.append(TOKEN)
            if len(req.output_token_ids) >= req.params.max_tokens:
                req.finish_reason = "length"
                s.finish(req)
    return out


def ids(pairs) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in pairs]


def test_budget_goes_to_running_requests_first():
    s = scheduler(budget=8)
    a, b = request(0, 3), request(1, 2)
    s.add(a)
    s.add(b)
    step(s)  # both prefilled (5 tokens of 8)
    c = request(2, 20)
    s.add(c)
    out = step(s)  # a and b decode first; c gets what is left
    assert ids(out.scheduled) == [("r0", 1), ("r1", 1), ("r2", 6)], (
        f"budget 8, two decodes running and a 20-token prompt waiting: expected r0:1, r1:1, r2:6, got "
        f"{ids(out.scheduled)}"
    )
    out = step(s)
    assert ids(out.scheduled) == [("r0", 1), ("r1", 1), ("r2", 6)], f"the next chunk of r2: got {ids(out.scheduled)}"
    assert out.num_batched_tokens <= 8


def test_seats_are_limited():
    s = scheduler(seats=2)
    for i in range(4):
        s.add(request(i, 3))
    out = step(s)
    assert [r.request_id for r, _ in out.scheduled] == ["r0", "r1"] and len(s.running) == 2, (
        f"max_num_seqs=2: expected r0 and r1 to run, got {[r.request_id for r in s.running]}"
    )
    assert [r.request_id for r in s.waiting] == ["r2", "r3"]


def test_a_preempted_request_starts_over():
    """Pool of 4 blocks of 4; two requests of 8 tokens hold all of them. The next step one of them
    needs a third block, and a victim is preempted by recompute (which one is another check's business)."""
    s = scheduler(num_blocks=4)
    r0, r1 = request(0, 8), request(1, 8)
    s.add(r0)
    s.add(r1)
    step(s)
    assert s.kv.num_free_blocks == 0
    out = step(s)
    assert len(out.preempted) == 1, f"expected one preemption, got {[r.request_id for r in out.preempted]}"
    (victim,) = out.preempted
    (other,) = [r for r in (r0, r1) if r is not victim]
    assert ids(out.scheduled) == [(other.request_id, 1)], f"only {other.request_id} runs, got {ids(out.scheduled)}"
    assert victim.num_computed_tokens == 0, "a preempted request restarts from token 0 (recompute)"
    assert victim.status is RequestStatus.WAITING and victim.num_preemptions == 1
    assert list(s.waiting) == [victim] and s.running == [other]
    assert victim.output_token_ids == [TOKEN], "a preempted request keeps the tokens it generated"
    assert victim.seq_id not in s.kv.tables.tables and s.kv.num_free_blocks == 1, "its blocks are free"


def test_a_request_that_preempts_itself_waits():
    """One request fills the pool (2 blocks) and then needs a third: it is its own victim, and the
    step schedules nothing (it must not loop looking for another victim, or schedule it anyway)."""
    s = scheduler(num_blocks=2)
    r0 = request(0, 8)
    s.add(r0)
    step(s)
    out = step(s)
    assert out.scheduled == [], f"expected nothing to run, got {ids(out.scheduled)}"
    assert out.preempted == [r0] and list(s.waiting) == [r0] and s.running == [], "r0 preempted itself and waits"


def test_random_workloads_keep_every_invariant():
    run_random_workloads()


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    lens=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12)), min_size=1, max_size=8),
    num_blocks=st.integers(6, 14),
    budget=st.sampled_from([1, 3, 8, 64]),
    seats=st.integers(1, 6),
    arrivals=st.lists(st.integers(0, 5), min_size=8, max_size=8),
)
def run_random_workloads(lens, num_blocks, budget, seats, arrivals):
    block_size = 4
    # every request alone fits the pool at its longest (the engine refuses the others up front)
    lens = [(p, min(m, num_blocks * block_size - p)) for p, m in lens if p < num_blocks * block_size]
    s = scheduler(num_blocks=num_blocks, budget=budget, seats=seats, block_size=block_size)
    reqs = [request(i, p, m) for i, (p, m) in enumerate(lens)]
    pending = sorted(zip(arrivals, range(len(reqs))))
    for t in range(2000):
        while pending and pending[0][0] <= t:
            s.add(reqs[pending.pop(0)[1]])
        if not pending and not s.has_unfinished():
            break
        out = step(s)
        assert out.num_batched_tokens <= budget, f"{out.num_batched_tokens} tokens scheduled, budget {budget}"
        assert len(s.running) <= seats, f"{len(s.running)} running, max_num_seqs {seats}"
        assert len({id(r) for r, _ in out.scheduled}) == len(out.scheduled), "a request scheduled twice in a step"
        tables = s.kv.tables.tables
        assert all(not tables.get(r.seq_id) for r in s.waiting), "a waiting request holds blocks"
        used = sum(len(t) for t in tables.values())
        assert used + s.kv.num_free_blocks == num_blocks, "a block leaked"
        for r in s.running:
            assert r.status is RequestStatus.RUNNING
        if s.has_unfinished() and not pending:
            assert out.scheduled or out.preempted, "a step scheduled nothing while requests wait (it would hang)"
    assert all(r.is_finished for r in reqs), "not every request finished within 2000 steps (starvation?)"
    assert s.kv.num_free_blocks == num_blocks
