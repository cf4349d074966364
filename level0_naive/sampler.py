"""The sampler: logits in, tokens out. Where temperature, top-k, top-p and min-p are applied.

What it is: `Sampler`, the one component every level samples with, in two stages, so the
distribution a row is drawn from can be had without the draw:

    logits [B, V] --probabilities()--> probs [B, V] --draw()--> tokens [B]
                   the logits processors that       one multinomial draw per row from
                   apply (logits_processors.py),    the request's own generator; a
                   then / temperature, top-k,       greedy row takes its argmax
                   top-p, min-p (a greedy row:
                   one-hot at the argmax)

and the filter itself, twice, side by side and tested equal (tests/test_sampling.py):
`filter_logits`, one row (the definition, read it first; `probabilities_loop` runs every row
through it), and `filter_logits_batch`, every row at once with its own settings (what
`probabilities` runs). A batch of plain greedy rows takes the fast path, one `argmax`.

Each request draws from its own `torch.Generator`, so a seeded request gives the same tokens
whatever batch it lands in. A room may swap the draw of a sampled row (`draw_row`) and add
processors to the chain (`ladder/rooms.py`). Level 4's rejection sampler reuses the first
stage (its draft's q, its target's p) and reads `draws_by_position`.

What it is not: fused. `probabilities` is a dozen tensor ops over the batch, the draw one
`multinomial` per sampled row; vLLM's sampler draws the whole batch in one exponential race on the GPU.

Reference: vLLM `v1/sample/sampler.py` and `v1/sample/ops/topk_topp_sampler.py`; Holtzman et
al., "The Curious Case of Neural Text Degeneration" (2020) for top-p; Nguyen et al. (2024) for min-p.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .logits_processors import DEFAULT_PROCESSORS, LogitsProcessor, SamplingState
from .sampling_params import SamplingParams


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """logits [V] (already divided by temperature) -> logits [V] with disallowed tokens at -inf.

    Applied in HF's and vLLM's order: keep the k most likely (top_k > 0); then, of what is left,
    the smallest set of most likely tokens whose renormalised probability reaches top_p (the
    token that crosses it is kept, the best always); then drop tokens below min_p times the top probability
    (a ratio, so renormalising does not change it)."""
    V = logits.shape[-1]
    if top_k and top_k < V:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # [V], over what top-k left
    keep = torch.ones(V, dtype=torch.bool, device=logits.device)
    if top_p < 1:
        sorted_p, order = probs.sort(descending=True, stable=True)  # stable: ties in id order, as the batch twin
        mass_before = sorted_p.cumsum(0) - sorted_p  # probability of strictly better tokens
        keep_sorted = (mass_before < top_p) | (mass_before <= 0)  # the crossing token kept; the best always
        keep &= torch.zeros_like(keep).scatter(0, order, keep_sorted)
    if min_p > 0:
        keep &= probs >= min_p * probs.max()
    return logits.masked_fill(~keep, float("-inf"))


def filter_logits_batch(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, min_p: torch.Tensor | None
) -> torch.Tensor:
    """`filter_logits` for every row at once, each with its own settings.

    logits [B, V] (already divided by each row's temperature); top_k [B] long (0: off);
    top_p [B], min_p [B] in logits' dtype -> logits [B, V] with disallowed tokens at -inf.
    Row i's result equals ``filter_logits(logits[i], top_k[i], top_p[i], min_p[i])``
    (tests/test_sampling.py): a per-row k becomes a per-row threshold read from one sort,
    and a row whose setting is off keeps every token, as its twin would. A setting is None where every
    row has it off: the host knows that from the requests (asking `(top_p < 1).any()` would wait for the GPU)."""
    B, V = logits.shape
    if top_k is not None:
        k = torch.where((top_k > 0) & (top_k < V), top_k, V)  # [B]; V keeps everything
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # [B, V], over what top-k left
    keep = torch.ones(B, V, dtype=torch.bool, device=logits.device)
    if top_p is not None:
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p  # [B, V]: probability of strictly better tokens
        keep_sorted = (mass_before < top_p[:, None]) | (top_p >= 1)[:, None] | (mass_before <= 0)  # as above
        keep &= torch.zeros_like(keep).scatter(1, order, keep_sorted)
    if min_p is not None:
        keep &= probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(~keep, float("-inf"))


class Sampler:
    # True where a sampled row's token is a function of its seed and position alone (a room's draw:
    # ladder/rooms.py), so the draw at a position can be repeated and compared.
    draws_by_position = False

    def __init__(self, processors: Sequence[LogitsProcessor] = DEFAULT_PROCESSORS):
        self.processors = tuple(processors)

    def is_plain_greedy(self, params: SamplingParams) -> bool:
        """Greedy with nothing that reshapes the logits: the row's token is its raw argmax."""
        return params.greedy and not any(p.applies(params) for p in self.processors)

    def process_row(self, row: torch.Tensor, st: SamplingState) -> torch.Tensor:
        """One row of raw logits [V] -> the logits the request really samples from [V]. Greedy rows get
        the processors but no temperature (nothing to divide by); sampled rows are divided and filtered."""
        for proc in self.processors:
            if proc.applies(st.params):
                row = proc(row, st)
        p = st.params
        if p.greedy:
            return row
        return filter_logits(row / p.temperature, p.top_k, p.top_p, p.min_p)

    def probabilities_loop(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Stage 1, the reference: logits [B, V] -> the distribution each row is sampled from, probs
        [B, V], one row at a time. A greedy row is one-hot at the argmax of its processed logits:
        sampling from it is the argmax, so whoever reads the distribution needs no special case."""
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
        # Decided on the host (a filter no row uses: None); sent non_blocking (torch.tensor(device=cuda) waits).
        send = lambda xs, d=dt: torch.tensor(xs, dtype=d).to(dev, non_blocking=True)  # noqa: E731
        greedy, probs = [i for i, p in enumerate(params) if p.greedy], torch.empty_like(logits)  # probs [B, V]
        if len(greedy) < len(params):
            setting = lambda xs, on, d=dt: send(xs, d) if any(map(on, xs)) else None  # noqa: E731
            temperature = send([p.temperature or 1.0 for p in params])[:, None]  # [B, 1]
            filtered = filter_logits_batch(
                logits / temperature,
                setting([p.top_k for p in params], lambda k: 0 < k < V, torch.long),
                setting([p.top_p for p in params], lambda p: p < 1),
                setting([p.min_p for p in params], lambda p: p > 0),
            )  # [B, V]
            probs = torch.softmax(filtered, dim=-1)
        if greedy:
            rows = send(greedy, torch.long)  # [G]
            probs[rows] = torch.nn.functional.one_hot(logits[rows].argmax(-1), V).to(dt)  # [G, V]
        return probs

    def draw(self, probs: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Stage 2. probs [B, V] -> one token per row [B] (long): a greedy row's argmax, else `draw_row`."""
        out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
        for i, st in enumerate(states):
            out[i] = probs[i].argmax() if st.params.greedy else self.draw_row(probs[i], st)
        return out

    def draw_row(self, probs: torch.Tensor, st: SamplingState) -> torch.Tensor:
        """probs [V] of a sampled row -> its token: one multinomial draw from the request's own generator."""
        return torch.multinomial(probs, 1, generator=st.generator)[0]

    def sample(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """logits [B, V] (float32+) -> next tokens [B] (long). One row per state."""
        if all(self.is_plain_greedy(st.params) for st in states):
            return logits.argmax(dim=-1)  # the fast path: plain greedy
        return self.draw(self.probabilities(logits, states), states)


__all__ = ["Sampler", "filter_logits", "filter_logits_batch", "SamplingState"]
