"""Prompt logprobs: `SamplingParams(prompt_logprobs=k)` returns each prompt token's logprob under the model.

What it is:
  - at every level, in float64, each prompt token's logprob, rank and top-k equal Hugging
    Face's log-softmax of the prompt's logits (the oracle), under chunked prefill (a token
    budget of 3), preemption and recomputation (a KV budget of one request), speculation,
    and with the prefix cache warm (level 3: the request skips the lookup and computes its
    whole prompt, as vLLM V1 does; its neighbours still hit);
  - level 5 with two pipeline stages (its own step loop);
  - the output's shape: entry 0 None, the prompt's own token in every other entry; a DELTA
    stream carries them once; a bad value is a ValueError naming the field.

What it is not: the server's `echo` (tests/test_level6.py) or the generated tokens'
logprobs (tests/test_sampling.py).
"""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB

import level0_naive
import level1_paged
import level2_continuous
import level3_prefix
import level4_speculative
from level0_naive import RequestOutputKind, SamplingParams

K = 3  # top-k alternatives per prompt token
PROMPTS = [[5, 17, 3, 90, 41, 8, 2, 60, 11, 33, 7], [60, 1, 33, 4], [5, 17, 3, 90, 41, 8, 2, 61, 12, 70]]


@torch.inference_mode()
def oracle_logprobs(path, prompt: list[int]) -> torch.Tensor:
    """log-softmax of HF's logits over the prompt [P, V]: row p is the distribution of token p + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    return torch.log_softmax(model(torch.tensor([prompt])).logits[0], -1)


def check(out, expected: torch.Tensor, k: int = K) -> None:
    plp, prompt = out.prompt_logprobs, out.prompt_token_ids
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    for p in range(1, len(prompt)):
        row, tok = expected[p - 1], prompt[p]
        entry = plp[p]
        assert abs(entry[tok].logprob - row[tok].item()) < 1e-10
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1
        top = row.topk(k).indices.tolist()
        assert set(entry) == set(top) | {tok}
        for t in top:
            assert abs(entry[t].logprob - row[t].item()) < 1e-10


def kv(path, tokens: int) -> int:
    return tokens * 2 * 2 * 2 * 16 * 8  # tokens x (k, v) x layers x KV heads x head_dim x float64


ENGINES = {
    "level0": lambda p: level0_naive.LLM(p, dtype="float64", kv_cache_memory=kv(p, 24)),
    "level1": lambda p: level1_paged.LLM(p, dtype="float64", block_size=4, kv_cache_memory=kv(p, 24)),
    "level2": lambda p: level2_continuous.LLM(p, dtype="float64", block_size=4, kv_cache_memory=kv(p, 24),
                                              max_num_batched_tokens=3),  # fmt: skip
    "level3": lambda p: level3_prefix.LLM(p, dtype="float64", block_size=4, max_num_batched_tokens=5),
    "level4": lambda p: level4_speculative.LLM(p, dtype="float64", block_size=4, max_num_batched_tokens=4,
                                               speculative_config={"model": str(p), "num_speculative_tokens": 2}),  # fmt: skip
}


@pytest.mark.parametrize("level", [pytest.param(n, marks=getattr(pytest.mark, n)) for n in ENGINES])
def test_prompt_logprobs_equal_the_oracle(level, checkpoint_factory):
    """A KV budget of one request (levels 0-2: the others wait or are preempted and recomputed), a
    token budget of 3-5 (chunked prefill), speculation with the target as its own draft (level 4)."""
    path = checkpoint_factory("llama")
    llm = ENGINES[level](path)
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=K),
              SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),  # a neighbour that asked for none
              SamplingParams(max_tokens=4, temperature=0.8, seed=1, ignore_eos=True, prompt_logprobs=0)]  # fmt: skip
    outs = llm.generate(PROMPTS, params, progress=False)
    check(outs[0], oracle_logprobs(path, PROMPTS[0]))
    assert outs[1].prompt_logprobs is None
    check(outs[2], oracle_logprobs(path, PROMPTS[2]), k=0)
    assert all(len(d) == 1 for d in outs[2].prompt_logprobs[1:])  # 0: the prompt's own token only


@pytest.mark.level3
def test_a_warm_prefix_cache_serves_the_neighbours_and_not_the_logprobs(checkpoint_factory):
    path = checkpoint_factory("llama")
    llm = level3_prefix.LLM(path, dtype="float64", block_size=4)
    plain = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.generate([PROMPTS[0]], plain, progress=False)  # the cache now holds its blocks
    hits = llm.prefix_stats()["prefix_cache_hits"]
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=K),
                       progress=False)[0]  # fmt: skip
    check(out, oracle_logprobs(path, PROMPTS[0]))
    assert llm.prefix_stats()["prefix_cache_hits"] == hits  # it computed its whole prompt: no hit
    llm.generate([PROMPTS[2]], plain, progress=False)  # shares 7 tokens (one block of 4) with PROMPTS[0]
    assert llm.prefix_stats()["prefix_cache_hits"] > hits  # a neighbour still hits the cache


@pytest.mark.level5
def test_level5_pipeline_records_them_too(checkpoint_factory):
    import level5_multigpu

    path = checkpoint_factory("llama")
    llm = level5_multigpu.LLM(path, dtype="float64", pipeline_parallel_size=2, max_num_batched_tokens=4,
                              distributed_timeout_s=60)  # fmt: skip
    try:
        out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=K),
                           progress=False)[0]  # fmt: skip
    finally:
        llm.llm_engine.shutdown()
    check(out, oracle_logprobs(path, PROMPTS[0]))


@pytest.mark.level2
def test_a_delta_stream_carries_them_once_and_bad_values_are_refused(checkpoint_factory):
    path = checkpoint_factory("llama")
    engine = level2_continuous.LLMEngine(path, dtype="float64", max_num_batched_tokens=4)
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=1,
                                                       output_kind=RequestOutputKind.DELTA))  # fmt: skip
    carried = []
    while engine.has_unfinished_requests():
        carried += [o.prompt_logprobs for o in engine.step() if o.prompt_logprobs is not None]
    assert len(carried) == 1 and len(carried[0]) == len(PROMPTS[0])
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-2)
    whole = level2_continuous.LLM(path, dtype="float64").generate([PROMPTS[1]], SamplingParams(max_tokens=1,
                                  prompt_logprobs=-1), progress=False)[0]  # fmt: skip
    assert all(len(d) == VOCAB for d in whole.prompt_logprobs[1:])  # -1: the whole vocabulary