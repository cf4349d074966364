"""Lab 3b's own checks: the fork and copy-on-write, on a small KV manager.

What it is: pytest tests that `python -m labs check 3b` runs next to the beam-search tests:
a fork shares every block and copies nothing; a write into a shared block copies it first,
once, and leaves the other holder's block alone; full blocks stay shared, and a block only
one sequence holds is never copied.

What it is not: the state machine or the comparison with Hugging Face (tests/test_beam_search.py).
"""

from __future__ import annotations

from level3_prefix.beam_search import Beam
from level3_prefix.kv_cache_manager import PrefixCachingKVCacheManager

BS = 4


def admitted(kv, seq_id: int, tokens: list[int]) -> Beam:
    seq = Beam(seq_id, tokens)
    assert kv.allocate_slots(seq, len(tokens), [])
    seq.num_computed_tokens = len(tokens)
    kv.cache_blocks(seq)
    return seq


def forked(kv, parent: Beam, seq_id: int) -> Beam:
    child = Beam(seq_id, parent.prompt_token_ids, list(parent.output_token_ids))
    child.num_computed_tokens = parent.num_computed_tokens
    kv.fork(parent, child)
    return child


def test_fork_shares_every_block_and_copies_nothing():
    kv = PrefixCachingKVCacheManager(8, BS)
    parent = admitted(kv, 1, [1, 2, 3, 4, 5, 6])  # blocks: one full, one with 2 of 4
    free = kv.num_free_blocks
    child = forked(kv, parent, 2)
    assert kv.block_table(child) == kv.block_table(parent)
    assert kv.req_blocks[child.seq_id] is not kv.req_blocks[parent.seq_id], "the child needs its own list"
    assert [kv.pool.blocks[b].ref_cnt for b in kv.block_table(child)] == [2, 2]
    assert kv.num_free_blocks == free and kv.take_block_copies() == []
    kv.free(parent)
    assert [kv.pool.blocks[b].ref_cnt for b in kv.block_table(child)] == [1, 1]


def test_a_write_into_a_shared_block_copies_it_first():
    kv = PrefixCachingKVCacheManager(8, BS)
    parent = admitted(kv, 1, [1, 2, 3, 4, 5, 6])
    child = forked(kv, parent, 2)
    before = kv.block_table(parent)
    child.output_token_ids.append(7)  # position 6: in the shared, partial second block
    assert kv.allocate_slots(child, 1)
    [(src, dst)] = kv.take_block_copies()
    assert src == before[1] and dst not in before
    assert kv.block_table(child) == [before[0], dst] and kv.block_table(parent) == before
    assert [kv.pool.blocks[b].ref_cnt for b in (before[0], before[1], dst)] == [2, 1, 1]
    assert kv.pool.blocks[dst].num_tokens == 2  # the copy holds the shared block's two tokens
    parent.output_token_ids.append(8)  # the parent's block is its own now: no copy
    assert kv.allocate_slots(parent, 1) and kv.take_block_copies() == []


def test_full_blocks_stay_shared_and_own_blocks_are_not_copied():
    kv = PrefixCachingKVCacheManager(8, BS)
    parent = admitted(kv, 1, [1, 2, 3, 4, 5, 6, 7, 8])  # two full blocks
    child = forked(kv, parent, 2)
    child.output_token_ids.append(9)  # position 8: a new block, nothing shared is written
    assert kv.allocate_slots(child, 1) and kv.take_block_copies() == []
    assert kv.block_table(child)[:2] == kv.block_table(parent)
    child.num_computed_tokens += 1
    child.output_token_ids.append(10)  # into its own third block
    assert kv.allocate_slots(child, 1) and kv.take_block_copies() == []
    # no room for the copy: nothing changes (all or nothing)
    kv2 = PrefixCachingKVCacheManager(2, BS)
    p2 = admitted(kv2, 1, [1, 2, 3, 4, 5, 6])
    c2 = forked(kv2, p2, 2)
    c2.output_token_ids.append(7)
    assert not kv2.allocate_slots(c2, 1)
    assert kv2.block_table(c2) == kv2.block_table(p2) and kv2.take_block_copies() == []
