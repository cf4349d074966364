"""A block pool whose freed blocks stay cached: hash-named, ref-counted, evicted LRU.

What it is: level 1's allocator grown into vLLM V1's `BlockPool`. Every block has a
reference count (how many running requests use it) and, once full, a name: the hash
of its tokens chained to its parent's hash (block_hash.py). A block whose count drops
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

What it is not: the per-request bookkeeping (that is `kv_cache_manager.py`), the lookup
(`prefix_cache.py`), and not a radix tree: sharing is only at whole-block granularity, as in vLLM.

Reference: vLLM `docs/design/prefix_caching.md`, `v1/core/block_pool.py`,
`v1/core/kv_cache_utils.py` (FreeKVCacheBlockQueue, hash_block_tokens).
"""

from __future__ import annotations

from level1_paged.block_allocator import OutOfBlocks

from .block_hash import hash_block


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
        last = self.tail.prev
        last.next, b.prev, b.next, self.tail.prev = b, last, self.tail, b
        self.size += 1

    def remove(self, b: KVBlock) -> None:
        b.prev.next, b.next.prev = b.next, b.prev
        b.prev = b.next = None
        self.size -= 1

    def popleft(self) -> KVBlock:
        if self.size == 0:
            raise OutOfBlocks("no free KV block")
        b = self.head.next
        self.remove(b)
        return b

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
        self.on_evict = None  # called with a named block about to be reused (a KV connector saves it)

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
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
                self.num_stored += b.num_tokens
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            self._evict(b)
            b.ref_cnt, b.num_tokens = 1, 0
            out.append(b)
        return out

    def _evict(self, b: KVBlock) -> None:
        """Its content is about to be overwritten: forget its name (lazy eviction)."""
        if b.block_hash is not None:
            if self.on_evict is not None:
                self.on_evict(b)  # its content is still there: the step that reuses it has not run
            if self.cached.get(b.block_hash) is b:
                del self.cached[b.block_hash]
            b.block_hash = b.parent_hash = b.tokens = None
            self.evictions += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Count -1 each; idle blocks join the queue's tail in the order given."""
        for b in blocks:
            if b.ref_cnt <= 0:
                raise ValueError(f"double free of block {b.block_id}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)
                self.num_stored -= b.num_tokens

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
