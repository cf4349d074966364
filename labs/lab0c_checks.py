"""Lab 0c's own checks: the filters and the repetition penalty against Hugging Face's processors.

What it is: pytest tests that `python -m labs check 0c` runs next to tests/test_sampling.py:
on 300 seeded float64 rows (no ties), `filter_logits` keeps exactly the tokens that
transformers' `TopKLogitsWarper`, `TopPLogitsWarper` and `MinPLogitsWarper`, chained in
Hugging Face's order, keep; and `apply_penalties`' repetition penalty gives what
`RepetitionPenaltyLogitsProcessor` gives, over the prompt and the output alike. An oracle
written by other people, beside the tests' own definitions.

What it is not: presence and frequency penalties (OpenAI's, which Hugging Face does not have:
tests/test_sampling.py checks them by their definition).
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from level0_naive.logits_processors import SamplingState, apply_penalties
from level0_naive.sampler import filter_logits
from level0_naive.sampling_params import SamplingParams

SETTINGS = [(0, 0.9, 0.0), (5, 1.0, 0.0), (0, 1.0, 0.2), (8, 0.7, 0.05), (3, 0.3, 0.5), (0, 0.05, 0.0), (1, 1.0, 0.0)]


def hf_kept(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    scores = row[None].clone()  # [1, V]
    ids = torch.zeros(1, 1, dtype=torch.long)
    if top_k:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(ids, scores)
    return set(torch.isfinite(scores[0]).nonzero().flatten().tolist())


def test_filters_keep_what_hugging_faces_warpers_keep():
    g = torch.Generator().manual_seed(0)
    for i in range(300):
        row = 3 * torch.randn(int(torch.randint(2, 60, (1,), generator=g)), generator=g, dtype=torch.float64)
        top_k, top_p, min_p = SETTINGS[i % len(SETTINGS)]
        kept = set(torch.isfinite(filter_logits(row, top_k, top_p, min_p)).nonzero().flatten().tolist())
        assert kept == hf_kept(row, top_k, top_p, min_p), (i, top_k, top_p, min_p)


def test_the_repetition_penalty_is_hugging_faces():
    g = torch.Generator().manual_seed(1)
    for penalty in (1.3, 2.0, 0.7):
        row = 3 * torch.randn(40, generator=g, dtype=torch.float64)
        prompt, output = torch.randint(0, 40, (6,), generator=g).tolist(), torch.randint(0, 40, (5,), generator=g).tolist()
        st = SamplingState(SamplingParams(repetition_penalty=penalty), prompt, output)
        want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), row[None].clone())[0]
        assert torch.equal(apply_penalties(row, st), want), penalty
