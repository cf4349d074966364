"""A request under speculative decoding: level 3's request plus its guesses and its draft's progress.

What it is: `SpecRequest`, vLLM V1's idea: the proposer runs after a step's sampling and
leaves its guesses on the request (`spec_token_ids`, and `spec_probs`, the distributions q
they were drawn from, which the rejection sampler needs). To the scheduler they are just
more tokens to compute: `num_uncomputed_tokens` counts them and `token_slice` returns them
after the request's own tokens, so a decoding request asks for 1 + k tokens and level 2's
`prepare_input` feeds [last token, d_1 .. d_k] with k + 1 logits rows (`num_logits`).

    tokens t0 .. t9 (num_tokens 10), computed 9, spec_token_ids [d1 d2 d3]
    scheduled 4:  positions 9 .. 12 get [t9 d1 d2 d3]; logits rows for all four

`draft_num_computed` counts the tokens with K/V in the *draft's* cache (the target's
count is `num_computed_tokens`): it runs ahead while the draft proposes and is cut back
to the target's after a verification; both go back to the same value, and the guesses are
dropped, when the request is admitted on a prefix hit or preempted (`set_computed`).

What it is not: a request whose guesses are ever its tokens. Only accepted ones are
appended, by level 2's `update_from_output`, one by one.

Reference: vLLM `v1/request.py` (`spec_token_ids`, `num_tokens_with_spec`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from level3_prefix.block_hash import PrefixRequest


@dataclass
class SpecRequest(PrefixRequest):
    draft_num_computed: int = 0
    spec_token_ids: list[int] = field(default_factory=list)  # d_1 .. d_k, verified next step
    spec_probs: torch.Tensor | None = None  # q [k, V] they were drawn from; None: greedy, or a point mass
    # EAGLE's: the target's features its head has not read yet, [first position, rows [n, H]] (eagle.py files
    # them), dropped with the request's blocks (kv_cache_manager.py)
    eagle_features: list | None = None

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens + len(self.spec_token_ids) - self.num_computed_tokens

    def token_slice(self, start: int, n: int) -> list[int]:
        """Tokens start .. start+n-1 of prompt + output + guesses."""
        tokens = super().token_slice(start, n)
        past = start + n - self.num_tokens  # how many come from the guesses
        if past > 0:
            tokens = tokens + self.spec_token_ids[max(0, start - self.num_tokens) : past]
        return tokens

    def drop_spec_tokens(self) -> None:
        self.spec_token_ids, self.spec_probs = [], None

    def set_computed(self, n: int) -> None:
        super().set_computed(n)
        self.draft_num_computed = n  # a shared block holds both models' K/V; after a preemption, neither
        self.drop_spec_tokens()
