"""Level 3: the prefix cache as a state machine, hash-collision safety, and what a hit saves."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test
from test_equivalence import kv_bytes

import level0_naive
from level0_naive import SamplingParams
from level3_prefix import LLM, LLMEngine
from level3_prefix.block_hash import PrefixRequest as Request
from level3_prefix.block_hash import hash_block
from level3_prefix.block_pool import BlockPool
from level3_prefix.kv_cache_manager import PrefixCachingKVCacheManager

pytestmark = pytest.mark.level3

GREEDY = dict(temperature=0, ignore_eos=True)
BS, NUM_BLOCKS = 4, 10


def fake_request(seq_id: int, tokens: list[int]) -> Request:
    return Request(seq_id, str(seq_id), 0, None, list(tokens), SamplingParams(max_tokens=50), 10_000, [], None)


class PrefixCacheMachine(RuleBasedStateMachine):
    """Admit / compute / generate / free with heavily shared token streams. The test keeps
    its own record of what each physical block really holds and checks the pool against it."""

    def __init__(self):
        super().__init__()
        self.kv = PrefixCachingKVCacheManager(NUM_BLOCKS, BS)
        self.reqs: dict[int, Request] = {}
        self.content: dict[int, dict[int, int]] = {b: {} for b in range(NUM_BLOCKS)}  # block -> offset -> token
        self.freed_order: list[int] = []  # block ids in the order they became idle
        self.next_id = 0

    @rule(
        base=st.sampled_from([[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5]]),
        cut=st.integers(1, 9),
        extra=st.lists(st.integers(1, 3), max_size=4),
    )
    def admit(self, base, cut, extra):
        req = fake_request(self.next_id, base[:cut] + extra)
        self.next_id += 1
        blocks, n_hit = self.kv.get_computed_blocks(req)
        assert n_hit % BS == 0 and n_hit < req.num_tokens, "always leave a token to compute"
        for i, b in enumerate(blocks):  # a hit must name exactly the tokens we are about to skip
            assert [self.content[b.block_id].get(j) for j in range(BS)] == req.all_token_ids[i * BS : (i + 1) * BS]
        req.num_computed_tokens = n_hit
        if self.kv.allocate_slots(req, req.num_uncomputed_tokens, blocks):
            self._idle_to_used()
            self._write(req, n_hit, req.num_tokens)
            req.num_computed_tokens = req.num_tokens
            self.kv.cache_blocks(req)
            self.reqs[req.seq_id] = req
        else:
            assert req.seq_id not in self.kv.req_blocks, "a refused request keeps nothing"

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), token=st.integers(1, 3))
    def generate(self, data, token):
        req = self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))]
        req.output_token_ids.append(token)
        if self.kv.allocate_slots(req, 1):
            self._idle_to_used()
            self._write(req, req.num_computed_tokens, req.num_tokens)
            req.num_computed_tokens += 1
            self.kv.cache_blocks(req)
        else:
            req.output_token_ids.pop()

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data):
        req = self.reqs.pop(data.draw(st.sampled_from(sorted(self.reqs))))
        req.finish_reason = "stop"
        before = {b.block_id for b in self.kv.pool.free_queue}
        table = self.kv.block_table(req)
        self.kv.free(req)
        newly = [b for b in reversed(table) if b not in before and self.kv.pool.blocks[b].ref_cnt == 0]
        self.freed_order += newly  # tail first

    def _write(self, req, start, end):
        table = self.kv.block_table(req)
        for p in range(start, end):
            self.content[table[p // BS]][p % BS] = req.all_token_ids[p]

    def _idle_to_used(self):
        self.freed_order = [b for b in self.freed_order if self.kv.pool.blocks[b].ref_cnt == 0]

    @invariant()
    def ref_counts_match_owners(self):
        owners = {b: 0 for b in range(NUM_BLOCKS)}
        for req in self.reqs.values():
            for b in self.kv.block_table(req):
                owners[b] += 1
        for blk in self.kv.pool.blocks:
            assert blk.ref_cnt >= 0 and blk.ref_cnt == owners[blk.block_id], "ref count drifted (leak or double free)"

    @invariant()
    def free_queue_is_exactly_the_idle_blocks(self):
        queue = [b.block_id for b in self.kv.pool.free_queue]
        assert len(queue) == len(set(queue)) == self.kv.pool.num_free
        assert set(queue) == {b.block_id for b in self.kv.pool.blocks if b.ref_cnt == 0}

    @invariant()
    def names_only_true_content(self):
        for h, b in self.kv.pool.cached.items():
            assert b.block_hash == h and [self.content[b.block_id].get(j) for j in range(BS)] == list(b.tokens)

    @invariant()
    def lru_order_is_respected(self):
        queue = [b.block_id for b in self.kv.pool.free_queue]
        freed_here = [b for b in queue if b in self.freed_order]
        assert freed_here == [b for b in self.freed_order if b in freed_here], "the free queue is not in LRU order"


def test_prefix_cache_state_machine():
    run_state_machine_as_test(PrefixCacheMachine)


def test_a_colliding_hash_never_returns_another_prefixs_kv(llama_dir, oracle):
    """With a hash function that names *every* block the same, the pool's content check
    must turn every false hit into a miss, and outputs stay exact."""

    class Colliding(LLMEngine):
        def make_kv_manager(self):
            return PrefixCachingKVCacheManager(
                self.num_blocks, self.config.cache.block_size, hash_fn=lambda parent, tokens, extra=(): b"x" * 32
            )

    class CollidingLLM(LLM):
        engine_class = Colliding

    engine = CollidingLLM(llama_dir, dtype="float64", block_size=2)
    prompts = [[1, 2, 3, 4, 5], [1, 2, 9, 9, 5], [7, 7, 3, 4, 5], [1, 2, 3, 4, 6]]
    for p in prompts:  # one at a time, so each finds the blocks of those before it
        out = engine.generate([p], SamplingParams(max_tokens=6, **GREEDY), progress=False)[0]
        assert out.outputs[0].token_ids == oracle.greedy(llama_dir, p, 6)
    # The one name belongs to the first block registered, [1, 2]: prompts 2 and 4 truly
    # hit it; every other lookup finds other tokens under the name and misses.
    assert engine.prefix_stats()["prefix_cache_hits"] == 2 + 2

    pool = BlockPool(4)
    [blk] = pool.allocate(1)
    pool.register(blk, hash_block(None, (1, 2)), None, (1, 2))
    assert pool.lookup(hash_block(None, (1, 2)), None, (1, 3)) is None  # same name, other tokens
    assert pool.lookup(hash_block(None, (1, 2)), None, (1, 2)) is blk


def test_hash_is_stable_and_chained():
    a = hash_block(None, (1, 2, 3))
    assert a == hash_block(None, (1, 2, 3)) and len(a) == 32
    # canonical: SHA-256 over the parent (zeros for none) and little-endian int64 token ids,
    # the same in every process, unlike Python's salted hash()
    assert a == hashlib.sha256(b"\0" * 32 + struct.pack("<3q", 1, 2, 3)).digest()
    assert hash_block(a, (4,)) != hash_block(None, (4,))  # the parent is part of the name
    assert hash_block(None, (1, 2)) != hash_block(None, (1, 2), extra=("salt",))


def test_a_repeated_prompt_skips_its_cached_prefill(llama_dir):
    engine = LLM(llama_dir, dtype="float64", block_size=4)
    prompt = list(range(1, 23))  # 22 tokens: 5 full blocks, and the last token always recomputed
    first = engine.generate([prompt], SamplingParams(max_tokens=3, **GREEDY), progress=False)[0]
    prefill_before = engine.stats.prompt_tokens
    second = engine.generate([prompt], SamplingParams(max_tokens=3, **GREEDY), progress=False)[0]
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert engine.stats.prompt_tokens - prefill_before == 22 - 20
    stats = engine.prefix_stats()
    assert stats["prefix_cache_queries"] == 44 and stats["prefix_cache_hits"] == 20
    engine.reset_prefix_cache()
    engine.generate([prompt], SamplingParams(max_tokens=3, **GREEDY), progress=False)
    assert engine.prefix_stats()["prefix_cache_hits"] == 20  # nothing more was found


def test_block_aligned_prompt_still_computes_its_last_token(llama_dir):
    engine = LLM(llama_dir, dtype="float64", block_size=4)
    prompt = list(range(1, 17))  # exactly 4 blocks: only 3 can come from the cache
    engine.generate([prompt], SamplingParams(max_tokens=2, **GREEDY), progress=False)
    engine.generate([prompt], SamplingParams(max_tokens=2, **GREEDY), progress=False)
    assert engine.prefix_stats()["prefix_cache_hits"] == 12


def test_eviction_takes_the_least_recent_and_a_requests_tail_first():
    pool = BlockPool(4)
    a = pool.allocate(3)
    for i, b in enumerate(a):
        pool.register(b, bytes([i]) * 32, None, (i,))
    pool.free(list(reversed(a)))  # as the manager frees: tail first
    (fresh,) = pool.allocate(1)
    assert fresh.block_id == 3  # the never-used block was freed earliest (at start-up)
    (evicted,) = pool.allocate(1)
    assert evicted is a[2] and evicted.block_hash is None and bytes([2]) * 32 not in pool.cached
    pool.touch([a[0]])  # a cache hit takes a block out of the middle of the queue
    (evicted,) = pool.allocate(1)
    assert evicted is a[1] and pool.evictions == 2


def test_conversation_turns_hit_the_previous_answer(llama_dir):
    engine = LLM(llama_dir, dtype="float64", block_size=4)
    turn1 = list(range(1, 10))
    out1 = engine.generate([turn1], SamplingParams(max_tokens=12, **GREEDY), progress=False)[0].outputs[0].token_ids
    turn2 = turn1 + out1 + [5, 6, 7]
    engine.generate([turn2], SamplingParams(max_tokens=4, **GREEDY), progress=False)
    # turn 1 computed 9 + 11 tokens (the 12th sampled token is never fed back): 5 full blocks
    assert engine.prefix_stats()["prefix_cache_hits"] == 20


def test_caching_off_gives_the_same_answers_and_no_hits(llama_dir):
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9]] * 3
    on = LLM(llama_dir, dtype="float64", block_size=2, kv_cache_memory=kv_bytes(llama_dir, 40))
    off = LLM(
        llama_dir, dtype="float64", block_size=2, kv_cache_memory=kv_bytes(llama_dir, 40), enable_prefix_caching=False
    )
    naive = level0_naive.LLM(llama_dir, dtype="float64")
    run = lambda e: [
        o.outputs[0].token_ids for o in e.generate(prompts, SamplingParams(max_tokens=5, **GREEDY), progress=False)
    ]  # noqa: E731
    assert run(on) == run(off) == run(naive)
    assert off.prefix_stats()["prefix_cache_hits"] == 0 < on.prefix_stats()["prefix_cache_hits"]


def cached_admit(kv: PrefixCachingKVCacheManager, req: Request) -> None:
    """Admit with whatever the cache holds, compute the rest, and name the full blocks."""
    blocks, n_hit = kv.get_computed_blocks(req)
    req.num_computed_tokens = n_hit
    assert kv.allocate_slots(req, req.num_uncomputed_tokens, blocks)
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)


def test_eviction_order_is_one_lru_queue_and_a_requests_tail_goes_first():
    """The documented eviction order, through the manager: one LRU queue of idle blocks (a block never
    named gets no priority over a cached one), and a request's blocks freed tail first, so its head,
    the most shareable part, is evicted last. Outputs stay exact under any order; hit rates do not."""
    kv = PrefixCachingKVCacheManager(5, BS)
    a = fake_request(1, [1, 2, 3, 4, 5, 6, 7, 8])  # 2 full blocks, both named
    d = fake_request(2, [9, 9, 9])  # 1 partial block, never named
    cached_admit(kv, a)
    cached_admit(kv, d)
    assert kv.block_table(a) == [0, 1] and kv.block_table(d) == [2]
    kv.free(a)  # idle, least recent first: 3, 4 (never used), then a's tail 1, a's head 0
    kv.free(d)  # ... then d's 2
    c = fake_request(3, [50] * 9)  # 3 blocks: 3, 4 and the least recently freed, a's tail
    cached_admit(kv, c)
    assert kv.block_table(c) == [3, 4, 1], "not the least recently freed block (or not a's tail)"
    assert kv.pool.evictions == 1
    _, n_hit = kv.get_computed_blocks(fake_request(4, [1, 2, 3, 4, 5, 6, 7, 8, 10]))
    assert n_hit == BS, "a's head block must still be cached (its tail went first)"
