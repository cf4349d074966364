"""Proposers: where the k draft tokens come from. A small model, or a look back into the prompt.

What it is: one interface, `Proposer.propose(sched) -> {seq_id: Proposal}`, called after
the scheduler has decided how many draft tokens (`sched.num_spec`) each decoding request
may have this step, and two implementations:

  - `DraftModelProposer`: a small model with its own `Worker` and its own paged KV
    cache, which shares the target's block tables and slot mapping (same block ids,
    same slots, other tensors). Its first forward of a step catches up on every token
    it has not seen, for every request that drafts this step (normally the 1-2 tokens
    the last step verified), and its last row samples d_1; then k - 1 one-token
    forwards sample d_2..d_k. A request that does not draft this step (in prefill, or
    speculation off in a crowded step: `disable_by_batch_size`) catches up on its prompt
    only, so the prompt's blocks are named in both caches at once; its generated tokens
    wait for its next drafting step, which costs nothing while the engine is too busy to
    speculate (a draft forward per step over 48 running requests cost about a quarter of a
    level-3 step, profiled).
    It keeps the processed distributions q_i it sampled from: the rejection sampler
    needs them, and temperature, top-k/p, min-p and penalties shape q exactly as they
    shape the target's p.

        target's tokens t0 .. t9 (L = 10), target computed 9, draft computed 8, k = 3
        draft forward 1: [t8 t9] at positions 8, 9   -> q1, d1    (catch-up + last token)
        draft forward 2: [d1]    at position 10      -> q2, d2
        draft forward 3: [d2]    at position 11      -> q3, d3
        target verify:   [t9 d1 d2 d3] at 9..12      -> p1 .. p4  (one forward, 4 logits rows)

  - `NgramProposer`: prompt lookup (Saxena 2023; vLLM's "ngram"): find the most recent
    earlier occurrence of the last n tokens (n from `prompt_lookup_max` down to
    `prompt_lookup_min`) and propose what followed it. No model, no cache; its q is a
    point mass on the proposed token, so rejection sampling accepts d with probability
    p(d) and stays exact.

What it is not: a tree of drafts (EAGLE, Medusa), or a proposer that runs overlapped with
the target's forward.

Reference: vLLM `v1/spec_decode/draft_model.py`, `ngram_proposer.py`; Leviathan et al. 2023.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from level0_naive.sampling import SamplingState, draw, is_plain_greedy, probabilities
from level1_paged.worker import ModelInput, Worker
from level2_continuous.scheduler import SchedulerOutput

from .request import SpecRequest


@dataclass
class Proposal:
    token_ids: list[int]  # d_1 .. d_k
    probs: torch.Tensor | None  # q [k, V] the tokens were drawn from; None: greedy, or a point mass


class Proposer(Protocol):
    has_kv_cache: bool  # does it hold K/V that must be complete before a block is shared?

    def propose(self, sched: SchedulerOutput) -> dict[int, Proposal]:
        """Draft tokens for every request with `sched.num_spec[seq_id] > 0` (maybe fewer)."""
        ...


def draft_state(req: SpecRequest, drafts: list[int]) -> SamplingState:
    """The sampling state of the position after `drafts`: penalties and min-tokens see the
    drafts as if they were output already, for the draft's q and the target's p alike."""
    return SamplingState(
        req.params, req.prompt_token_ids, req.output_token_ids + drafts, req.generator, req.eos_token_ids
    )


class DraftModelProposer:
    has_kv_cache = True

    def __init__(self, worker: Worker, block_table, block_size: int):
        self.worker, self.block_table, self.block_size = worker, block_table, block_size

    @torch.inference_mode()
    def propose(self, sched: SchedulerOutput) -> dict[int, Proposal]:
        chunks, tables, num_logits, spec = [], [], [], []
        for req, n in sched.scheduled:
            k = sched.num_spec.get(req.seq_id, 0)
            end = req.num_computed_tokens + n - k  # what the target holds after this step, drafts aside
            if not k:  # not drafting this step: keep up with the prompt only (so its blocks are named,
                end = min(end, len(req.prompt_token_ids))  # and shared, at once); the rest waits
            start = req.draft_num_computed
            if start >= end:
                continue
            chunks.append((req.token_slice(start, end - start), start))
            tables.append(self.block_table(req))
            num_logits.append(1 if k else 0)
            req.draft_num_computed = end
            if k:
                spec.append((req, k))
        if not chunks:
            return {}
        logits = self.worker.execute(ModelInput.build(chunks, tables, self.block_size, num_logits))  # [len(spec), V]
        drafts: dict[int, list[int]] = {req.seq_id: [] for req, _ in spec}
        probs: dict[int, list[torch.Tensor]] = {req.seq_id: [] for req, _ in spec}
        active = spec
        while True:
            self._sample(active, logits, drafts, probs)
            active = [(req, k) for req, k in active if len(drafts[req.seq_id]) < k]
            if not active:
                break
            # one more token each: the draft just sampled, at the next position
            step = [([drafts[r.seq_id][-1]], r.num_tokens + len(drafts[r.seq_id]) - 1) for r, _ in active]
            logits = self.worker.execute(
                ModelInput.build(step, [self.block_table(r) for r, _ in active], self.block_size, [1] * len(active))
            )
            for req, _ in active:
                req.draft_num_computed += 1
        return {sid: Proposal(d, torch.stack(probs[sid]) if probs[sid] else None) for sid, d in drafts.items()}

    @staticmethod
    def _sample(active, logits: torch.Tensor, drafts: dict, probs: dict) -> None:
        """Each active request's next draft token (and the q it came from, unless plain greedy)."""
        states = [draft_state(req, drafts[req.seq_id]) for req, _ in active]
        if all(is_plain_greedy(st.params) for st in states):
            tokens = logits.argmax(-1).tolist()
        else:
            q = probabilities(logits, states)  # [A, V]
            tokens = draw(q, states).tolist()
            for i, (req, _) in enumerate(active):
                if not req.params.greedy:
                    probs[req.seq_id].append(q[i])
        for (req, _), t in zip(active, tokens):
            drafts[req.seq_id].append(t)


class NgramProposer:
    has_kv_cache = False

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, sched: SchedulerOutput) -> dict[int, Proposal]:
        out = {}
        for req, _ in sched.scheduled:
            k = sched.num_spec.get(req.seq_id, 0)
            if k:
                out[req.seq_id] = Proposal(self.lookup(req.all_token_ids, k), None)
        return out

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
