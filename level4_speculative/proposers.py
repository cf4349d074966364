"""Proposers: where the k draft tokens come from. A small model, or a look back into the prompt.

What it is: one interface, called by the engine after a step's tokens are in:
`Proposer.propose([(req, k), ...])` leaves up to k guesses on each request
(`req.spec_token_ids`, and `req.spec_probs`), and two implementations:

  - `DraftModelProposer`: a small model with its own `Worker` and its own paged KV
    cache, which shares the target's block tables and slot mapping (same block ids,
    same slots, other tensors). `prefill(sched)`, before the target's forward, brings
    its cache along with the prompt chunks the target computes this step (so a prompt's
    blocks are named, and shared, at once). `propose` then catches up on every token it
    has not seen (normally the 1-2 the last verification kept), its last row sampling
    d_1, and runs k - 1 one-token forwards for d_2 .. d_k. A request that does not draft
    (speculation off in a crowded step: `disable_by_batch_size`) lets its generated
    tokens wait for its next drafting step, which costs nothing while the engine is too
    busy to speculate (a draft forward per step over 48 running requests cost about a
    quarter of a level-3 step, profiled).
    It keeps the processed distributions q_i it sampled from: the rejection sampler
    needs them, and temperature, top-k/p, min-p and penalties shape q exactly as they
    shape the target's p.

        after step s: tokens t0 .. t9 (L = 10), target computed 9, draft computed 8, k = 3
        draft forward 1: [t8 t9] at positions 8, 9   -> q1, d1    (catch-up + last token)
        draft forward 2: [d1]    at position 10      -> q2, d2
        draft forward 3: [d2]    at position 11      -> q3, d3
        step s + 1, target: [t9 d1 d2 d3] at 9..12   -> p1 .. p4  (one forward, 4 logits rows)

  - `NgramProposer`: prompt lookup (Saxena 2023; vLLM's "ngram"): find the most recent
    earlier occurrence of the last n tokens (n from `prompt_lookup_max` down to
    `prompt_lookup_min`) and propose what followed it. No model, no cache; its q is a
    point mass on the proposed token, so rejection sampling accepts d with probability
    p(d) and stays exact.

A third, `EagleProposer` (eagle.py), is the draft model's with the target's own features beside
each row (EAGLE).

What it is not: a tree of drafts (EAGLE-2, Medusa), or a proposer that runs overlapped with
the target's forward.

Reference: vLLM `v1/spec_decode/draft_model.py`, `ngram_proposer.py`; Leviathan et al. 2023.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from level0_naive.logits_processors import SamplingState
from level0_naive.sampler import Sampler
from level1_paged.model_input import ModelInput
from level1_paged.worker import Worker
from level2_continuous.scheduler import SchedulerOutput

from .request import SpecRequest


class Proposer(Protocol):
    has_kv_cache: bool  # does it hold K/V that must be complete before a block is shared?

    def prefill(self, sched: SchedulerOutput) -> None:
        """Before the target's forward: keep up with the prompt chunks it computes (if it has a cache)."""
        ...

    def propose(self, drafting: list[tuple[SpecRequest, int]]) -> None:
        """Up to k guesses for each (request, k): set `req.spec_token_ids` and `req.spec_probs`."""
        ...

    def observe(self, sched: SchedulerOutput) -> None:
        """After the target's forward, before sampling: what it computed (EAGLE reads its features)."""
        ...


def draft_state(req: SpecRequest, drafts: list[int]) -> SamplingState:
    """The sampling state of the position after `drafts`: penalties, min-tokens and a constraint (a
    structured output's grammar) see the drafts as if they were output already, for the draft's q and
    the target's p alike."""
    return SamplingState(
        req.params, req.prompt_token_ids, req.output_token_ids + drafts, req.generator, req.eos_token_ids, req.constraint
    )


class DraftModelProposer:
    has_kv_cache = True

    def __init__(self, worker: Worker, block_table, block_size: int, sampler: Sampler):
        self.worker, self.block_table, self.block_size = worker, block_table, block_size
        self.sampler = sampler  # the engine's: q is processed exactly as the target's p will be

    def observe(self, sched: SchedulerOutput) -> None:
        """Nothing: a draft model reads tokens only."""

    @torch.inference_mode()
    def prefill(self, sched: SchedulerOutput) -> None:
        chunks, tables = [], []
        for req, n in sched.scheduled:
            start, end = req.draft_num_computed, min(req.num_computed_tokens + n, len(req.prompt_token_ids))
            if start < end:
                chunks.append((req.token_slice(start, end - start), start))
                tables.append(self.block_table(req))
                req.draft_num_computed = end
        if chunks:
            self.worker.execute(ModelInput.build(chunks, tables, self.block_size, [0] * len(chunks)))

    @torch.inference_mode()
    def propose(self, drafting: list[tuple[SpecRequest, int]]) -> None:
        logits = self.catch_up(drafting)  # [D, V]: each one's newest token's, whose logits give d_1
        drafts: dict[int, list[int]] = {req.seq_id: [] for req, _ in drafting}
        probs: dict[int, list[torch.Tensor]] = {req.seq_id: [] for req, _ in drafting}
        active = drafting
        while True:
            self._sample(active, logits, drafts, probs)
            active = [(req, k) for req, k in active if len(drafts[req.seq_id]) < k]
            if not active:
                break
            logits = self.one_more(active, drafts)  # [A, V]
        for req, _ in drafting:
            q = probs[req.seq_id]
            req.spec_token_ids, req.spec_probs = drafts[req.seq_id], torch.stack(q) if q else None

    def catch_up(self, drafting: list[tuple[SpecRequest, int]]) -> torch.Tensor:
        """One forward over every token each drafting request's cache lacks, to its newest -> their last rows' logits."""
        chunks = []
        for req, _ in drafting:
            start = req.draft_num_computed
            chunks.append((req.token_slice(start, req.num_tokens - start), start))
            req.draft_num_computed = req.num_tokens
        tables = [self.block_table(r) for r, _ in drafting]
        return self.worker.execute(ModelInput.build(chunks, tables, self.block_size, [1] * len(drafting)))

    def one_more(self, active: list[tuple[SpecRequest, int]], drafts: dict) -> torch.Tensor:
        """One more token each: the draft just sampled, at the next position -> the next logits."""
        step = [([drafts[r.seq_id][-1]], r.num_tokens + len(drafts[r.seq_id]) - 1) for r, _ in active]
        logits = self.worker.execute(
            ModelInput.build(step, [self.block_table(r) for r, _ in active], self.block_size, [1] * len(active))
        )
        for req, _ in active:
            req.draft_num_computed += 1
        return logits

    def _sample(self, active, logits: torch.Tensor, drafts: dict, probs: dict) -> None:
        """Each active request's next draft token (and the q it came from, unless plain greedy)."""
        states = [draft_state(req, drafts[req.seq_id]) for req, _ in active]
        if all(self.sampler.is_plain_greedy(st.params) for st in states):
            tokens = logits.argmax(-1).tolist()
        else:
            q = self.sampler.probabilities(logits, states)  # [A, V]
            tokens = self.sampler.draw(q, states).tolist()
            for i, (req, _) in enumerate(active):
                if not req.params.greedy:
                    probs[req.seq_id].append(q[i])
        for (req, _), t in zip(active, tokens):
            drafts[req.seq_id].append(t)


class NgramProposer:
    has_kv_cache = False

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def prefill(self, sched: SchedulerOutput) -> None:
        """No model, no cache: nothing to keep up with."""

    def observe(self, sched: SchedulerOutput) -> None:
        """Nothing: the lookup reads tokens only."""

    def propose(self, drafting: list[tuple[SpecRequest, int]]) -> None:
        for req, k in drafting:
            req.spec_token_ids, req.spec_probs = self.lookup(req.all_token_ids, k), None

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix n-gram."""
        seq = np.asarray(tokens)
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # every n-gram that has a successor
            hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
            if hits.size:
                start = hits[-1] + n  # the most recent occurrence
                return seq[start : start + k].tolist()
        return []
