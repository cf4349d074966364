"""Level 2's scheduler, with `n` samples that fork after their prompt instead of each prefilling it.

What it is: `ForkingScheduler`. Sample 0 of a request with `n` > 1 is admitted as usual; samples
1 .. n-1 wait (in the queue, in their places) until sample 0's prompt is in the cache, then are
admitted as forks (level 2's `admissible` leaves them out until then): the KV manager
(`fork_at_admission`, copy_on_write.py) hands each the parent's blocks for all
but the prompt's last token, by reference count, and the sample computes that one token itself,
which gives it its own logits row to sample its first token from (and, through
copy-on-write, its own copy of the shared last block). The prompt is computed once, not n times,
and its blocks are held once, not n times:

    n = 3, prompt 21 tokens, block_size 8:
    step t     sample 0 prefills 21 tokens            blocks [b0 b1 b2]
    step t+1   samples 1, 2 admitted as forks          [b0 b1 b2'] [b0 b1 b2'']  (b2 copied on write)
               and compute token 20 each (1 token, not 21)

The cost: samples 1 .. n-1 get their first token one step after sample 0. Without forking
(level 2, and vLLM V1, which relies on the prefix cache instead), all n are admitted in the
same step, and each prefills its own copy: the prompt's blocks are named only after the step.

A sample does not wait when its parent finished or was aborted (it prefills as usual, and
may still hit the prefix cache); when its parent is preempted, it waits until the parent is
admitted again and has recomputed its prompt (a delay, never a deadlock: the parent comes
first in the queue). Nor does it wait when it asks for prompt logprobs (every sample then
computes its prompt). Level 4 with a draft model turns forking off (`fork_samples=False`): its
draft's cache would need the same copies.

What it is not: beam search (`beam_search.py` forks at every step, outside the scheduler).

Reference: Kwon et al., SOSP 2023, section 4.4 (parallel sampling); vLLM V0's `SequenceGroup.fork`.
"""

from __future__ import annotations

from level2_continuous.request import Request, RequestStatus
from level2_continuous.scheduler import Scheduler


class ForkingScheduler(Scheduler):
    def __init__(self, *args, fork_samples: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.fork_samples = fork_samples
        self.parents: dict[str, Request] = {}  # request_id -> its sample 0, while samples may fork from it

    def add(self, req: Request) -> None:
        if self.fork_samples and req.params.n > 1 and req.params.prompt_logprobs is None:
            if req.index == 0:
                self.parents[req.request_id] = req
            elif (parent := self.parents.get(req.request_id)) is not None:
                self.kv.fork_at_admission(req, parent)
        super().add(req)

    def _must_wait(self, req: Request) -> bool:
        """A fresh sample whose parent is alive but has not computed its prompt yet."""
        parent = self.parents.get(req.request_id) if req.index > 0 and not req.output_token_ids else None
        if parent is None or parent.is_finished:
            return False
        return parent.status is not RequestStatus.RUNNING or parent.num_computed_tokens < req.num_tokens - 1

    def admissible(self) -> list[Request]:
        """Level 2's waiting queue, less the samples that must wait and the requests whose KV a
        connector is still receiving (vLLM's WAITING_FOR_REMOTE_KVS): they keep their places in it."""
        return [r for r in self.waiting if not self._must_wait(r) and not self.kv.waiting_for_kv(r)]

    def finish(self, req: Request, reason: str | None = None) -> None:
        super().finish(req, reason)
        if req.index == 0 and self.parents.get(req.request_id) is req:
            del self.parents[req.request_id]  # its samples no longer wait for it
