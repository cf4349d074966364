"""The fork and copy-on-write: sequences share blocks by reference count, and a write into a shared block copies it first.

What it is: PagedAttention's fork (section 4.4 of the paper), in three parts:

  - `CopyOnWrite`, the books: `fork` gives a child its parent's blocks (each one's count + 1,
    nothing copied); `blocks_to_copy` finds the blocks a step's positions write into that
    another sequence holds too; `copy_block` swaps such a block for a fresh one holding the
    same tokens and records (old, new) for the step. It also forks `n` samples of one prompt
    at admission (`fork_at_admission`, `forked_prefix`): a sample takes its parent's blocks
    for all but the prompt's last token instead of prefilling it.

        parent  [ b3 | b8 | b5 (10 of 16) ]     fork      child [ b3 | b8 | b5 ]    b5 ref 2
        child appends a token at position 42 -> b5 is shared -> copy b5 to b11, b5 ref 1:
        parent  [ b3 | b8 | b5 ]   child [ b3 | b8 | b11 (b5's 10 tokens, then its own) ]

    Full blocks are never written again, so they stay shared for good; only the last,
    partial block is ever copied, and only once per fork.

  - `CopyOnWriteInput`, level 1's `ModelInput` plus the step's copies `block_copies [C, 2]`
    (src, dst): the engine attaches them (`with_copies`) to the step that needs them.
  - `CopyOnWriteAttention`, level 1's attention backend, which makes each copy in every layer
    before the step writes anything: where a copy-on-write copy is made. Layer by layer, so a
    pipeline stage (level 5) copies exactly the layers it holds, and every rank does it from
    the same input.

What it is not: beam search (beam_search.py chooses the beams; this keeps their blocks) or
the prefix cache (prefix_cache.py: sharing across requests, by name, not by fork).

Reference: Kwon et al., SOSP 2023, section 4.4 (parallel sampling, beam search); vLLM V0's
`BlockSpaceManager.fork` and `cache_engine.copy` (V1 relies on the prefix cache instead).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from level1_paged.block_table import blocks_for
from level1_paged.kv_cache import PagedAttention
from level1_paged.model_input import ModelInput

from .block_pool import BlockPool, KVBlock


class CopyOnWrite:
    """Forks and their copies over one block pool (see the module docstring)."""

    def __init__(self, pool: BlockPool, block_size: int):
        self.pool, self.block_size = pool, block_size
        self.block_copies: list[tuple[int, int]] = []  # (src, dst) copies the next step must make
        self.num_copied = 0  # copies made since the start (the fork's only cost in memory traffic)
        self.parents: dict[int, object] = {}  # seq_id of a sample to fork at admission -> its parent
        self.granted: set[int] = set()  # of those, the ones whose last lookup was answered with the fork
        self.forked_tokens = 0  # tokens samples took from their parent at admission instead of computing

    # --- the fork ----------------------------------------------------------------------
    def fork(self, blocks: list[KVBlock]) -> list[KVBlock]:
        """A child's blocks: the parent's, each one's count + 1, in a list of its own; nothing is copied."""
        shared = list(blocks)
        self.pool.touch(shared)
        return shared

    def fork_at_admission(self, child, parent) -> None:
        """When `child` (a fresh sample of the same prompt) is admitted, it takes the blocks of its prompt
        but the last token from `parent`, if the parent still holds them computed (else it prefills as usual)."""
        self.parents[child.seq_id] = parent

    def forked_prefix(self, req, req_blocks: dict[int, list[KVBlock]]) -> tuple[list[KVBlock], int] | None:
        """At `req`'s lookup: its parent's blocks and the tokens they give it (all but its last, partial
        block too), or None where it has no parent to fork from now."""
        self.granted.discard(req.seq_id)
        parent = self.parents.get(req.seq_id)
        if parent is None or parent.seq_id not in req_blocks or parent.num_computed_tokens < req.num_tokens - 1:
            return None
        n = req.num_tokens - 1
        self.granted.add(req.seq_id)
        return req_blocks[parent.seq_id][: blocks_for(n, self.block_size)], n

    def took_fork(self, req) -> bool:
        """At `req`'s admission: was it the fork its lookup granted? (Then it is counted, and forks no more.)"""
        if req.seq_id not in self.granted:
            return False
        self.forked_tokens += req.num_computed_tokens
        self.parents.pop(req.seq_id)
        self.granted.discard(req.seq_id)
        return True

    def forget(self, req) -> None:
        """`req` gives its blocks back: it forks from no one any more."""
        self.parents.pop(req.seq_id, None)
        self.granted.discard(req.seq_id)

    # --- copy-on-write -------------------------------------------------------------------------
    def blocks_to_copy(self, held: list[KVBlock], num_own: int, start: int, end: int) -> list[int]:
        """Indices into `held` of the blocks that positions [start, end) write into and that another
        sequence holds too: each needs a copy of its own first. `held` is the sequence's blocks, then
        (from index `num_own` on) the hit or forked blocks it is about to touch, which count +1 then."""
        bs = self.block_size
        writes = range(start // bs, min(len(held), blocks_for(end, bs)))
        return [i for i in writes if held[i].ref_cnt + (i >= num_own) > 1]

    def copy_block(self, blocks: list[KVBlock], i: int, num_filled: int) -> None:
        """Swap the shared blocks[i] for a fresh block holding the same tokens (`num_filled` is how many
        tokens of the sequence its blocks hold): record (old, new) for the step's copy, and drop this
        sequence's reference to the old one, which the others still hold."""
        old, (new,) = blocks[i], self.pool.allocate(1)
        self.pool.fill(new, max(0, min(self.block_size, num_filled - i * self.block_size)))
        self.block_copies.append((old.block_id, new.block_id))
        self.num_copied += 1
        blocks[i] = new
        self.pool.free([old])  # still held by the others (ref >= 1)

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The copies recorded since the last call, for the next step's input (`CopyOnWriteInput`)."""
        copies, self.block_copies = self.block_copies, []
        return copies


@dataclass
class CopyOnWriteInput(ModelInput):
    """Level 1's step input, plus the blocks to copy before the step writes."""

    block_copies: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 2, dtype=torch.long))  # [C, 2] long

    @classmethod
    def with_copies(cls, mi: ModelInput, copies: list[tuple[int, int]]) -> ModelInput:
        """`mi` and the (src, dst) copies its step must make first; `mi` itself when there are none."""
        if not copies:
            return mi
        parts = {f.name: getattr(mi, f.name) for f in fields(mi)}
        return cls(**parts, block_copies=torch.tensor(copies, dtype=torch.long).reshape(-1, 2))  # [C, 2]

    def attention_backend(self, cache, impl, scale: float) -> PagedAttention:
        return CopyOnWriteAttention(cache, self, impl, scale)


class CopyOnWriteAttention(PagedAttention):
    """Level 1's backend that first copies, in each layer, every (src, dst) block of the step's input."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]  # [N, bs, Hkv, D]
        src, dst = self.meta.block_copies[:, 0], self.meta.block_copies[:, 1]  # [C] each; all read before any written
        k_cache[dst], v_cache[dst] = k_cache[src], v_cache[src]
        return super().__call__(layer, q, k, v)


__all__ = ["CopyOnWrite", "CopyOnWriteInput", "CopyOnWriteAttention"]
