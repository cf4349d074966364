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

What it is not: fair beyond FCFS, or able to swap KV to the CPU (preemption is by recompute).
Level 3 shares prefixes through the KV manager's hooks and holds back forked samples in
`admissible`; level 5's pipeline leaves micro-batches in flight out of `schedulable`.

Reference: vLLM V1 `v1/core/sched/scheduler.py`; Yu et al., "Orca" (OSDI 2022);
Agrawal et al., "Sarathi-Serve" (OSDI 2024) for chunked prefill.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager
from .request import FINISH_STATUS, Request, RequestStatus


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
    token_ids: list[list[int]] = field(default_factory=list)  # one token each here (the books take any number)
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
        # a room's rule (request, every running request) -> may it join now? (LoRA: its adapter must
        # fit the slots beside the running ones' adapters); None: any that fits the budget and the pool
        self.admission_rule = None

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step's decision -------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out, budget = SchedulerOutput(), self.max_num_batched_tokens
        running = self.schedulable()  # the running requests this step may schedule or preempt
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(req.num_uncomputed_tokens, budget)
            while not self.kv.allocate_slots(req, n):
                victim = self._pick_victim(running)
                if running.index(victim) < i:  # (priority policy) already scheduled this step:
                    budget += out.remove(victim)  # take its tokens back
                    i -= 1
                running.remove(victim)
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.add(req, n)
                budget -= n
                i += 1
        if not out.preempted:
            self._admit(out, budget, running)
        return out

    def schedulable(self) -> list[Request]:
        """The running requests this step may schedule or preempt, in admission order: all of them here."""
        return list(self.running)

    def admissible(self) -> list[Request]:
        """The waiting requests this step may admit, in queue order: all of them here."""
        return list(self.waiting)

    def _admit(self, out: SchedulerOutput, budget: int, running: list[Request]) -> None:
        """Admit from `admissible()` while budget and seats last; `running` are this step's running requests
        (the seats and the headroom count them), and each admitted request joins them."""
        waiting = self.admissible()
        while waiting and budget > 0 and len(running) < self.max_num_seqs:
            req = self._next_waiting(waiting)
            # (all running requests, a pipeline's in flight included: their adapters hold slots too)
            if self.admission_rule is not None and not self.admission_rule(req, self.running):
                break  # head-of-line, as when the pool is full: it waits until running requests leave
            computed_blocks, num_computed = self.kv.get_computed_blocks(req)
            req.set_computed(num_computed)
            n = min(req.num_uncomputed_tokens, budget)
            keep_free = self.admission_headroom * len(running)  # the running requests' next blocks
            if not self.kv.allocate_slots(req, n, computed_blocks, keep_free):
                req.set_computed(0)
                break  # head-of-line: later requests wait too, so nobody jumps the queue
            waiting.remove(req)
            self.waiting.remove(req)
            req.to(RequestStatus.RUNNING)
            self.running.append(req)
            running.append(req)
            out.add(req, n)
            budget -= n

    # --- after the model ran: the books ------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, output: ModelRunnerOutput) -> list[Request]:
        """The step ran. Its sampled tokens join their requests one by one (a stop rule cuts a run
        of several exactly where it fires); each scheduled request's cache now holds its tokens up
        to, not including, its newest one (fed next step), recorded by the KV manager; whoever
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

    def _next_waiting(self, waiting: list[Request]) -> Request:
        """Whom to admit next of `waiting` (queue order): the head, or under "priority" the most urgent."""
        if self.policy == "priority":
            return min(waiting, key=lambda r: (r.priority, r.metrics.arrival_time))
        return waiting[0]

    def _pick_victim(self, running: list[Request]) -> Request:
        """Whom to preempt of `running` (admission order): the last admitted, or under "priority" the least
        urgent, latest arrival."""
        if self.policy == "priority":
            return max(running, key=lambda r: (r.priority, r.metrics.arrival_time))
        return running[-1]

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
        self.kv.free(req)  # also for a waiting request: its KV manager may hold something for it
