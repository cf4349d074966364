"""The sampler: logits in, tokens out, through a chain of logits processors.

What it is: `Sampler`, the one component every level samples with, in two stages so that
speculative decoding (level 4) can reuse the first for its draft's q and its target's p:

    logits [B, V] --probabilities()--> probs [B, V] --draw()--> tokens [B]
                   each processor that applies,     one multinomial draw per row from
                   then temperature, top-k, top-p,  the request's own generator; a
                   min-p (a greedy row: one-hot     greedy row takes its argmax
                   at the argmax)

A `LogitsProcessor` (vLLM's idea) changes one row of logits given the row's history:
`MinTokens` bans EOS and the stop tokens before `min_tokens`, `Penalties` applies
repetition, presence and frequency penalties. Each says from the params alone whether
it can touch a row (`applies`), so a batch where none applies to any greedy row takes
the fast path, one `argmax`. A later mode adds a processor (a grammar's mask, a fixed
draw order) without touching the engine: `Sampler([*DEFAULT_PROCESSORS, MyMask()])`.
Each request draws from its own `torch.Generator`, so a seeded request gives the same
tokens whatever batch it lands in.

What it is not: fast. Processed rows go one by one through small per-row loops; a real
engine fuses this into one kernel (vLLM's `v1/sample/sampler.py`). Greedy rows, the case
the equivalence tests and most benchmarks use, take one `argmax`.

Reference: vLLM `v1/sample/sampler.py`, `v1/sample/logits_processor/`; Hugging Face's
`LogitsProcessor`s (`RepetitionPenaltyLogitsProcessor`, `MinNewTokensLengthLogitsProcessor`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from .sampling import SamplingParams, SamplingState, apply_penalties, filter_logits


class LogitsProcessor(Protocol):
    def applies(self, params: SamplingParams) -> bool:
        """Can it change a row with these params at all? (False for every row: the fast path.)"""
        ...

    def __call__(self, row: torch.Tensor, st: SamplingState) -> torch.Tensor:
        """row [V] -> row [V]."""
        ...


class MinTokens:
    """Before `min_tokens` are out, EOS (unless `ignore_eos`) and `stop_token_ids` cannot be drawn."""

    def applies(self, params: SamplingParams) -> bool:
        return params.min_tokens > 0

    def __call__(self, row: torch.Tensor, st: SamplingState) -> torch.Tensor:
        p = st.params
        if len(st.output_token_ids) >= p.min_tokens:
            return row
        # every id is < V: InputProcessor refuses a request whose stop_token_ids are not
        banned = p.stop_token_ids + ([] if p.ignore_eos else st.eos_token_ids)
        return row.index_fill(0, torch.tensor(banned, device=row.device), float("-inf")) if banned else row


class Penalties:
    """Repetition (over prompt + output), presence and frequency (over the output) penalties."""

    def applies(self, params: SamplingParams) -> bool:
        return params.needs_penalties

    def __call__(self, row: torch.Tensor, st: SamplingState) -> torch.Tensor:
        return apply_penalties(row, st)


DEFAULT_PROCESSORS: tuple[LogitsProcessor, ...] = (MinTokens(), Penalties())


class Sampler:
    def __init__(self, processors: Sequence[LogitsProcessor] = DEFAULT_PROCESSORS):
        self.processors = tuple(processors)

    def is_plain_greedy(self, params: SamplingParams) -> bool:
        """Greedy with nothing that reshapes the logits: the row's token is its raw argmax."""
        return params.greedy and not any(p.applies(params) for p in self.processors)

    def process_row(self, row: torch.Tensor, st: SamplingState) -> torch.Tensor:
        """One row of raw logits [V] -> the logits the request really samples from [V].
        Greedy rows get the processors but no temperature (there is nothing to divide by);
        sampled rows are divided by the temperature and filtered."""
        for proc in self.processors:
            if proc.applies(st.params):
                row = proc(row, st)
        p = st.params
        if p.greedy:
            return row
        return filter_logits(row / p.temperature, p.top_k, p.top_p, p.min_p)

    def probabilities(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Stage 1. logits [B, V] -> the distribution each row is sampled from, probs [B, V].
        A greedy row is one-hot at the argmax of its processed logits: sampling from it is
        the argmax, and level 4's rejection sampler needs no special case to be exact for it."""
        probs = torch.empty_like(logits)  # [B, V]
        for i, st in enumerate(states):
            row = self.process_row(logits[i], st)  # [V]
            if st.params.greedy:
                probs[i] = torch.nn.functional.one_hot(row.argmax(), row.shape[-1]).to(probs.dtype)
            else:
                probs[i] = torch.softmax(row, dim=-1)
        return probs

    @staticmethod
    def draw(probs: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Stage 2. probs [B, V] -> one token per row [B] (long), each from its own generator."""
        out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
        for i, st in enumerate(states):
            if st.params.greedy:
                out[i] = probs[i].argmax()
            else:
                out[i] = torch.multinomial(probs[i], 1, generator=st.generator)[0]
        return out

    def sample(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """logits [B, V] (float32+) -> next tokens [B] (long). One row per state."""
        if all(self.is_plain_greedy(st.params) for st in states):
            return logits.argmax(dim=-1)  # the fast path: plain greedy
        return self.draw(self.probabilities(logits, states), states)
