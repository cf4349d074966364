"""The sampler seam: a logits processor added in one place reaches every sampling decision.

What it is: the test that `Sampler` and its chain of logits processors are the only way
tokens are chosen. A processor that bans one token, added by overriding `make_sampler()`
alone, must keep that token out of every output: at level 2 (one row per request) and at
level 4, where the draft model's q, the target's p in the rejection sampler, and the plain
rows all go through the engine's sampler. A processor that applies also takes a greedy row
off the one-`argmax` fast path.
"""

from __future__ import annotations

import pytest
import torch

import level2_continuous
import level4_speculative
from level0_naive import SamplingParams
from level0_naive.sampler import DEFAULT_PROCESSORS, Sampler

pytestmark = pytest.mark.level4

PROMPTS = [[3, 1, 4, 1, 5], [2, 7, 1, 8], [9, 9, 9]]


class Ban:
    """Never this token."""

    def __init__(self, token: int):
        self.token = token

    def applies(self, params: SamplingParams) -> bool:
        return True

    def __call__(self, row: torch.Tensor, st) -> torch.Tensor:
        return row.index_fill(0, torch.tensor([self.token]), float("-inf"))


def with_ban(engine_class, token: int):
    class Banned(engine_class):
        def make_sampler(self) -> Sampler:
            return Sampler([*DEFAULT_PROCESSORS, Ban(token)])

    return Banned


def run(llm_class, path, **kwargs) -> list[list[int]]:
    llm = llm_class(path, dtype="float64", **kwargs)
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=24, temperature=t, seed=1, ignore_eos=True) for t in (0, 0, 1)],
                        progress=False)  # fmt: skip
    return [o.outputs[0].token_ids for o in outs]


def test_a_processor_added_in_make_sampler_reaches_every_sampling_decision(checkpoint_factory):
    target, draft = checkpoint_factory("llama"), checkpoint_factory("llama", seed=5)
    spec = {"model": str(draft), "num_speculative_tokens": 3}
    plain = run(level2_continuous.LLM, target)
    counts = torch.bincount(torch.tensor(sum(plain, [])))
    token = int(counts.argmax())  # the token the unconstrained run emits most
    assert counts[token] >= 3

    class L2(level2_continuous.LLM):
        engine_class = with_ban(level2_continuous.LLMEngine, token)

    class L4(level4_speculative.LLM):
        engine_class = with_ban(level4_speculative.LLMEngine, token)

    banned2 = run(L2, target)
    banned4 = run(L4, target, speculative_config=spec)
    for outs in (banned2, banned4):
        assert all(token not in ids for ids in outs), "the banned token was sampled"
    assert banned4[:2] == banned2[:2], "greedy rows: level 4 with the processor equals level 2 with it"
    llm4 = L4(target, dtype="float64", speculative_config=spec)
    assert not llm4.llm_engine.sampler.is_plain_greedy(SamplingParams(temperature=0))
    assert Sampler().is_plain_greedy(SamplingParams(temperature=0))
    assert llm4.llm_engine.proposer.sampler is llm4.llm_engine.sampler, "the draft's q uses the engine's sampler"
