"""Logits processors: what changes a row of logits before sampling, given the request's history.

What it is: `SamplingState`, what the sampler knows of one row (its params, its prompt and
output so far, its generator, its EOS ids, its constraint); the `LogitsProcessor` protocol
(vLLM's idea); and level 0's two processors, which every engine's sampler runs first:

    MinTokens   EOS (unless `ignore_eos`) and `stop_token_ids` cannot be drawn before `min_tokens`
    Penalties   repetition (HF's, over prompt + output), presence and frequency (OpenAI's, over
                the output): `apply_penalties` for one row, `Penalties.batch` for the batch

Each says from the params alone whether it can touch a row (`applies`), so a greedy batch none
applies to takes the sampler's fast path, one `argmax`. A room adds its own processor to the
chain through `ladder/rooms.py` (structured outputs mask what a request's constraint forbids).

What it is not: the sampler (`sampler.py`: temperature, top-k, top-p, min-p, the draw).

Reference: vLLM `v1/sample/logits_processor/`; Hugging Face's `RepetitionPenaltyLogitsProcessor`
and `MinNewTokensLengthLogitsProcessor`; the OpenAI API for presence/frequency penalties.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from .sampling_params import SamplingParams


@dataclass
class SamplingState:
    """What the sampler needs to know about one row: its params and its history."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None  # None only for greedy rows
    eos_token_ids: list[int] = field(default_factory=list)
    constraint: object | None = None  # the request's constraint (outputs.Constraint), after its accepted tokens


class LogitsProcessor(Protocol):
    def applies(self, params: SamplingParams) -> bool:
        """Can it change a row with these params at all? (False for every row: the fast path.)"""
        ...

    def __call__(self, row: torch.Tensor, st: SamplingState) -> torch.Tensor:
        """row [V] -> row [V]."""
        ...

    # Optional: `batch(logits [B, V], states) -> logits [B, V]`, the same for every row at once (rows
    # it does not apply to unchanged). Without it, `Sampler.probabilities` calls it row by row.


def apply_penalties(logits: torch.Tensor, st: SamplingState) -> torch.Tensor:
    """logits [V] -> penalised logits [V], as OpenAI (presence/frequency) and HF (repetition) define them."""
    p, V = st.params, logits.shape[-1]
    if p.repetition_penalty != 1:
        seen = torch.zeros(V, dtype=torch.bool, device=logits.device)
        seen[torch.tensor(st.prompt_token_ids + st.output_token_ids, dtype=torch.long, device=logits.device)] = True
        penalised = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    if st.output_token_ids and (p.presence_penalty or p.frequency_penalty):
        ids = torch.tensor(st.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(ids, minlength=V).to(logits.dtype)  # [V]
        logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


class MinTokens:
    """Before `min_tokens` are out, EOS (unless `ignore_eos`) and `stop_token_ids` cannot be drawn."""

    def applies(self, params: SamplingParams) -> bool:
        # With ignore_eos and no stop ids there is nothing to ban: the row stays plain.
        return params.min_tokens > 0 and bool(params.stop_token_ids or not params.ignore_eos)

    @staticmethod
    def banned(st: SamplingState) -> list[int]:
        """The ids this row may not draw now (none once min_tokens are out)."""
        p = st.params
        if len(st.output_token_ids) >= p.min_tokens:
            return []
        # every id is < V: InputProcessor refuses a request whose stop_token_ids are not
        return p.stop_token_ids + ([] if p.ignore_eos else st.eos_token_ids)

    def __call__(self, row: torch.Tensor, st: SamplingState) -> torch.Tensor:
        banned = self.banned(st)
        return row.index_fill(0, torch.tensor(banned, device=row.device), float("-inf")) if banned else row

    def batch(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """logits [B, V] -> logits [B, V] with every row's banned ids at -inf (one index_put)."""
        rows, cols = [], []
        for i, st in enumerate(states):
            if self.applies(st.params):
                banned = self.banned(st)
                rows += [i] * len(banned)
                cols += banned
        if not rows:
            return logits
        where = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
        return logits.index_put(where, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))


class Penalties:
    """Repetition (over prompt + output), presence and frequency (over the output) penalties."""

    def applies(self, params: SamplingParams) -> bool:
        return params.needs_penalties

    def __call__(self, row: torch.Tensor, st: SamplingState) -> torch.Tensor:
        return apply_penalties(row, st)

    def batch(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """logits [B, V] -> penalised logits [B, V]: `apply_penalties` for every row at once. Rows
        the penalties do not apply to get factor 1 and weights 0: bit for bit as they were (x * 1, x - 0)."""
        B, V = logits.shape
        dev, dt = logits.device, logits.dtype
        rows = [i for i, st in enumerate(states) if self.applies(st.params)]
        if not rows:
            return logits
        params = [st.params for st in states]
        column = lambda values: torch.tensor(values, dtype=dt, device=dev)[:, None]  # [B, 1]
        rep = [p.repetition_penalty for p in params]
        if any(r != 1 for r in rep):
            seen_r = [i for i in rows for _ in states[i].prompt_token_ids + states[i].output_token_ids]
            seen_c = [t for i in rows for t in states[i].prompt_token_ids + states[i].output_token_ids]
            seen = torch.zeros(B, V, dtype=torch.bool, device=dev)
            seen[
                torch.tensor(seen_r, dtype=torch.long, device=dev), torch.tensor(seen_c, dtype=torch.long, device=dev)
            ] = True
            seen &= column([r != 1 for r in rep]).bool()
            r = column(rep)
            logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            out_r = [i for i in rows for _ in states[i].output_token_ids]
            out_c = [t for i in rows for t in states[i].output_token_ids]
            counts = torch.zeros(B, V, dtype=dt, device=dev)
            if out_r:
                idx = (torch.tensor(out_r, device=dev), torch.tensor(out_c, device=dev))
                counts.index_put_(idx, torch.ones(len(out_r), dtype=dt, device=dev), accumulate=True)  # [B, V]
            logits = logits - column([p.frequency_penalty for p in params]) * counts
            logits = logits - column([p.presence_penalty for p in params]) * (counts > 0).to(dt)
        return logits


DEFAULT_PROCESSORS: tuple[LogitsProcessor, ...] = (MinTokens(), Penalties())

__all__ = ["SamplingState", "LogitsProcessor", "MinTokens", "Penalties", "apply_penalties", "DEFAULT_PROCESSORS"]
