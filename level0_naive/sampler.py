"""The sampler: logits in, tokens out, through a chain of logits processors.

What it is: `Sampler`, the one component every level samples with, in two stages so that
speculative decoding (level 4) can reuse the first for its draft's q and its target's p:

    logits [B, V] --probabilities()--> probs [B, V] --draw()--> tokens [B]
                   each processor that applies,     one multinomial draw per row from
                   then temperature, top-k, top-p,  the request's own generator; a
                   min-p (a greedy row: one-hot     greedy row takes its argmax
                   at the argmax)

A `LogitsProcessor` (vLLM's idea) changes logits given each row's history:
`MinTokens` bans EOS and the stop tokens before `min_tokens`, `Penalties` applies
repetition, presence and frequency penalties, `GrammarMask` keeps a structured output
inside its grammar (structured.py). Each says from the params alone whether
it can touch a row (`applies`: `min_tokens` with `ignore_eos` and no stop ids bans
nothing, so it does not apply), so a batch where none applies to any greedy row takes
the fast path, one `argmax`.

Two ways through stage 1, kept side by side and tested equal (tests/test_sampling.py):
`probabilities_loop`, one row at a time through each processor's `__call__` and
`sampling.filter_logits` (the reference, the one to read first), and `probabilities`,
the whole batch at once: each processor's `batch` (a processor without one is run row by
row), per-row temperatures as a column, `sampling.filter_logits_batch`.

A later mode adds a processor (a grammar's mask, a fixed draw order) without touching
the engine: `Sampler([*DEFAULT_PROCESSORS, MyMask()])`.
Each request draws from its own `torch.Generator`, so a seeded request gives the same
tokens whatever batch it lands in. With `keyed_draws` (`batch_invariant=True`) a sampled
row's token is argmax(log p + Gumbel noise keyed by the request's seed and the token's
position), an exact sample that does not depend on how many draws came before it.

What it is not: fused. `probabilities` is a dozen tensor ops over the batch, and the draw
is one `multinomial` per sampled row (each request has its own generator); vLLM's
`v1/sample/sampler.py` draws the whole batch with one exponential race on the GPU.

Reference: vLLM `v1/sample/sampler.py`, `v1/sample/logits_processor/`; Hugging Face's
`LogitsProcessor`s (`RepetitionPenaltyLogitsProcessor`, `MinNewTokensLengthLogitsProcessor`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from .sampling import (
    SamplingParams,
    SamplingState,
    apply_penalties,
    filter_logits,
    filter_logits_batch,
    keyed_gumbel,
)
from .structured import BitmaskGrammar, unpack


class LogitsProcessor(Protocol):
    def applies(self, params: SamplingParams) -> bool:
        """Can it change a row with these params at all? (False for every row: the fast path.)"""
        ...

    def __call__(self, row: torch.Tensor, st: SamplingState) -> torch.Tensor:
        """row [V] -> row [V]."""
        ...

    # Optional: `batch(logits [B, V], states) -> logits [B, V]`, the same for every row at once
    # (rows it does not apply to unchanged). Without it, `Sampler.probabilities` calls the
    # processor row by row.


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
        """logits [B, V] -> penalised logits [B, V]: `apply_penalties` for every row at once.

        Rows the penalties do not apply to get factor 1 and weights 0, which leave them
        bit for bit as they were (x * 1, x - 0)."""
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


class GrammarMask:
    """Structured outputs: tokens the request's grammar forbids next go to -inf (structured.py).

    The row's state is the grammar after the output tokens it has accepted and then any the
    row's history has beyond them (a speculative draft's guesses: consumed for the question,
    then rolled back). Applied last, after the other processors: if they left no allowed token
    (min_tokens banning the stop token a finished grammar insists on), the grammar wins."""

    def applies(self, params: SamplingParams) -> bool:
        return params.structured_outputs is not None

    @staticmethod
    def mask(st: SamplingState, vocab_size: int) -> torch.Tensor:
        """bool [V]: what may come next in this row."""
        g = st.grammar
        return g.mask_after(st.output_token_ids[g.num_accepted :], vocab_size)

    def __call__(self, row: torch.Tensor, st: SamplingState) -> torch.Tensor:
        allowed = self.mask(st, row.shape[-1]).to(row.device)  # [V]
        return self._apply(row[None], allowed[None])[0]

    @staticmethod
    def _apply(rows: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """rows [R, V], allowed bool [R, V] -> rows with the rest at -inf; a row another processor left
        nothing of (min_tokens banning the stop token a finished grammar insists on) keeps the grammar's."""
        masked = rows.masked_fill(~allowed, float("-inf"))
        empty = torch.isinf(masked).all(-1)  # [R]
        if empty.any():
            masked[empty] = torch.zeros_like(masked[empty]).masked_fill(~allowed[empty], float("-inf"))
        return masked

    def batch(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Every row at once: xgrammar's states write one shared bitmask, unpacked in one go; a row
        with guesses past its accepted tokens, or a reference grammar, asks for its own mask."""
        rows = [i for i, st in enumerate(states) if self.applies(st.params)]
        if not rows:
            return logits
        V = logits.shape[-1]
        allowed = torch.empty(len(rows), V, dtype=torch.bool)  # [R, V]
        fast = [j for j, i in enumerate(rows) if isinstance(states[i].grammar, BitmaskGrammar)
                and states[i].grammar.num_accepted == len(states[i].output_token_ids)]  # fmt: skip
        if fast:
            bitmask = torch.empty(len(fast), states[rows[fast[0]]].grammar.bitmask.shape[1], dtype=torch.int32)
            for k, j in enumerate(fast):
                states[rows[j]].grammar.fill(bitmask, k)
            banned = torch.stack([states[rows[j]].grammar.banned_or_none() for j in fast])  # [F, V]
            allowed[fast] = unpack(bitmask, V) & ~banned
        for j in sorted(set(range(len(rows))) - set(fast)):
            allowed[j] = self.mask(states[rows[j]], V)
        logits = logits.clone()
        logits[rows] = self._apply(logits[rows], allowed.to(logits.device))
        return logits


DEFAULT_PROCESSORS: tuple[LogitsProcessor, ...] = (MinTokens(), Penalties(), GrammarMask())


class Sampler:
    def __init__(self, processors: Sequence[LogitsProcessor] = DEFAULT_PROCESSORS, keyed_draws: bool = False):
        """`keyed_draws` (batch_invariant=True): a sampled row's token is argmax(log p + noise), the
        noise a function of the request's seed and the token's position (sampling.keyed_gumbel)."""
        self.processors = tuple(processors)
        self.keyed_draws = keyed_draws

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

    def probabilities_loop(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Stage 1, the reference: logits [B, V] -> the distribution each row is sampled from,
        probs [B, V], one row at a time. A greedy row is one-hot at the argmax of its processed
        logits: sampling from it is the argmax, and level 4's rejection sampler needs no
        special case to be exact for it."""
        probs = torch.empty_like(logits)  # [B, V]
        for i, st in enumerate(states):
            row = self.process_row(logits[i], st)  # [V]
            if st.params.greedy:
                probs[i] = torch.nn.functional.one_hot(row.argmax(), row.shape[-1]).to(probs.dtype)
            else:
                probs[i] = torch.softmax(row, dim=-1)
        return probs

    def process(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Every processor over the batch: logits [B, V] -> logits [B, V]."""
        for proc in self.processors:
            if hasattr(proc, "batch"):
                logits = proc.batch(logits, states)
                continue
            rows = [i for i, st in enumerate(states) if proc.applies(st.params)]
            if rows:
                logits = logits.clone()
                for i in rows:
                    logits[i] = proc(logits[i], states[i])
        return logits

    def probabilities(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Stage 1: `probabilities_loop`'s result for the whole batch at once, probs [B, V]."""
        V = logits.shape[-1]
        dev, dt = logits.device, logits.dtype
        logits = self.process(logits, states)  # [B, V]
        params = [st.params for st in states]
        greedy = torch.tensor([p.greedy for p in params], device=dev)  # [B]
        probs = torch.empty_like(logits)  # [B, V]
        if not greedy.all():
            temperature = torch.tensor([p.temperature or 1.0 for p in params], dtype=dt, device=dev)[:, None]  # [B, 1]
            filtered = filter_logits_batch(
                logits / temperature,
                torch.tensor([p.top_k for p in params], device=dev),
                torch.tensor([p.top_p for p in params], dtype=dt, device=dev),
                torch.tensor([p.min_p for p in params], dtype=dt, device=dev),
            )  # [B, V]
            probs = torch.softmax(filtered, dim=-1)
        if greedy.any():
            one_hot = torch.nn.functional.one_hot(logits[greedy].argmax(-1), V).to(dt)  # [G, V]
            probs[greedy] = one_hot
        return probs

    def draw(self, probs: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Stage 2. probs [B, V] -> one token per row [B] (long), each from its own generator (or,
        with keyed draws, from noise keyed by its seed and position)."""
        out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
        for i, st in enumerate(states):
            if st.params.greedy:
                out[i] = probs[i].argmax()
            elif self.keyed_draws:
                position = len(st.prompt_token_ids) + len(st.output_token_ids)  # of the token being drawn
                noise = keyed_gumbel(st.generator.initial_seed(), position, probs.shape[-1], probs.dtype, probs.device)
                out[i] = (probs[i].log() + noise).argmax()  # probability 0: log 0 = -inf, never drawn
            else:
                out[i] = torch.multinomial(probs[i], 1, generator=st.generator)[0]
        return out

    def sample(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """logits [B, V] (float32+) -> next tokens [B] (long). One row per state."""
        if all(self.is_plain_greedy(st.params) for st in states):
            return logits.argmax(dim=-1)  # the fast path: plain greedy
        return self.draw(self.probabilities(logits, states), states)
