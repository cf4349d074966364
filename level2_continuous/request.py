"""A request as the scheduler sees it: level 0's `Sequence` plus an explicit state machine.

What it is: the life of one sample of one request,

                 schedule                  EOS / stop / max_tokens
    WAITING ─────────────────> RUNNING ─────────────────────────> FINISHED_STOPPED
       ^                         │  │                             FINISHED_LENGTH
       │   requeue               │  └─────── abort ─────────────> FINISHED_ABORTED
    PREEMPTED <──────────────────┘  (out of KV blocks: blocks freed, tokens kept)

plus `num_computed_tokens`: how many of its tokens (prompt + output) have their K/V in
the cache. Each step the scheduler gives it `num_tokens - num_computed_tokens` more
(a whole prompt, a chunk of one, or the one token sampled last step). Preemption by
recompute sets it back to 0, and the request later prefills prompt + output again.

What it is not: the owner of its KV blocks. The `KVCacheManager` keeps each request's
block table (`kv_manager.block_table(request)`), so a level can change how blocks are
found and shared without touching this class (level 3 admits a request with a cached prefix
computed; level 4 feeds guesses past its last token, each with a logits row).

Reference: vLLM V1 `v1/request.py` (Request, RequestStatus).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from level0_naive.outputs import Sequence


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


ALLOWED = {
    RequestStatus.WAITING: {RequestStatus.RUNNING, RequestStatus.FINISHED_ABORTED},
    RequestStatus.RUNNING: {
        RequestStatus.PREEMPTED,
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
    },
    RequestStatus.PREEMPTED: {RequestStatus.WAITING},
}
FINISH_STATUS = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "abort": RequestStatus.FINISHED_ABORTED,
}


@dataclass
class Request(Sequence):
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    priority: int = 0  # lower runs first under policy="priority" (vLLM's convention)
    num_preemptions: int = 0

    def to(self, new: RequestStatus) -> None:
        """Move along the state machine; an illegal move is a bug, so it raises."""
        if new not in ALLOWED.get(self.status, set()):
            raise RuntimeError(
                f"request {self.request_id}#{self.index}: illegal transition {self.status.name} -> {new.name}"
            )
        self.status = new

    @property
    def num_uncomputed_tokens(self) -> int:
        """What the scheduler gives it next: every token whose K/V the cache lacks."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Feeding the token sampled last step (not a prompt, nor a recomputation after preemption)."""
        return bool(self.output_token_ids) and self.num_computed_tokens == self.num_tokens - 1

    def num_logits(self, n: int) -> int:
        """Logits rows for a chunk of its next n tokens: one per position from its last known
        token on (1 when the chunk reaches its end, 0 for a prompt chunk that stops short)."""
        return max(0, self.num_computed_tokens + n - self.num_tokens + 1)

    def set_computed(self, n: int) -> None:
        """The cache holds exactly this request's first n tokens: what the KV manager found at
        admission (0 here), or 0 after a preemption."""
        self.num_computed_tokens = n

    def finish(self, reason: str) -> None:
        super().finish(reason)
        self.to(FINISH_STATUS[reason])
