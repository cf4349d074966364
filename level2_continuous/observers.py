"""Step observers: a look at the engine after every step, for whoever wants one.

What it is: the seam a live view, a simulator's timeline and tests plug into. An
observer is any callable `observer(record, snapshot)`; the engine calls each one once per
step that ran (`LLMEngine(..., observers=[...])`), after the step's bookkeeping, with

  - the step's `StepRecord` (engine.py: when, how many running and waiting, tokens,
    preemptions, seconds), and
  - a `KVSnapshot`: the block pool and the queues as they are between two steps, copied
    into tuples, so an observer can keep it, draw it later, or compare two of them:

        requests       (request_id, sample index, status, block ids in logical order, and its
                       progress: prompt, output and computed tokens, preemptions, max_tokens), running first
        ref_counts     one per physical block: how many running requests hold it (0: free)
        cached_free    free blocks that still hold reusable content (none here), least
                       recently freed first: the order they will be evicted in
        num_free_blocks, num_blocks, block_size

With no observer registered nothing is built: the engine's step costs what it did. An
observer that only needs a snapshot now and then (a live view: a few a second) says so
with a `wants_snapshot(record) -> bool` method; the engine builds the snapshot only when
some observer wants it, and calls the others with `None` in its place. An observer without
that method gets a snapshot every step.

What it is not: a way to change the engine. A snapshot is a copy, and the engine never
reads anything back from an observer (an observer that raises stops the step with its
exception, as any bug in the engine would). Level 3 fills `cached_free`, and level 6's
dashboard is an observer.

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
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache (0 again after a preemption)
    num_preemptions: int = 0
    max_tokens: int = 0  # the output it may grow to (its SamplingParams')


@dataclass(frozen=True)
class KVSnapshot:
    num_blocks: int
    block_size: int
    num_free_blocks: int
    requests: tuple[RequestBlocks, ...]  # running requests first (schedule order), then the waiting queue
    ref_counts: tuple[int, ...]  # [num_blocks]
    cached_free: tuple[int, ...]  # free blocks still holding reusable content, next to be evicted first

    @property
    def running(self) -> tuple[str, ...]:
        return tuple(r.request_id for r in self.requests if r.status == "running")

    @property
    def waiting(self) -> tuple[str, ...]:
        return tuple(r.request_id for r in self.requests if r.status != "running")


StepObserver = Callable[[object, "KVSnapshot | None"], None]  # (engine.StepRecord, its snapshot) -> nothing


def wants_snapshot(observer: StepObserver, record) -> bool:
    """Does this observer want this step's snapshot? (Yes, unless it says otherwise.)"""
    asks = getattr(observer, "wants_snapshot", None)
    return asks is None or bool(asks(record))


def notify(observers: list[StepObserver], record, kv, running: list, waiting: list) -> None:
    """Call every observer with `record` and a snapshot, built once and only if one of them wants it."""
    wanted = [wants_snapshot(o, record) for o in observers]
    snap = snapshot(kv, running, waiting) if any(wanted) else None
    for observe, want in zip(observers, wanted):
        observe(record, snap if want else None)


def _progress(r) -> tuple[int, int, int, int, int]:
    return (len(r.prompt_token_ids), len(r.output_token_ids), r.num_computed_tokens, r.num_preemptions,
            r.params.max_tokens or 0)  # fmt: skip


def snapshot(kv, running: list, waiting: list) -> KVSnapshot:
    """Copy the KV manager's state and the two queues (the engine calls this between steps)."""
    reqs = [RequestBlocks(r.request_id, r.index, "running", tuple(kv.block_table(r)), *_progress(r)) for r in running]
    reqs += [RequestBlocks(r.request_id, r.index, r.status.value, (), *_progress(r)) for r in waiting]
    return KVSnapshot(kv.num_blocks, kv.block_size, kv.num_free_blocks, tuple(reqs), tuple(kv.ref_counts()),
                      tuple(kv.cached_free_blocks()))  # fmt: skip
