"""Level 2's scheduler, told how many draft tokens a decoding request may bring.

What it is: `SpecScheduler`, which overrides one method, `num_lookahead_tokens`: a
request that is decoding (feeding the one token it sampled last step) gets up to k
speculative tokens, counted in the step's token budget and given KV slots as lookahead
(`allocate_slots(req, 1, num_lookahead_tokens=k)`). Fewer when it is short of budget,
near `max_model_len` or near its `max_tokens` (a step emits at most k + 1 tokens, and
there is no point verifying a draft it could not keep); none while it prefills. When the
KV cache cannot hold the lookahead, the scheduler drops the speculation before it
preempts anyone (level 2's loop). With `disable_by_batch_size`, a step whose running
batch is larger drafts nothing: a busy target gains little from verifying k + 1 tokens
per request, and on a CPU, where a step's cost grows with its tokens, it loses.

What it is not: adaptive. k is fixed (an exercise: choose it from the running acceptance rate).

Reference: vLLM `v1/core/sched/scheduler.py` (`num_lookahead_tokens`, spec tokens in the budget).
"""

from __future__ import annotations

from level2_continuous.request import Request
from level2_continuous.scheduler import Scheduler


class SpecScheduler(Scheduler):
    def __init__(self, *args, num_speculative_tokens: int, disable_by_batch_size: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_speculative_tokens, self.disable_by_batch_size = num_speculative_tokens, disable_by_batch_size

    def num_lookahead_tokens(self, req: Request, n: int, budget_left: int) -> int:
        decoding = n == 1 and bool(req.output_token_ids) and req.num_computed_tokens == req.num_tokens - 1
        if not decoding or (self.disable_by_batch_size is not None and len(self.running) > self.disable_by_batch_size):
            return 0
        remaining = req.max_total_tokens - req.num_tokens  # tokens it may still add (max_tokens, max_model_len)
        return max(0, min(self.num_speculative_tokens, remaining - 1, budget_left))
