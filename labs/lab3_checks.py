"""Lab 3's own checks: the block pool's pieces one at a time, without a model.

What it is: pytest tests that `python -m labs check 3` runs next to level 3's own tests:
the chained names, the free queue's links walked both ways, and the reference counts with
the stored-token count they drive. Each failure names the piece and the rule.

What it is not: a test of hits through the engine (level 3's tests are).

Reference: vLLM `tests/v1/core/test_prefix_caching.py` (the free queue and ref counts alone).
"""

from __future__ import annotations

import pytest

from level1_paged.block_allocator import OutOfBlocks
from level3_prefix.block_hash import hash_block
from level3_prefix.block_pool import BlockPool, FreeBlockQueue, KVBlock


def test_names_chain_through_the_parent():
    a = hash_block(None, (1, 2, 3, 4))
    assert isinstance(a, bytes) and len(a) == 32, "a name is the 32-byte SHA-256 digest"
    assert hash_block(a, (5, 6, 7, 8)) != hash_block(None, (5, 6, 7, 8)), "the parent must be part of the name"
    assert hash_block(a, (5, 6, 7, 8)) != hash_block(hash_block(None, (9, 9, 9, 9)), (5, 6, 7, 8)), (
        "the same block after two different prefixes must get two different names"
    )
    assert hash_block(a, (5, 6, 7, 8)) == hash_block(hash_block(None, (1, 2, 3, 4)), (5, 6, 7, 8)), "deterministic"
    assert hash_block(None, (1, 2)) != hash_block(None, (2, 1)), "token order matters"


def walk(q: FreeBlockQueue) -> list[int]:
    """Block ids head to tail, checking every link both ways."""
    ids, b = [], q.head
    while b.next is not q.tail:
        assert b.next.prev is b, f"block {b.next.block_id}: prev does not point back to block {b.block_id}"
        b = b.next
        ids.append(b.block_id)
        assert len(ids) <= q.size + 1, "the links loop (or size is wrong)"
    assert q.tail.prev is b, "the tail sentinel's prev is not the last block"
    assert len(ids) == q.size == len(q), f"size {q.size} but {len(ids)} blocks linked"
    return ids


def test_free_queue_is_a_linked_list():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert walk(q) == [0, 1, 2, 3, 4], "blocks are appended in the order given"
    q.remove(blocks[2])
    assert walk(q) == [0, 1, 3, 4] and blocks[2].prev is None and blocks[2].next is None, "remove from the middle"
    assert q.popleft() is blocks[0] and walk(q) == [1, 3, 4], "popleft takes the head: the least recently freed"
    q.append(blocks[0])
    q.append(blocks[2])
    assert walk(q) == [1, 3, 4, 0, 2], "append puts a block at the tail: the most recently freed"
    q.remove(blocks[2])  # the tail
    q.remove(blocks[1])  # the head
    assert walk(q) == [3, 4, 0]
    for _ in range(3):
        q.popleft()
    assert walk(q) == []
    with pytest.raises(OutOfBlocks):
        q.popleft()


def test_reference_counts_and_stored_tokens():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert (a.ref_cnt, b.ref_cnt) == (1, 1) and pool.num_free == 2, "allocate: count 1, out of the free queue"
    pool.fill(a, 4)
    pool.fill(b, 2)
    pool.register(a, hash_block(None, (1, 2, 3, 4)), None, (1, 2, 3, 4))
    assert pool.num_stored == 6
    pool.touch([a])  # a second request hits a
    assert a.ref_cnt == 2 and pool.num_free == 2
    pool.free([b, a])  # the first request ends, tail first
    assert (a.ref_cnt, b.ref_cnt) == (1, 0), "free: each count - 1"
    assert pool.num_free == 3 and pool.num_stored == 4, "b is idle now: queued, and its 2 tokens no longer stored"
    pool.free([a])
    assert a.ref_cnt == 0 and pool.num_free == 4 and pool.num_stored == 0
    assert a.block_hash is not None and pool.cached[a.block_hash] is a, "an idle block keeps its name (lazy eviction)"
    with pytest.raises(ValueError, match="double free"):
        pool.free([a])
    pool.touch([a])  # a hit on an idle block takes it out of the queue again
    assert a.ref_cnt == 1 and pool.num_free == 3 and pool.num_stored == 4
    with pytest.raises(OutOfBlocks):
        pool.allocate(4)
    assert pool.num_free == 3, "a refused allocate takes nothing"
    got = pool.allocate(3)
    assert a not in got and pool.evictions == 0, "only idle blocks are handed out; none of them had a name"
