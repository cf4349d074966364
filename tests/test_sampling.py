"""The sampler: every filter keeps exactly the allowed set, penalties do what they define."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from level0_naive.logits_processors import SamplingState, apply_penalties
from level0_naive.sampler import Sampler, filter_logits
from level0_naive.sampling_params import SamplingParams

sample = Sampler().sample

pytestmark = pytest.mark.level0

logit_rows = st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=2, max_size=40).map(
    lambda xs: torch.tensor(xs, dtype=torch.float64)
)


def allowed_set(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The definition, written independently of the implementation (sorted Python lists)."""
    allowed = set(range(len(logits)))
    if top_k:
        kth = sorted(logits.tolist(), reverse=True)[min(top_k, len(logits)) - 1]
        allowed &= {i for i in range(len(logits)) if logits[i] >= kth}
        logits = torch.where(torch.tensor([i in allowed for i in range(len(logits))]), logits, float("-inf"))
    probs = torch.softmax(logits, -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    if top_p < 1:
        keep, mass = set(), 0.0
        for i in order:
            if mass >= top_p:
                break
            keep.add(i)
            mass += probs[i]
        allowed &= keep | {i for i in range(len(probs)) if probs[i] == probs[order[len(keep) - 1]]}
    if min_p:
        allowed &= {i for i in range(len(probs)) if probs[i] >= min_p * max(probs)}
    return allowed


@given(logit_rows, st.integers(0, 10), st.floats(0.05, 1.0), st.floats(0.0, 1.0), st.integers(0, 2**31))
def test_filters_never_emit_a_token_outside_the_allowed_set(logits, top_k, top_p, min_p, seed):
    filtered = filter_logits(logits, top_k, top_p, min_p)
    kept = set(torch.nonzero(torch.isfinite(filtered)).flatten().tolist())
    assert kept, "the most likely token is always allowed"
    probs = torch.softmax(logits, -1)
    assert kept & set(torch.nonzero(probs == probs.max()).flatten().tolist()), "a most likely token is always kept"
    assert kept <= allowed_set(logits, top_k, top_p, min_p)
    params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p)
    gen = torch.Generator().manual_seed(seed)
    state = SamplingState(params, [0], [], gen)
    for _ in range(5):
        assert int(sample(logits[None], [state])[0]) in kept


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0]])
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0)):
        state = SamplingState(params, [0], [], torch.Generator().manual_seed(0))
        assert {int(sample(logits, [state])[0]) for _ in range(20)} == {1}


def test_a_top_p_that_is_zero_in_float32_keeps_the_most_likely_token():
    """5e-324 passes `0 < top_p <= 1` as a Python float and is 0.0 in float32: the best token stays (found by
    schemathesis: every token was masked and sampling raised, a 500)."""
    from level0_naive.sampler import filter_logits_batch

    logits = torch.tensor([[0.5, 2.0, 1.0], [3.0, 0.0, 1.0]])
    assert torch.isfinite(filter_logits(logits[0], 0, 5e-324, 0.0)).tolist() == [False, True, False]
    kept = filter_logits_batch(logits, None, torch.tensor([5e-324, 5e-324]), None)
    assert torch.isfinite(kept).tolist() == [[False, True, False], [True, False, False]]


def test_penalties_follow_their_definitions():
    logits = torch.tensor([2.0, -1.0, 0.5, 0.0], dtype=torch.float64)
    st_ = SamplingState(
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt_token_ids=[3], output_token_ids=[0, 0, 2]
    )
    # token 0 seen twice: -0.5 - 2*0.25; token 2 once: -0.5 - 0.25; the prompt token is not output
    assert apply_penalties(logits, st_).tolist() == [2.0 - 1.0, -1.0, 0.5 - 0.75, 0.0]
    rep = SamplingState(SamplingParams(repetition_penalty=2.0), prompt_token_ids=[1], output_token_ids=[0])
    # HF rule over prompt + output: positive logits divided, negative multiplied
    assert apply_penalties(logits, rep).tolist() == [1.0, -2.0, 0.5, 0.0]


def test_repetition_penalty_lowers_the_chance_of_repeats():
    logits = torch.full((1, 8), 3.0)  # positive, so the repetition penalty divides them
    draws = {}
    for penalty in (1.0, 5.0):
        params = SamplingParams(repetition_penalty=penalty, presence_penalty=1.0 if penalty > 1 else 0.0)
        state = SamplingState(params, [0, 1, 2, 3], [4, 5], torch.Generator().manual_seed(0))
        draws[penalty] = sum(int(sample(logits, [state])[0]) < 6 for _ in range(400))
    assert draws[5.0] < draws[1.0] / 2


def test_seed_makes_sampling_reproducible():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    runs = []
    for _ in range(2):
        state = SamplingState(SamplingParams(temperature=1.0), [0], [], torch.Generator().manual_seed(42))
        runs.append([int(sample(logits, [state])[0]) for _ in range(30)])
    assert runs[0] == runs[1] and len(set(runs[0])) > 3


def test_min_tokens_suppresses_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 10.0, 9.0, 1.0]])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    early = SamplingState(params, [0], [3], eos_token_ids=[1])
    late = SamplingState(params, [0], [3, 3], eos_token_ids=[1])
    assert int(sample(logits, [early])[0]) == 3
    assert int(sample(logits, [late])[0]) == 1


# --------------------------------------------------------------------------- #
# The batched stage 1 equals the per-row reference                             #
# --------------------------------------------------------------------------- #

VOCAB = 12


@st.composite
def mixed_rows(draw):
    """One row's params and history: greedy or sampled, any filter, penalty, min_tokens, stops."""
    greedy = draw(st.booleans())
    params = SamplingParams(
        temperature=0.0 if greedy else draw(st.floats(0.05, 3.0)),
        top_k=draw(st.sampled_from([0, 1, 3, VOCAB - 1, VOCAB, VOCAB + 5])),
        top_p=draw(st.sampled_from([1.0, 0.9, 0.5, 0.05])),
        min_p=draw(st.sampled_from([0.0, 0.1, 0.6])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.3, 0.7])),
        presence_penalty=draw(st.sampled_from([0.0, 0.5, -1.0])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.25, -0.5])),
        min_tokens=draw(st.integers(0, 4)),
        max_tokens=8,
        ignore_eos=draw(st.booleans()),
        stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=2)),
    )
    history = st.lists(st.integers(0, VOCAB - 1), max_size=6)
    return SamplingState(params, draw(history), draw(history), eos_token_ids=[VOCAB - 1])


@given(
    st.lists(mixed_rows(), min_size=1, max_size=6),
    st.sampled_from([torch.float64, torch.float32]),
    st.integers(0, 2**31),
)
def test_batched_probabilities_equal_the_per_row_loop(states, dtype, seed):
    """Bit for bit, in float64 and float32: per-row temperature, top-k/p, min-p, penalties
    and min_tokens as tensor ops over the batch give what one row at a time gives."""
    logits = torch.randn(len(states), VOCAB, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    logits = logits.mul(3).round(decimals=1).to(dtype)  # rounded: ties happen, and must break alike
    sampler = Sampler()
    batched, loop = sampler.probabilities(logits, states), sampler.probabilities_loop(logits, states)
    assert torch.equal(batched, loop)


def test_batched_probabilities_run_a_processor_without_batch_row_by_row():
    class BanThree:
        def applies(self, params):
            return params.temperature > 0

        def __call__(self, row, st):
            return row.index_fill(0, torch.tensor([3]), float("-inf"))

    logits = torch.zeros(2, 5, dtype=torch.float64)
    states = [
        SamplingState(SamplingParams(temperature=1.0), [0], []),
        SamplingState(SamplingParams(temperature=0), [0], []),
    ]
    sampler = Sampler([BanThree()])
    probs = sampler.probabilities(logits, states)
    assert torch.equal(probs, sampler.probabilities_loop(logits, states))
    assert probs[0, 3] == 0 and probs[0, 0] == 0.25 and probs[1].tolist() == [1, 0, 0, 0, 0]


def test_min_tokens_with_nothing_to_ban_is_plain_greedy():
    """The benchmark's requests (min_tokens = max_tokens, ignore_eos, no stop ids) can ban
    nothing, so they take the one-argmax path; with a stop id or EOS to ban they do not."""
    sampler = Sampler()
    assert sampler.is_plain_greedy(SamplingParams(temperature=0, min_tokens=8, max_tokens=8, ignore_eos=True))
    assert not sampler.is_plain_greedy(SamplingParams(temperature=0, min_tokens=8, max_tokens=8))
    assert not sampler.is_plain_greedy(
        SamplingParams(temperature=0, min_tokens=8, max_tokens=8, ignore_eos=True, stop_token_ids=[3])
    )
