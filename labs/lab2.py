"""Lab 2: the scheduler's `schedule()`: token budget, chunked prefill, preemption by recompute.

What it is: the lab's definition (see `labs/spec.py`): the four methods of
`level2_continuous/scheduler.py` the starter empties, the checks (level 2's own tests,
including the ones that pin the documented policies, and `labs/lab2_checks.py`), the
planted bugs the checks must catch, and the experiment (thrashing under a tight KV
budget, and an admission watermark: `labs/lab2_experiment.py`).

What it is not: the handout (docs/labs/lab2_scheduler.md).
"""

from __future__ import annotations

from .spec import Bug, Check, Experiment, Lab, Module, Part

L2 = "tests/test_level2.py::"
OWN = "labs/lab2_checks.py::"

PARTS = (
    Part(
        "Scheduler.schedule",
        """\
One step's decision (docs/level2_continuous.md, "The schedule loop"). Start with
out, budget = SchedulerOutput(), self.max_num_batched_tokens, and running = self.schedulable(): the running
requests this step may schedule or preempt, in admission order (all of them here; level 5 leaves some out).
1. Running requests first, in that order, while budget is left:
   n = the request's uncomputed tokens (req.num_uncomputed_tokens), cut to the budget left: a prompt
       longer than that is cut here, and the rest comes next step (chunked prefill).
   Room in the KV cache: self.kv.allocate_slots(req, n), all or nothing.
   While it says no, preempt victim = self._pick_victim(running): take it out of `running` and
   self._preempt(victim, out), and ask again. If the victim was req itself, it waits for the next step: go
   on with the next request. ("priority" can pick a victim you already scheduled this step: out.remove(victim)
   returns its tokens, which go back into the budget; mind your position in `running`.)
   With room: out.add(req, n); the budget loses n.
2. Then the waiting requests: self._admit(out, budget, running), but not in a step that preempted anyone.
Return out.""",
    ),
    Part(
        "Scheduler._admit",
        """\
Admit from waiting = self.admissible() (the waiting queue, in order; level 3 leaves out some) while budget is
left and fewer than self.max_num_seqs requests are in `running` (this step's running requests):
  req = self._next_waiting(waiting)  (FCFS: the head of the queue; "priority": the most urgent)
  computed_blocks, num_computed = self.kv.get_computed_blocks(req); req.set_computed(num_computed)
      (level 3's prefix-cache hit; nothing at level 2, but keep the call: level 3 runs your code too)
  n = its uncomputed tokens, cut to the budget left
  keep_free = self.admission_headroom blocks for each request in `running` (their next blocks: 0 by default,
      vLLM's rule; docs/level2_continuous.md, "Thrash, and its cure")
  self.kv.allocate_slots(req, n, computed_blocks, keep_free) says no: undo with req.set_computed(0) and
      stop admitting; nobody behind it may jump the queue.
  Otherwise it leaves `waiting` and self.waiting, req.to(RequestStatus.RUNNING), joins the end of
  self.running and of `running`, out.add(req, n), and the budget loses n.""",
    ),
    Part(
        "Scheduler._pick_victim",
        """\
Whom of `running` (admission order) to preempt when the KV cache is full (docs/level2_continuous.md, "Preemption"):
  "fcfs":     the most recently admitted
  "priority": the lowest priority, then the latest arrival: the one with the largest
              (req.priority, req.metrics.arrival_time)""",
    ),
    Part(
        "Scheduler._preempt",
        """\
Preemption by recompute: the request gives back every block and will start over.
  It leaves self.running; self.kv.free(req); req.set_computed(0) (prompt + output are prefilled
  again when it returns); req.num_preemptions += 1; its status goes RUNNING -> PREEMPTED -> WAITING
  (req.to(...)); it goes to the head of self.waiting (it came before everyone still waiting);
  out.preempted.append(req). It keeps the tokens it generated.""",
    ),
)

CHECKS = (
    Check("budget", "the token budget: running requests first, a long prompt cut into chunks",
          (L2 + "test_chunked_prefill_mixes_prefill_and_decode", OWN + "test_budget_goes_to_running_requests_first"),
          "Each running request, in order, gets min(its uncomputed tokens, budget left); a prompt longer than what "
          "is left is cut and the rest comes next step. Every scheduled token counts against "
          "max_num_batched_tokens, and waiting requests only get what the running ones left.",
          rule="A step never schedules more tokens than its budget; running requests are served before waiting ones, "
               "and a prompt larger than what is left is split across steps rather than held back."),
    Check("seats", "never more than max_num_seqs requests running", (OWN + "test_seats_are_limited",),
          "_admit stops when len(self.running) reaches self.max_num_seqs.",
          rule="At most max_num_seqs requests run at once, however much token budget is left."),
    Check("recompute", "a preempted request frees its blocks, restarts from token 0, waits at the head",
          (OWN + "test_a_preempted_request_starts_over",),
          "_preempt: remove it from self.running, self.kv.free(req), req.set_computed(0), num_preemptions += 1, "
          "RUNNING -> PREEMPTED -> WAITING, self.waiting.appendleft(req), out.preempted.append(req). It keeps "
          "its output tokens, and it is not in out.scheduled.",
          rule="A preempted request gives back all its memory, will compute everything again from the start, keeps "
               "the tokens it generated, runs nothing this step, and is the first to come back (it arrived before "
               "everyone still waiting)."),
    Check("self-preempt", "a request that must preempt itself waits for the next step",
          (OWN + "test_a_request_that_preempts_itself_waits",),
          "When the victim is the request asking for room, it was just preempted: leave the allocation loop "
          "(break), do not schedule it, and carry on with the requests after it.",
          rule="A request that had to preempt itself to make room gets nothing this step, and the step goes on with "
               "the requests after it."),
    Check("fcfs-victim", "FCFS preempts the most recently admitted request",
          (L2 + "test_fcfs_preempts_the_most_recently_admitted_request",),
          "Under FCFS the victim is the last admitted running request, self.running[-1]. Preempting the oldest "
          "throws away the most work, and the output tokens stay right, so only this check notices.",
          rule="Under FCFS, preemption undoes the newest admission, which has the least work to lose. The tokens "
               "come out right either way: only this check notices."),
    Check("no-admit-after-preempt", "a step that preempted admits nobody",
          (L2 + "test_a_step_that_preempts_admits_nobody",),
          "Call _admit only if out.preempted is empty: a step that had to preempt is short of memory, and "
          "admitting anyone (even the victim's first chunk) makes the next step preempt again: thrashing.",
          rule="A step that had to preempt is short of memory: it admits no one, or the next step preempts again "
               "(thrashing)."),
    Check("head-of-line", "admission is head-of-line: nobody jumps the queue", (L2 + "test_admission_is_head_of_line",),
          "When the request at the head of the queue does not fit, stop admitting (undo its set_computed); do "
          "not skip to a smaller one behind it, or big requests starve.",
          rule="Admission is strictly in queue order: when the request at the head does not fit, nobody behind it is "
               "admitted, or big requests starve."),
    Check("priority", "policy='priority' preempts the lowest priority, latest arrival",
          (L2 + "test_priority_policy_preempts_the_lowest_priority",),
          "_pick_victim under 'priority': max over self.running of (priority, arrival_time). If that victim was "
          "already scheduled this step, out.remove(victim) gives its tokens back to the budget, and your index "
          "into self.running moves back by one.",
          rule="Under 'priority', the victim is the least urgent, latest-arriving running request, even one already "
               "scheduled this step, whose tokens then go back to the budget."),
    Check("headroom", "admission headroom: an admission leaves the running requests their next blocks",
          (L2 + "test_admission_headroom_cures_the_thrash",),
          "In _admit, pass keep_free = self.admission_headroom * len(self.running) to self.kv.allocate_slots: with "
          "headroom 1 a request is admitted only if every running request's next block stays free after it. "
          "Ignore it and a crowd of same-shaped requests is admitted together, then preempted together.",
          rule="With admission headroom h, a request is admitted only if h free blocks per running request remain "
               "after it, so the running ones can grow without preempting each other."),
    Check("continuous", "a freed seat is refilled at the next step", (L2 + "test_continuous_batching_admits_into_freed_seats",),
          "schedule() admits waiting requests every step (unless it preempted): a request that finished leaves "
          "a seat, and the next schedule() fills it.",
          rule="Batching is continuous: a finished request's seat goes to the waiting queue at the very next step, "
               "not when the whole batch is done."),
    Check("exact-outputs", "with preemption by recompute, every answer is the naive engine's",
          (L2 + "test_preemption_by_recompute_keeps_answers",),
          "Greedy outputs changed or the engine stopped: a preempted request must restart from 0 with its output "
          "tokens kept, and every scheduled chunk must start at num_computed_tokens. Read the test's message.",
          rule="Preemption by recompute may cost time, never an answer: a request that starts over reproduces "
               "exactly the state it lost, and every chunk continues where the request's computation stands."),
    Check("invariants", "random workloads: budgets hold, no block leaks, everyone finishes",
          (OWN + "test_random_workloads_keep_every_invariant",),
          "On random workloads a step must never exceed the token budget or the seats, a waiting request must "
          "hold no block, blocks must never leak, and every request must finish (no endless loop, no "
          "starvation). The failing example is in the details.",
          rule="On any workload, at every step: the budget and the seats hold, a waiting request holds no memory, no "
               "block leaks, and in the end every request finishes."),
)  # fmt: skip

BUGS = (
    Bug("oldest-victim", "level2_continuous.scheduler", "        return running[-1]\n",
        "        return running[0]\n", ("fcfs-victim",)),
    Bug("admit-after-preempt", "level2_continuous.scheduler",
        "        if not out.preempted:\n            self._admit(out, budget, running)\n",
        "        self._admit(out, budget, running)\n",
        ("no-admit-after-preempt",)),
    Bug("no-chunking", "level2_continuous.scheduler",
        "            n = min(req.num_uncomputed_tokens, budget)\n            while not self.kv.allocate_slots(req, n):",
        "            n = req.num_uncomputed_tokens\n            while not self.kv.allocate_slots(req, n):", ("budget",)),
    Bug("no-headroom", "level2_continuous.scheduler",
        "            keep_free = self.admission_headroom * len(running)",
        "            keep_free = 0", ("headroom",)),
    Bug("smallest-first", "level2_continuous.scheduler",
        "        while waiting and budget > 0 and len(running) < self.max_num_seqs:\n"
        "            req = self._next_waiting(waiting)\n",
        "        for req in sorted(waiting, key=lambda r: r.num_tokens):\n"
        "            if budget <= 0 or len(running) >= self.max_num_seqs:\n"
        "                break\n", ("head-of-line",)),
)  # fmt: skip

LAB = Lab(
    id="2",
    topic="the scheduler: token budget, chunked prefill, preemption by recompute",
    handout="lab2_scheduler.md",
    modules=(Module("level2_continuous.scheduler", PARTS),),
    checks=CHECKS,
    bugs=BUGS,
    experiment=Experiment(
        "labs.lab2_experiment", (), ("--quick", "--requests", "8", "--kv-requests", "2", "--watermarks", "0", "0.2")
    ),
    minutes=120,
)
