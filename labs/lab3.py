"""Lab 3: chained block hashing and the O(1) LRU free queue of the prefix cache.

What it is: the lab's definition (see `labs/spec.py`): `hash_block` in
`level3_prefix/block_hash.py`; in `level3_prefix/block_pool.py`, the doubly linked
`FreeBlockQueue` (`append`, `remove`, `popleft`) and the pool's reference counting (`touch`,
`allocate`, `free`, `_evict`); the checks (level 3's
own tests, including the one that pins the eviction order, and `labs/lab3_checks.py`);
the planted bugs (a free that forgets to decrement the count, a hash that forgets its
parent); and the experiment: time to first token on a shared system prompt, and hit rate
against prefix length (`labs/lab3_experiment.py`).

What it is not: the handout (docs/labs/lab3_prefix.md).
"""

from __future__ import annotations

from .spec import Bug, Check, Experiment, Lab, Module, Part

L3 = "tests/test_level3.py::"
OWN = "labs/lab3_checks.py::"

HASH_PARTS = (
    Part(
        "hash_block",
        """\
The name of a full block: SHA-256 over, in this order,
  the parent's name (32 zero bytes for the first block: b"\\0" * 32),
  the token ids as little-endian 64-bit integers (struct.pack(f"<{len(tokens)}q", *tokens)),
  repr(key).encode() for each extra key,
and return the 32-byte digest. The parent makes the name stand for the whole prefix, not one block.""",
    ),
)

POOL_PARTS = (
    Part(
        "FreeBlockQueue.append",
        """\
Put b at the tail (the most recently freed end), between self.tail.prev and the sentinel self.tail;
set all four links; size + 1. O(1).""",
    ),
    Part(
        "FreeBlockQueue.remove",
        """\
Unlink b from wherever it is (its neighbours point at each other), clear b.prev and b.next, size - 1. O(1):
this is why the queue is a linked list threaded through the blocks and not a deque.""",
    ),
    Part(
        "FreeBlockQueue.popleft",
        """\
Take the block at the head (the least recently freed) out and return it; OutOfBlocks if the queue is
empty.""",
    ),
    Part(
        "BlockPool.touch",
        """\
A request starts using these cached blocks: each one's ref_cnt + 1. A block that was idle (ref_cnt 0)
is in the free queue: take it out (remove), and its tokens count as stored again
(self.num_stored += b.num_tokens).""",
    ),
    Part(
        "BlockPool.allocate",
        """\
n blocks for new tokens, or OutOfBlocks if fewer than n are free (check first: all or nothing).
Each comes from the head of the free queue (the least recently used), loses its old name
(self._evict(b): lazy eviction), and starts with ref_cnt 1 and num_tokens 0.""",
    ),
    Part(
        "BlockPool._evict",
        """\
Its content is about to be overwritten: if it has a name, forget it: delete self.cached[name] only if it
still points to this block (another block may hold the name now), clear block_hash, parent_hash and
tokens, and count self.evictions += 1.""",
    ),
    Part(
        "BlockPool.free",
        """\
ref_cnt - 1 for each block, in the order given (the manager passes a request's blocks tail first).
A count already at 0 is a bug: ValueError("double free of block ..."). A block whose count reaches 0
joins the tail of the free queue *keeping its name and contents*, and its tokens stop counting as
stored (self.num_stored -= b.num_tokens).""",
    ),
)

CHECKS = (
    Check("hash", "block names are SHA-256, chained through the parent, stable across processes",
          (L3 + "test_hash_is_stable_and_chained", OWN + "test_names_chain_through_the_parent"),
          "hash_block hashes the parent's name (32 zero bytes for the first block), then the tokens as "
          "little-endian int64, then repr() of each extra key. Without the parent, two different prefixes "
          "ending in the same block would share its K/V.",
          rule="A block's name depends on its tokens and on everything before them (its parent's name), and is the "
               "same in every process."),
    Check("queue", "the free queue: O(1) append, remove from the middle, popleft of the oldest",
          (OWN + "test_free_queue_is_a_linked_list",),
          "append links b before the tail sentinel, remove links b's neighbours to each other (and clears b's "
          "links), popleft removes head.next; keep size in step, and raise OutOfBlocks on an empty popleft.",
          rule="The free queue keeps idle blocks in the order they were freed; adding one, taking one out of the "
               "middle and taking the oldest each take constant time, however long the queue."),
    Check("ref-counts", "reference counts: touch +1, free -1, an idle block is queued with its name kept",
          (L3 + "test_prefix_cache_state_machine", OWN + "test_reference_counts_and_stored_tokens"),
          "touch: ref_cnt + 1, out of the free queue if it was idle; free: ref_cnt - 1 (ValueError on a double "
          "free), to the queue's tail when it reaches 0, name and contents kept; num_stored follows blocks in "
          "use. A missing decrement leaks the block forever.",
          rule="A block's reference count is the number of requests using it and never goes below zero; at zero the "
               "block is evictable but keeps its name and contents."),
    Check("eviction", "eviction is LRU, lazy, and takes a request's tail first",
          (L3 + "test_eviction_takes_the_least_recent_and_a_requests_tail_first",
           L3 + "test_eviction_order_is_one_lru_queue_and_a_requests_tail_goes_first"),
          "allocate() takes the head of the free queue (the least recently freed), whatever it holds (never "
          "prefer empty blocks), and only then drops its name (_evict). A cache hit (touch) takes a block out "
          "of the middle of the queue.",
          rule="The block reused first is the one idle the longest (LRU), whatever it holds; its name is dropped "
               "only when it is reused; a request's blocks become evictable tail first."),
    Check("hits", "a repeated prompt, a conversation's next turn: the cache is hit, the answers unchanged",
          (L3 + "test_a_repeated_prompt_skips_its_cached_prefill", L3 + "test_block_aligned_prompt_still_computes_its_last_token",
           L3 + "test_conversation_turns_hit_the_previous_answer"),
          "Hits are found by walking the chain of names; a block must keep its name while it sits idle in the "
          "queue, and lose it only when allocate() hands it out again.",
          rule="A cached prefix is found again as long as its blocks were not reused, and an answer with a cache hit "
               "equals the answer without."),
)  # fmt: skip

BUGS = (
    Bug("no-decrement", "level3_prefix.block_pool", "            b.ref_cnt -= 1\n", "", ("ref-counts",)),
    Bug(
        "unchained-hash",
        "level3_prefix.block_hash",
        '    h = hashlib.sha256(parent or b"\\0" * 32)\n',
        '    h = hashlib.sha256(b"\\0" * 32)\n',
        ("hash",),
    ),
)

LAB = Lab(
    id="3",
    topic="the prefix cache: chained block hashes, reference counts, the O(1) LRU free queue",
    handout="lab3_prefix.md",
    modules=(Module("level3_prefix.block_hash", HASH_PARTS), Module("level3_prefix.block_pool", POOL_PARTS)),
    checks=CHECKS,
    bugs=BUGS,
    experiment=Experiment(
        "labs.lab3_experiment", (), ("--prefix-lengths", "0", "40", "--questions", "3", "--max-tokens", "2")
    ),  # fmt: skip
    minutes=90,
)
