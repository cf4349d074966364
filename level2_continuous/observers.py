"""Step observers: a look at the engine after every step, for whoever wants one.

What it is: the seam the live dashboard, a simulator's timeline and tests plug into. An
observer is any callable `observer(record, snapshot)`; the engine calls each one once per
step that ran (`LLMEngine(..., observers=[...])`), after the step's bookkeeping, with

  - the step's `StepRecord` (engine.py: when, how many running and waiting, tokens,
    preemptions, seconds), and
  - a `KVSnapshot`: the block pool and the queues as they are between two steps, copied
    into tuples, so an observer can keep it, draw it later, or compare two of them:

        requests       (request_id, sample index, status, block ids in logical order), running first
        ref_counts     one per physical block: how many running requests hold it (0: free)
        cached_free    free blocks that still hold a named prefix (level 3), least recently
                       freed first: the order they will be evicted in
        num_free_blocks, num_blocks, block_size

With no observer registered nothing is built: the engine's step costs what it did.

What it is not: a way to change the engine. A snapshot is a copy, and the engine never
reads anything back from an observer (an observer that raises stops the step with its
exception, as any bug in the engine would).

Reference: vLLM's `StatLoggerBase` (called once per step with the scheduler's stats);
mini-sglang's `check_integrity()`, which walks the same state when idle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestBlocks:
    request_id: str
    index: int  # which of the request's n samples
    status: str  # "running", "waiting", "preempted"
    block_ids: tuple[int, ...]  # physical blocks, logical order (empty while waiting)


@dataclass(frozen=True)
class KVSnapshot:
    num_blocks: int
    block_size: int
    num_free_blocks: int
    requests: tuple[RequestBlocks, ...]  # running requests first (schedule order), then the waiting queue
    ref_counts: tuple[int, ...]  # [num_blocks]
    cached_free: tuple[int, ...]  # free blocks still holding a named prefix, next to be evicted first

    @property
    def running(self) -> tuple[str, ...]:
        return tuple(r.request_id for r in self.requests if r.status == "running")

    @property
    def waiting(self) -> tuple[str, ...]:
        return tuple(r.request_id for r in self.requests if r.status != "running")


StepObserver = Callable[[object, KVSnapshot], None]  # (engine.StepRecord, its snapshot) -> nothing


def snapshot(kv, running: list, waiting: list) -> KVSnapshot:
    """Copy the KV manager's state and the two queues (the engine calls this between steps)."""
    reqs = [RequestBlocks(r.request_id, r.index, "running", tuple(kv.block_table(r))) for r in running]
    reqs += [RequestBlocks(r.request_id, r.index, r.status.value, ()) for r in waiting]
    return KVSnapshot(kv.num_blocks, kv.block_size, kv.num_free_blocks, tuple(reqs), tuple(kv.ref_counts()),
                      tuple(kv.cached_free_blocks()))  # fmt: skip
