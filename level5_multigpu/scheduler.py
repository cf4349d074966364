"""The scheduler of a pipeline's batch queue: a request whose micro-batch is in flight sits out until it comes back.

What it is: `PipelineScheduler`, level 3's scheduler (level 2's policy, with level 3's forked
samples) for `pipeline_parallel_size` > 1. The engine keeps up to pp micro-batches in flight,
and each must hold *disjoint* requests: a request still on the stages has no logits yet, so it
can neither be scheduled again nor preempted (its blocks are being read). The engine tells the
scheduler which micro-batch it sent off and which came back; `schedulable()`, the level-2
seam every `schedule()` starts from, leaves the requests in flight out, in their places:

    running (admission order)   A  B  C  D  E          in flight: micro-batch 1 = {A, C}
    schedulable()               .  B  .  D  E          what this schedule may run or preempt
    after micro-batch 1 is back A  B  C  D  E          A and C are schedulable again

Admission counts seats and headroom over the schedulable requests, as one micro-batch's.

What it is not: the batch queue itself (engine.py keeps the micro-batches in flight and takes
the oldest back), or a different policy: order, budget and preemption are level 2's.

Reference: vLLM `v1/engine/core.py` (`step_with_batch_queue`) and `v1/core/sched/scheduler.py`.
"""

from __future__ import annotations

from level2_continuous.request import Request
from level2_continuous.scheduler import SchedulerOutput
from level3_prefix.scheduler import ForkingScheduler


class PipelineScheduler(ForkingScheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.in_flight: set[int] = set()  # seq ids of the requests of the micro-batches on the stages

    def send_off(self, sched: SchedulerOutput) -> None:
        """Its micro-batch went to the stages: its requests sit out until it is back."""
        self.in_flight.update(req.seq_id for req, _ in sched.scheduled)

    def take_back(self, sched: SchedulerOutput) -> None:
        """Its micro-batch's logits are back: its requests may be scheduled (or preempted) again."""
        self.in_flight.difference_update(req.seq_id for req, _ in sched.scheduled)

    def schedulable(self) -> list[Request]:
        """Level 2's running requests, less those in flight (they keep their places in `running`)."""
        return [r for r in self.running if r.seq_id not in self.in_flight]


__all__ = ["PipelineScheduler"]
