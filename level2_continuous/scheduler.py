"""The iteration-level scheduler: who runs how many tokens in the next step.

What it is: vLLM V1's policy, written to be read. At every step, within a token budget
(`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`):

  1. Running requests first, in order. Each asks for all its uncomputed tokens: one
     for a decode, the rest of its prompt for a prefill, cut to what the budget has left
     (chunked prefill: the rest comes next step). If the KV cache has no room, preempt
     a victim (the last admitted under FCFS; the lowest priority, latest arrival under
     "priority"): free its blocks, send it back to the head of the waiting queue, and try
     again. A request that must preempt itself waits for the next step.
  2. Then waiting requests, oldest first (or by priority), while budget, seats and
     blocks last. Not in a step that preempted: the memory is too tight to add anyone.

    step t:  budget 8 tokens    running: A (decode) B (decode) C (prefill, 9 left)
             scheduled          A:1  B:1  C:6  -> C gets the rest (3) at step t+1

The scheduler decides; it never touches a tensor. `schedule()` returns a
`SchedulerOutput` (which requests run how many tokens), the engine runs the model,
and the engine's `update_from_output` moves the counters on.

What it is not: fair beyond FCFS, aware of prefix sharing (level 3 adds that through
the KV manager's hooks), or able to swap KV to the CPU (preemption is by recompute).

Reference: vLLM V1 `v1/core/sched/scheduler.py`; Yu et al., "Orca" (OSDI 2022);
Agrawal et al., "Sarathi-Serve" (OSDI 2024) for chunked prefill.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager
from .request import FINISH_STATUS, Request, RequestStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens this step), batch order
    preempted: list[Request] = field(default_factory=list)
    num_prefill_tokens: int = 0  # prompt tokens, or prompt + output again after a preemption
    num_spec: dict[int, int] = field(default_factory=dict)  # seq_id -> draft tokens among its tokens (level 4)

    def add(self, req: Request, n: int, num_spec: int = 0) -> None:
        """n new tokens, plus num_spec speculative ones to verify (level 4)."""
        self.scheduled.append((req, n + num_spec))
        if num_spec:
            self.num_spec[req.seq_id] = num_spec
        if not _is_decode(req):
            self.num_prefill_tokens += n

    def remove(self, req: Request) -> int:
        """Take a request back out (it was preempted later in the same step); its tokens."""
        k = next(j for j, (r, _) in enumerate(self.scheduled) if r is req)
        n = self.scheduled.pop(k)[1]
        spec = self.num_spec.pop(req.seq_id, 0)
        if not _is_decode(req):
            self.num_prefill_tokens -= n - spec
        return n

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


def _is_decode(req: Request) -> bool:
    """Feeding the token sampled last step (not a prompt, nor a recomputation after preemption)."""
    return bool(req.output_token_ids) and req.num_computed_tokens == req.num_tokens - 1


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int, policy: str = "fcfs"):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"policy={policy!r} is not one of: fcfs, priority")
        self.kv, self.policy = kv, policy
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step's decision -------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out, budget = SchedulerOutput(), self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_uncomputed_tokens, budget)
            k = self.num_lookahead_tokens(req, n, budget - n)  # level 4's draft tokens; 0 here
            while not self.kv.allocate_slots(req, n, num_lookahead_tokens=k):
                if k:  # speculation is optional: drop it before preempting anyone
                    k = 0
                    continue
                victim = self._pick_victim()
                if self.running.index(victim) < i:  # (priority policy) already scheduled this step:
                    budget += out.remove(victim)  # take its tokens back
                    i -= 1
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.add(req, n, k)
                budget -= n + k
                i += 1
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self._next_waiting()
            computed_blocks, num_computed = self.kv.get_computed_blocks(req)
            req.set_computed(num_computed)
            n = min(req.num_uncomputed_tokens, budget)
            if not self.kv.allocate_slots(req, n, computed_blocks):
                req.set_computed(0)
                break  # head-of-line: later requests wait too, so nobody jumps the queue
            self.waiting.remove(req)
            req.to(RequestStatus.RUNNING)
            self.running.append(req)
            out.add(req, n)
            budget -= n

    def num_lookahead_tokens(self, req: Request, n: int, budget_left: int) -> int:
        """Speculative tokens to verify with this request's n new tokens: none at level 2."""
        return 0

    def _next_waiting(self) -> Request:
        if self.policy == "priority":
            return min(self.waiting, key=lambda r: (r.priority, r.metrics.arrival_time))
        return self.waiting[0]

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.metrics.arrival_time))
        return self.running[-1]

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.set_computed(0)  # recompute: prompt + output are prefilled again later
        req.num_preemptions += 1
        req.to(RequestStatus.PREEMPTED)
        req.to(RequestStatus.WAITING)
        self.waiting.appendleft(req)
        out.preempted.append(req)

    # --- a request leaves ---------------------------------------------------------------
    def finish(self, req: Request, reason: str | None = None) -> None:
        """Take a request out (finished by a stop rule, or aborted) and free its blocks now."""
        if reason is not None:  # an abort; stop rules already set finish_reason
            req.finish(reason)
        else:
            req.to(FINISH_STATUS[req.finish_reason])
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)  # also for a waiting request: level 3 may hold its block names
