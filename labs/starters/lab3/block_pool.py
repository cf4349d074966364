# Lab 3: your copy of level3_prefix/block_pool.py.
# Fill in every function that raises NotImplementedError (search for TODO), then run
#     python -m labs check 3 THIS_FILE
# Made by `python -m labs starters` from the reference; everything else is the reference, unchanged.
"""A block pool whose freed blocks stay cached: hash-named, ref-counted, evicted LRU.

What it is: level 1's allocator grown into vLLM V1's `BlockPool`. Every block has a
reference count (how many running requests use it) and, once full, a name: the hash
of its tokens chained to its parent's hash (`hash_block`). A block whose count drops
to 0 is *not* wiped: it joins the free queue with its contents and its name, and a
later request with the same prefix can take it back (`touch`). Only when `allocate`
pops it for new tokens is its name dropped (lazy eviction).

    free queue (LRU first)           cached: hash -> block
    head <-> b7 <-> b2 <-> b9 <-> tail      h(A) -> b2    h(A,B) -> b9

    allocate(): pops b7 (oldest). touch([b9]): b9 leaves the queue from the middle.

The free queue is a doubly linked list threaded through the blocks themselves, so
removing a touched block from the middle is O(1) (a `deque.remove` would be O(n)).
The pool also counts the tokens stored in blocks someone uses (`num_stored`), a shared
block once, updated as blocks are filled, touched and freed: usage is never a walk.

What it is not: the per-request bookkeeping (that is `kv_cache_manager.py`), and not a
radix tree: sharing is only at whole-block granularity, as in vLLM.

Reference: vLLM `docs/design/prefix_caching.md`, `v1/core/block_pool.py`,
`v1/core/kv_cache_utils.py` (FreeKVCacheBlockQueue, hash_block_tokens).
"""

from __future__ import annotations

import hashlib  # noqa: F401 (your code will need it)
import struct  # noqa: F401 (your code will need it)

from level1_paged.block_allocator import OutOfBlocks  # noqa: F401 (your code will need it)


def hash_block(parent: bytes | None, tokens: tuple[int, ...], extra: tuple = ()) -> bytes:
    """SHA-256 of (parent hash, token ids, extra keys) in a canonical byte encoding.

    Stable across processes and Python versions (unlike `hash()`), and 256 bits wide,
    so two different prefixes meeting on a name would take ~2**128 blocks. The pool
    also keeps each block's tokens and parent and checks them on every hit.
    """
    # TODO (lab 3): hash_block
    # The name of a full block: SHA-256 over, in this order,
    #   the parent's name (32 zero bytes for the first block: b"\0" * 32),
    #   the token ids as little-endian 64-bit integers (struct.pack(f"<{len(tokens)}q", *tokens)),
    #   repr(key).encode() for each extra key,
    # and return the 32-byte digest. The parent makes the name stand for the whole prefix, not one block.
    raise NotImplementedError("lab 3: write hash_block")


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "num_tokens", "block_hash", "parent_hash", "tokens", "prev", "next")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.num_tokens = 0  # token slots holding K/V (a full block: block_size)
        self.block_hash: bytes | None = None  # set once full and registered
        self.parent_hash: bytes | None = None
        self.tokens: tuple[int, ...] | None = None  # what the name claims, checked on every hit
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self):
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, least recently freed at the head. All O(1)."""

    def __init__(self, blocks: list[KVBlock]):
        self.head, self.tail = KVBlock(-1), KVBlock(-2)  # sentinels
        self.head.next, self.tail.prev = self.tail, self.head
        self.size = 0
        for b in blocks:
            self.append(b)

    def append(self, b: KVBlock) -> None:
        # TODO (lab 3): FreeBlockQueue.append
        # Put b at the tail (the most recently freed end), between self.tail.prev and the sentinel self.tail;
        # set all four links; size + 1. O(1).
        raise NotImplementedError("lab 3: write FreeBlockQueue.append")

    def remove(self, b: KVBlock) -> None:
        # TODO (lab 3): FreeBlockQueue.remove
        # Unlink b from wherever it is (its neighbours point at each other), clear b.prev and b.next, size - 1. O(1):
        # this is why the queue is a linked list threaded through the blocks and not a deque.
        raise NotImplementedError("lab 3: write FreeBlockQueue.remove")

    def popleft(self) -> KVBlock:
        # TODO (lab 3): FreeBlockQueue.popleft
        # Take the block at the head (the least recently freed) out and return it; OutOfBlocks if the queue is
        # empty.
        raise NotImplementedError("lab 3: write FreeBlockQueue.popleft")

    def __iter__(self):
        b = self.head.next
        while b is not self.tail:
            yield b
            b = b.next

    def __len__(self) -> int:
        return self.size


class BlockPool:
    def __init__(self, num_blocks: int, hash_fn=hash_block):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: the KV budget must hold at least one block")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}  # name -> the block holding that content
        self.hash_fn = hash_fn
        self.evictions = 0
        self.num_stored = 0  # tokens in blocks with ref_cnt > 0, each block counted once

    @property
    def num_free(self) -> int:
        """Blocks nobody uses: empty ones and cached ones (evictable). All can be allocated."""
        return len(self.free_queue)

    def lookup(self, block_hash: bytes, parent: bytes | None, tokens: tuple[int, ...]) -> KVBlock | None:
        """The cached block with this name, if its recorded content really matches."""
        b = self.cached.get(block_hash)
        if b is None or b.tokens != tokens or b.parent_hash != parent:
            return None  # a (theoretical) hash collision never hands out foreign KV
        return b

    def touch(self, blocks: list[KVBlock]) -> None:
        """A request starts using cached blocks: count +1, and out of the free queue if idle."""
        # TODO (lab 3): BlockPool.touch
        # A request starts using these cached blocks: each one's ref_cnt + 1. A block that was idle (ref_cnt 0)
        # is in the free queue: take it out (remove), and its tokens count as stored again
        # (self.num_stored += b.num_tokens).
        raise NotImplementedError("lab 3: write BlockPool.touch")

    def allocate(self, n: int) -> list[KVBlock]:
        # TODO (lab 3): BlockPool.allocate
        # n blocks for new tokens, or OutOfBlocks if fewer than n are free (check first: all or nothing).
        # Each comes from the head of the free queue (the least recently used), loses its old name
        # (self._evict(b): lazy eviction), and starts with ref_cnt 1 and num_tokens 0.
        raise NotImplementedError("lab 3: write BlockPool.allocate")

    def _evict(self, b: KVBlock) -> None:
        """Its content is about to be overwritten: forget its name (lazy eviction)."""
        # TODO (lab 3): BlockPool._evict
        # Its content is about to be overwritten: if it has a name, forget it: delete self.cached[name] only if it
        # still points to this block (another block may hold the name now), clear block_hash, parent_hash and
        # tokens, and count self.evictions += 1.
        raise NotImplementedError("lab 3: write BlockPool._evict")

    def free(self, blocks: list[KVBlock]) -> None:
        """Count -1 each; idle blocks join the queue's tail in the order given."""
        # TODO (lab 3): BlockPool.free
        # ref_cnt - 1 for each block, in the order given (the manager passes a request's blocks tail first).
        # A count already at 0 is a bug: ValueError("double free of block ..."). A block whose count reaches 0
        # joins the tail of the free queue *keeping its name and contents*, and its tokens stop counting as
        # stored (self.num_stored -= b.num_tokens).
        raise NotImplementedError("lab 3: write BlockPool.free")

    def fill(self, b: KVBlock, num_tokens: int) -> None:
        """A block in use now holds `num_tokens` tokens (more after a step; fewer when a step's
        tokens past the newest known one are not kept)."""
        self.num_stored += num_tokens - b.num_tokens
        b.num_tokens = num_tokens

    def register(self, b: KVBlock, block_hash: bytes, parent: bytes | None, tokens: tuple[int, ...]) -> None:
        """Name a block that just became full. If the name is taken (two requests computed
        the same prefix at once), the first block keeps it and this one stays unnamed."""
        if block_hash in self.cached:
            return
        b.block_hash, b.parent_hash, b.tokens = block_hash, parent, tokens
        self.cached[block_hash] = b

    def reset(self) -> None:
        """Forget every name (the content stays until overwritten, but nobody can find it)."""
        for b in self.cached.values():
            b.block_hash = b.parent_hash = b.tokens = None
        self.cached.clear()
