"""The scheduler needs no model: driven by a fake runner, it decides exactly as inside the engine.

What it is: the test of issue 19's promise that `Scheduler.schedule()` and
`Scheduler.update_from_output()` own every decision and every counter of a step. A real
level-3 engine (prefix caching, chunked prefill, preemption by recompute) runs a recorded
workload; then a bare `Scheduler` over a fresh `PrefixCachingKVCacheManager`, with no model
and no engine, is fed the tokens the model sampled at each step, and must schedule the same
requests with the same token counts, preempt the same ones, hit the same prefix blocks, and
end every request with the same tokens. This is what a simulator does: the scheduler on a
modelled clock, the model replaced by a cost.
"""

from __future__ import annotations

import pytest
from test_equivalence import kv_bytes

import level3_prefix
from level0_naive import SamplingParams
from level2_continuous.scheduler import ModelRunnerOutput, Scheduler
from level3_prefix.block_hash import PrefixRequest as Request  # level 3's manager names blocks on its requests
from level3_prefix.kv_cache_manager import PrefixCachingKVCacheManager

pytestmark = pytest.mark.level3

SHARED = list(range(10, 22))  # 12 tokens: three blocks of 4, shared by half the prompts
PROMPTS = [SHARED + [1, 2], [3, 4, 5], SHARED + [6], [7, 8, 9, 10, 11, 12, 13], SHARED + [14, 15, 16], [17]]
LENGTHS = [14, 20, 9, 16, 12, 25]


def record(engine) -> list[dict]:
    """Wrap the engine's scheduler so that every step's decision and sampled tokens are kept."""
    steps, scheduler = [], engine.scheduler
    inner_schedule, inner_update = scheduler.schedule, scheduler.update_from_output

    def schedule(*args, **kwargs):
        out = inner_schedule(*args, **kwargs)
        steps.append({"scheduled": [(r.request_id, n) for r, n in out.scheduled],
                      "preempted": [r.request_id for r in out.preempted]})  # fmt: skip
        return out

    def update(sched, output):
        steps[-1]["tokens"] = {r.request_id: list(t) for r, t in zip(output.requests, output.token_ids)}
        return inner_update(sched, output)

    scheduler.schedule, scheduler.update_from_output = schedule, update
    return steps


def test_a_scheduler_fed_the_recorded_tokens_makes_the_engines_decisions(llama_dir):
    budget = kv_bytes(llama_dir, 4 * 12)  # 12 blocks of 4 for six requests of up to 41 tokens: preemptions
    engine = level3_prefix.LLMEngine(llama_dir, dtype="float64", block_size=4, kv_cache_memory=budget,
                                     max_num_batched_tokens=10, max_num_seqs=4)  # fmt: skip
    steps = record(engine)
    for i, (prompt, n) in enumerate(zip(PROMPTS, LENGTHS)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0))
    real = {rid: group[0] for rid, group in engine.requests.items()}
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats.preemptions > 0 and engine.kv.hits > 0, "the workload must preempt and hit the cache"
    first_token = {rid: next(i for i, s in enumerate(steps) if rid in s["tokens"]) for rid in real}
    chunked = [rid for rid in real if sum(rid in dict(s["scheduled"]) for s in steps[: first_token[rid] + 1]) > 1]
    assert chunked, "and chunk a prompt over several steps"

    # The same workload, with no model: a Scheduler, a KV manager, and the recorded tokens.
    kv = PrefixCachingKVCacheManager(engine.num_blocks, 4)
    scheduler = Scheduler(kv, max_num_batched_tokens=10, max_num_seqs=4)
    fake = {}
    for seq_id, (rid, r) in enumerate(real.items()):
        fake[rid] = Request(seq_id, rid, 0, None, list(r.prompt_token_ids), r.params, r.max_len, r.eos_token_ids, None)
        scheduler.add(fake[rid])
    for i, step in enumerate(steps):
        out = scheduler.schedule()
        assert [(r.request_id, n) for r, n in out.scheduled] == step["scheduled"], f"step {i}: scheduled"
        assert [r.request_id for r in out.preempted] == step["preempted"], f"step {i}: preempted"
        reqs = [fake[rid] for rid in step["tokens"]]
        output = ModelRunnerOutput(
            reqs, list(step["tokens"].values()), [[None] * len(t) for t in step["tokens"].values()]
        )
        scheduler.update_from_output(out, output)
    assert not scheduler.has_unfinished()
    assert kv.hits == engine.kv.hits and kv.queries == engine.kv.queries
    assert kv.num_free_blocks == kv.num_blocks
    for rid, r in real.items():
        assert fake[rid].output_token_ids == r.output_token_ids and fake[rid].finish_reason == r.finish_reason
