"""The sampler's side of structured outputs: a logits processor that masks what the grammar forbids.

What it is: `GrammarMask`, a processor in the chain of level 0's sampler
(level0_naive/logits_processors.py's `LogitsProcessor`), added to every engine's chain by
`ladder/rooms.py`. It applies only to rows whose request set `structured_outputs`; their state
(`SamplingState.constraint`) is the sample's `Grammar` (grammar.py). Row by row (`__call__`,
the reference) or the whole batch at once (`batch`: xgrammar's and llguidance's states write
one shared bitmask, unpacked in one go), tested equal (tests/test_structured_outputs.py).

What it is not: a sampler (level 0's draws from what is left) or the grammar's state.

Reference: vLLM `v1/structured_output/` (the bitmask applied in the model runner) and
`v1/sample/logits_processor/`.
"""

from __future__ import annotations

import torch

from level0_naive.logits_processors import SamplingState
from level0_naive.sampling_params import SamplingParams

from .grammar import BitmaskGrammar, unpack


class GrammarMask:
    """Structured outputs: tokens the request's grammar forbids next go to -inf (grammar.py).

    The row's state is the grammar after the output tokens it has accepted and then any the
    row's history has beyond them (a speculative draft's guesses: consumed for the question,
    then rolled back). Applied last, after the other processors: if they left no allowed token
    (min_tokens banning the stop token a finished grammar insists on), the grammar wins."""

    def applies(self, params: SamplingParams) -> bool:
        return params.structured_outputs is not None

    @staticmethod
    def mask(st: SamplingState, vocab_size: int) -> torch.Tensor:
        """bool [V]: what may come next in this row."""
        g = st.constraint
        return g.mask_after(st.output_token_ids[g.num_accepted :], vocab_size)

    def __call__(self, row: torch.Tensor, st: SamplingState) -> torch.Tensor:
        allowed = self.mask(st, row.shape[-1]).to(row.device)  # [V]
        return self._apply(row[None], allowed[None])[0]

    @staticmethod
    def _apply(rows: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """rows [R, V], allowed bool [R, V] -> rows with the rest at -inf; a row another processor left
        nothing of (min_tokens banning the stop token a finished grammar insists on) keeps the grammar's."""
        masked = rows.masked_fill(~allowed, float("-inf"))  # [R, V]
        empty = torch.isinf(masked).all(-1, keepdim=True)  # [R, 1]; torch.where, not `if empty.any()`: no host sync
        return torch.where(empty, torch.zeros_like(rows).masked_fill(~allowed, float("-inf")), masked)

    def batch(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Every row at once: xgrammar's states write one shared bitmask, unpacked in one go; a row
        with guesses past its accepted tokens, or a reference grammar, asks for its own mask."""
        rows = [i for i, st in enumerate(states) if self.applies(st.params)]
        if not rows:
            return logits
        V = logits.shape[-1]
        allowed = torch.empty(len(rows), V, dtype=torch.bool)  # [R, V]
        fast = [j for j, i in enumerate(rows) if isinstance(states[i].constraint, BitmaskGrammar)
                and states[i].constraint.num_accepted == len(states[i].output_token_ids)]  # fmt: skip
        if fast:
            bitmask = torch.empty(len(fast), states[rows[fast[0]]].constraint.bitmask.shape[1], dtype=torch.int32)
            for k, j in enumerate(fast):
                states[rows[j]].constraint.fill(bitmask, k)
            banned = torch.stack([states[rows[j]].constraint.banned_or_none() for j in fast])  # [F, V]
            allowed[fast] = unpack(bitmask, V) & ~banned
        for j in sorted(set(range(len(rows))) - set(fast)):
            allowed[j] = self.mask(states[rows[j]], V)
        logits = logits.clone()
        logits[rows] = self._apply(logits[rows], allowed.to(logits.device, non_blocking=True))  # no wait for the GPU
        return logits


__all__ = ["GrammarMask"]
