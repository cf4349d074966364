# Lab 2: your copy of level2_continuous/scheduler.py.
# Fill in every function that raises NotImplementedError (search for TODO), then run
#     python -m labs check 2 THIS_FILE
# Made by `python -m labs starters` from the reference; everything else is the reference, unchanged.
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
from .request import FINISH_STATUS, Request, RequestStatus  # noqa: F401 (your code will need it)


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
        # TODO (lab 2): Scheduler.schedule
        # One step's decision (docs/level2_continuous.md, "The schedule loop"). Start with
        # out, budget = SchedulerOutput(), self.max_num_batched_tokens.
        # 1. Running requests first, in order (self.running is in admission order), while budget is left:
        #    n = the request's uncomputed tokens (req.num_uncomputed_tokens), cut to the budget left: a prompt
        #        longer than that is cut here, and the rest comes next step (chunked prefill).
        #    k = self.num_lookahead_tokens(req, n, budget - n)   (level 4's draft tokens: always 0 at level 2)
        #    Room in the KV cache: self.kv.allocate_slots(req, n, num_lookahead_tokens=k), all or nothing.
        #    While it says no: if k > 0, drop it to 0 and ask again; otherwise preempt
        #    victim = self._pick_victim() with self._preempt(victim, out), and ask again. If the victim was
        #    req itself, it waits for the next step: go on with the next request.
        #    ("priority" can pick a victim you already scheduled this step: out.remove(victim) returns its
        #    tokens, which go back into the budget; mind your position in self.running.)
        #    With room: out.add(req, n, k); the budget loses n + k.
        # 2. Then the waiting requests: self._admit(out, budget), but not in a step that preempted anyone.
        # Return out.
        raise NotImplementedError("lab 2: write Scheduler.schedule")

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        # TODO (lab 2): Scheduler._admit
        # Admit waiting requests while budget is left and fewer than self.max_num_seqs requests run:
        #   req = self._next_waiting()  (FCFS: the head of the queue; "priority": the most urgent)
        #   computed_blocks, num_computed = self.kv.get_computed_blocks(req); req.set_computed(num_computed)
        #       (level 3's prefix-cache hit; nothing at level 2, but keep the call: level 3 runs your code too)
        #   n = its uncomputed tokens, cut to the budget left
        #   self.kv.allocate_slots(req, n, computed_blocks) says no: undo with req.set_computed(0) and stop
        #       admitting; nobody behind it may jump the queue.
        #   Otherwise it leaves self.waiting, req.to(RequestStatus.RUNNING), joins the end of self.running,
        #   out.add(req, n), and the budget loses n.
        raise NotImplementedError("lab 2: write Scheduler._admit")

    def num_lookahead_tokens(self, req: Request, n: int, budget_left: int) -> int:
        """Speculative tokens to verify with this request's n new tokens: none at level 2."""
        return 0

    def _next_waiting(self) -> Request:
        if self.policy == "priority":
            return min(self.waiting, key=lambda r: (r.priority, r.metrics.arrival_time))
        return self.waiting[0]

    def _pick_victim(self) -> Request:
        # TODO (lab 2): Scheduler._pick_victim
        # Whom to preempt when the KV cache is full (docs/level2_continuous.md, "Preemption"):
        #   "fcfs":     the most recently admitted running request
        #   "priority": the lowest priority, then the latest arrival: the running request with the largest
        #               (req.priority, req.metrics.arrival_time)
        raise NotImplementedError("lab 2: write Scheduler._pick_victim")

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        # TODO (lab 2): Scheduler._preempt
        # Preemption by recompute: the request gives back every block and will start over.
        #   It leaves self.running; self.kv.free(req); req.set_computed(0) (prompt + output are prefilled
        #   again when it returns); req.num_preemptions += 1; its status goes RUNNING -> PREEMPTED -> WAITING
        #   (req.to(...)); it goes to the head of self.waiting (it came before everyone still waiting);
        #   out.preempted.append(req). It keeps the tokens it generated.
        raise NotImplementedError("lab 2: write Scheduler._preempt")

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
