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
     With `admission_headroom` h > 0, a request is admitted only if h free blocks per
     running request are left after it: room for everyone's next block, so a batch
     admitted at once does not all run out at the same token and preempt (thrash).
     vLLM admits while blocks last (h = 0); docs/level2_continuous.md shows the difference.

    step t:  budget 8 tokens    running: A (decode) B (decode) C (prefill, 9 left)
             scheduled          A:1  B:1  C:6  -> C gets the rest (3) at step t+1

The scheduler decides and keeps the books; it never touches a tensor. One step is

    sched  = scheduler.schedule()                        who runs how many tokens -> SchedulerOutput
    output = (the engine runs the model and samples)     -> ModelRunnerOutput
    moved  = scheduler.update_from_output(sched, output) counters, new tokens, stop rules, finish

so a test, or a simulator, can drive it with a fake model that returns chosen tokens.

What it is not: fair beyond FCFS, aware of prefix sharing (level 3 adds that through
the KV manager's hooks), or able to swap KV to the CPU (preemption is by recompute).

Reference: vLLM V1 `v1/core/sched/scheduler.py`; Yu et al., "Orca" (OSDI 2022);
Agrawal et al., "Sarathi-Serve" (OSDI 2024) for chunked prefill.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager
from .request import FINISH_STATUS, Request, RequestStatus  # noqa: F401 (your code will need it)


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens this step), batch order
    preempted: list[Request] = field(default_factory=list)
    num_prefill_tokens: int = 0  # prompt tokens, or prompt + output again after a preemption

    def add(self, req: Request, n: int) -> None:
        self.scheduled.append((req, n))
        if not req.is_decoding:
            self.num_prefill_tokens += n

    def remove(self, req: Request) -> int:
        """Take a request back out (it was preempted later in the same step); its tokens."""
        k = next(j for j, (r, _) in enumerate(self.scheduled) if r is req)
        n = self.scheduled.pop(k)[1]
        if not req.is_decoding:
            self.num_prefill_tokens -= n
        return n

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass
class ModelRunnerOutput:
    """What the model and the sampler produced, per request whose logits were computed (batch order)."""

    requests: list[Request] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)  # one token each here (a higher level: more)
    logprobs: list[list] = field(default_factory=list)  # entries matching token_ids (None: not asked)


def append_token(req: Request, token: int, logprob=None) -> None:
    req.append_token(token, logprob)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int, policy: str = "fcfs",
                 append_token: Callable[[Request, int, object], None] = append_token, admission_headroom: int = 0):  # fmt: skip
        """`append_token(req, token, logprob)` is how a sampled token joins its request (stop rules
        included); the engine passes its own, which also counts tokens and inter-token latency.
        `admission_headroom`: free blocks per running request an admission must leave (0: none)."""
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"policy={policy!r} is not one of: fcfs, priority")
        self.kv, self.policy, self.append_token = kv, policy, append_token
        self.admission_headroom = admission_headroom
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
        #    Room in the KV cache: self.kv.allocate_slots(req, n), all or nothing.
        #    While it says no, preempt victim = self._pick_victim() with self._preempt(victim, out), and ask
        #    again. If the victim was req itself, it waits for the next step: go on with the next request.
        #    ("priority" can pick a victim you already scheduled this step: out.remove(victim) returns its
        #    tokens, which go back into the budget; mind your position in self.running.)
        #    With room: out.add(req, n); the budget loses n.
        # 2. Then the waiting requests: self._admit(out, budget), but not in a step that preempted anyone.
        # Return out.
        raise NotImplementedError("lab 2: write Scheduler.schedule")

    def schedule_except(self, in_flight: Collection[Request]) -> SchedulerOutput:
        """`schedule()` with some running requests out of sight: those whose last step has not
        come back (level 5's pipeline) are neither scheduled nor preempted now, and keep their places."""
        busy = {id(r) for r in in_flight}
        everyone, self.running = self.running, [r for r in self.running if id(r) not in busy]
        try:
            return self.schedule()
        finally:
            still = {id(r) for r in self.running}  # the others that are left (some preempted, some admitted)
            kept = [r for r in everyone if id(r) in busy or id(r) in still]
            was = {id(r) for r in everyone}
            self.running = kept + [r for r in self.running if id(r) not in was]

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        # TODO (lab 2): Scheduler._admit
        # Admit waiting requests while budget is left and fewer than self.max_num_seqs requests run:
        #   req = self._next_waiting()  (FCFS: the head of the queue; "priority": the most urgent)
        #   computed_blocks, num_computed = self.kv.get_computed_blocks(req); req.set_computed(num_computed)
        #       (level 3's prefix-cache hit; nothing at level 2, but keep the call: level 3 runs your code too)
        #   n = its uncomputed tokens, cut to the budget left
        #   keep_free = self.admission_headroom blocks for each running request (their next blocks: 0 by default,
        #       vLLM's rule; docs/level2_continuous.md, "Thrash, and its cure")
        #   self.kv.allocate_slots(req, n, computed_blocks, keep_free) says no: undo with req.set_computed(0) and
        #       stop admitting; nobody behind it may jump the queue.
        #   Otherwise it leaves self.waiting, req.to(RequestStatus.RUNNING), joins the end of self.running,
        #   out.add(req, n), and the budget loses n.
        raise NotImplementedError("lab 2: write Scheduler._admit")

    # --- after the model ran: the books ------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, output: ModelRunnerOutput) -> list[Request]:
        """The step ran. Its sampled tokens join their requests one by one (a stop rule cuts a run
        of several exactly where it fires); each scheduled request's cache now holds its tokens up
        to, not including, its newest one (fed next step); full blocks are named (level 3); whoever
        stopped leaves, its blocks free when this returns. Returns the requests that got tokens."""
        for req, tokens, logprobs in zip(output.requests, output.token_ids, output.logprobs):
            for tok, lp in zip(tokens, logprobs):
                self.append_token(req, tok, lp)
                if req.is_finished:
                    break  # nothing after a stop is kept
        for req, n in sched.scheduled:
            # Only positions up to the newest known token count: K/V computed past it (for
            # tokens a stop cut off, say) is overwritten later.
            req.num_computed_tokens = min(req.num_computed_tokens + n, req.num_tokens - 1)
            self.kv.cache_blocks(req)
            if req.is_finished:
                self.finish(req)
        return output.requests

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
