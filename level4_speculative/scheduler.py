"""Level 2's scheduler, which verifies only the guesses it gave budget to, and says how many a request may make.

What it is: `SpecScheduler`. Level 2's `schedule()` already schedules a request's guesses
(they are part of its `num_uncomputed_tokens`, and their KV slots were reserved when they
were proposed); when the token budget cuts a decoding request short, this drops the
guesses that did not fit, so the model verifies exactly the ones it is given.

`num_drafts(req)`, asked after each step, is how many guesses a request may make for the
next one: k for a request that is decoding (feeding the one token it sampled last),
fewer near `max_model_len` or its `max_tokens` (a step emits at most k + 1 tokens; there
is no point verifying a guess it could not keep), none while it prefills or recomputes.
With `disable_by_batch_size`, while more requests run than that, none: a busy target
gains little from verifying k + 1 tokens per request, and on a CPU, where a step's cost
grows with its tokens, it loses.

What it is not: adaptive. k is fixed (an exercise: choose it from the running acceptance rate).

Reference: vLLM `v1/core/sched/scheduler.py` (spec tokens in the budget, `update_draft_token_ids`).
"""

from __future__ import annotations

from level2_continuous.scheduler import Scheduler, SchedulerOutput

from .request import SpecRequest


class SpecScheduler(Scheduler):
    def __init__(self, *args, num_speculative_tokens: int, disable_by_batch_size: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_speculative_tokens, self.disable_by_batch_size = num_speculative_tokens, disable_by_batch_size

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        for req, n in out.scheduled:
            if req.spec_token_ids:
                req.keep_spec_tokens(max(0, req.num_computed_tokens + n - req.num_tokens))
        return out

    def num_drafts(self, req: SpecRequest) -> int:
        crowded = self.disable_by_batch_size is not None and len(self.running) > self.disable_by_batch_size
        if not req.is_decoding or crowded:
            return 0
        remaining = req.max_total_tokens - req.num_tokens  # tokens it may still add (max_tokens, max_model_len)
        return max(0, min(self.num_speculative_tokens, remaining - 1))
