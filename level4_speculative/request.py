"""A request under speculative decoding: level 2's `Request` plus its draft model's progress.

What it is: `SpecRequest`, with `draft_num_computed`, how many of its tokens have K/V in
the *draft's* cache (the target's count is `num_computed_tokens`). The draft writes ahead
of the target while it proposes and falls behind when its guesses are rejected, so after
each step the engine sets it to min(draft's, target's); both go back to the same value
when the request is admitted on a prefix hit or preempted (`set_computed`).

What it is not: a place for the draft tokens of a step; they live in the step's
proposals and are never part of the request until accepted.

Reference: vLLM `v1/request.py` (`spec_token_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass

from level2_continuous.request import Request


@dataclass
class SpecRequest(Request):
    draft_num_computed: int = 0

    def set_computed(self, n: int) -> None:
        super().set_computed(n)
        self.draft_num_computed = n  # a shared block holds both models' K/V; after a preemption, neither
