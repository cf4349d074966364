"""The step on a virtual GPU: every tensor on the device it is used on, and no host sync it does not need.

What this is
    Levels 0-4 run whole requests with ``device="cuda"`` under tests/virtual_gpu.py (the data stays
    on the CPU; each tensor carries the device it would be on, and every call is checked against
    it): prompt logprobs and sampled logprobs at every level; speculative decoding with a draft
    model and with n-grams, greedy and sampled from seeded CUDA generators; structured outputs (the
    grammar's bitmask on the logits) and beam search. A tensor made on the CPU that meets a CUDA
    one, or a CUDA generator drawing for CPU tensors, raises `DeviceMismatch` here as it would on
    a GPU. Each run's host syncs (`.tolist()`, `.item()`, a boolean mask...) must be among those
    docs/level1_kernel.md lists under "Host syncs", each with why; a new one fails here until it
    is justified there. The first tests plant each kind of bug, to show the mode catches it.

What it is not
    A test of the kernels (tests/test_level1_kernel.py runs them on a real GPU where there is
    one), of the outputs' values (the levels' own tests), or of speed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import VOCAB
from virtual_gpu import REAL_CUDA, DeviceMismatch, on_cuda, virtual_gpu

import level0_naive
import level1_paged
import level2_continuous
import level3_prefix
import level4_speculative
from level0_naive import SamplingParams

LEVELS = [level0_naive, level1_paged, level2_continuous, level3_prefix, level4_speculative]
PROMPTS = [[5, 17, 3, 90, 41, 8, 2], [60, 1, 33, 4, 5, 17, 3, 90]]
# A small cache (the data is the CPU's); above level 1 the torch attention backend: Triton's interpreter under
# the mode is slow, and the kernel's launch is audited at level 1 (and in tests/test_level5_gpu.py).
ENGINE = dict(device="cuda", dtype="float32", kv_cache_memory=1 << 22)
PAGED = dict(ENGINE, attention_backend="torch")
DOCS = Path(__file__).resolve().parents[1] / "docs" / "level1_kernel.md"


def documented_syncs() -> set[str]:
    """The `file:function` sites of the "Host syncs" table in docs/level1_kernel.md."""
    text = DOCS.read_text()
    section = text[text.index("## Host syncs") :]
    section = section[: section.index("\n## ", 1)] if "\n## " in section[1:] else section
    return set(re.findall(r"^\| `([\w/]+\.py:[\w<>]+)`", section, flags=re.M))


def check_syncs(mode) -> None:
    assert mode.syncs, "no host sync seen at all: the token ids must come to the host once a step"
    unlisted = set(mode.syncs) - documented_syncs()
    assert not unlisted, f"host syncs not in docs/level1_kernel.md's list: {sorted(unlisted)}"


# --- the mode catches what it is for ------------------------------------------------------------
def test_the_mode_catches_a_cpu_tensor_meeting_a_cuda_one(monkeypatch):
    with virtual_gpu(monkeypatch) as mode:
        logits = on_cuda(mode, torch.randn(3, 7))
        assert logits.is_cuda and logits.device.type == "cuda"
        assert logits.gather(1, torch.zeros(3, 1, dtype=torch.long, device=logits.device)).is_cuda  # right
        with pytest.raises(DeviceMismatch, match="gather"):
            logits.gather(1, torch.zeros(3, 1, dtype=torch.long))  # the prompt-logprobs bug, planted
        assert not logits.cpu().is_cuda and logits.to("cpu").to("cuda").is_cuda


def test_the_mode_catches_a_generator_on_the_wrong_device(monkeypatch):
    with virtual_gpu(monkeypatch) as mode:
        gen = torch.Generator(device="cuda").manual_seed(0)
        p = on_cuda(mode, torch.softmax(torch.randn(5), -1))
        assert torch.multinomial(p, 1, generator=gen).is_cuda
        with pytest.raises(DeviceMismatch, match="generator"):
            torch.rand(3, generator=gen)  # the sampled-speculation bug: CPU draws from a CUDA generator
        with pytest.raises(DeviceMismatch, match="generator"):
            torch.multinomial(p.cpu(), 1, generator=gen)


def test_the_mode_counts_host_syncs_where_they_are_asked(monkeypatch):
    with virtual_gpu(monkeypatch) as mode:
        x = on_cuda(mode, torch.arange(4.0))
        x.tolist(), x[0].item(), bool(x.sum()), x[x > 1]
        torch.arange(3).tolist()  # a CPU tensor: no sync
        torch.tensor([1, 2], device="cuda"), torch.ones(2).to("cuda")  # copies from the host that wait
        torch.ones(2).to("cuda", non_blocking=True), torch.zeros(2, device="cuda")  # these do not
    assert sum(mode.syncs.values()) == 4 and sum(mode.copies.values()) == 2


# --- the levels ---------------------------------------------------------------------------------
@pytest.mark.parametrize("level", LEVELS, ids=lambda m: m.__name__)
def test_logprobs_and_sampling_on_cuda(level, llama_dir, monkeypatch):
    """Prompt logprobs, sampled tokens' logprobs, a greedy and a sampled request side by side."""
    params = [SamplingParams(max_tokens=4, prompt_logprobs=2, logprobs=2),
              SamplingParams(max_tokens=4, prompt_logprobs=-1, logprobs=1, temperature=0.8, top_k=20, top_p=0.9,
                             seed=1)]  # fmt: skip
    # level 1: auto, Triton on CUDA (the interpreter here; on a real GPU the compiled kernel refuses CPU memory)
    engine = {level0_naive: ENGINE, level1_paged: ENGINE if not REAL_CUDA else PAGED}.get(level, PAGED)
    with virtual_gpu(monkeypatch) as mode:
        outs = level.LLM(str(llama_dir), **engine).generate(PROMPTS, params, progress=False)
    assert all(len(o.outputs[0].token_ids) == 4 and o.prompt_logprobs[1] for o in outs)
    check_syncs(mode)


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculative_decoding_on_cuda(method, temperature, llama_dir, monkeypatch):
    """Level 4's guesses verified, greedy and by rejection sampling from each request's CUDA generator."""
    spec = {"model": str(llama_dir)} if method == "draft_model" else {"method": "ngram", "prompt_lookup_min": 1,
                                                                       "prompt_lookup_max": 2}  # fmt: skip
    params = SamplingParams(max_tokens=8, temperature=temperature, seed=3, logprobs=1, prompt_logprobs=1)
    prompts = [list(range(48)), list(range(VOCAB - 48, VOCAB))]  # half the vocabulary each: n-grams find guesses
    with virtual_gpu(monkeypatch) as mode:
        llm = level4_speculative.LLM(str(llama_dir), speculative_config={**spec, "num_speculative_tokens": 3}, **PAGED)
        outs = llm.generate(prompts, params, progress=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert llm.llm_engine.spec_stats.num_draft_tokens > 0, "no guess was verified: the test saw nothing"
    check_syncs(mode)


def test_beam_search_on_cuda(llama_dir, monkeypatch):
    with virtual_gpu(monkeypatch) as mode:
        llm = level3_prefix.LLM(str(llama_dir), block_size=4, **PAGED)
        outs = llm.beam_search([PROMPTS[0]], level3_prefix.BeamSearchParams(beam_width=3, max_tokens=5))
    assert len(outs[0].sequences) == 3
    check_syncs(mode)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_structured_outputs_on_cuda(temperature, checkpoint_factory, monkeypatch):
    pytest.importorskip("xgrammar", reason="structured outputs use xgrammar")
    from level0_naive import StructuredOutputsParams

    path = checkpoint_factory("llama", tokenizer=True)
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=2,
                            structured_outputs=StructuredOutputsParams(regex=r"(yes|no|maybe)!{1,3}"))  # fmt: skip
    with virtual_gpu(monkeypatch) as mode:
        out = level3_prefix.LLM(str(path), **PAGED).generate(["Who art thou?"], params, progress=False)
    assert re.fullmatch(r"(yes|no|maybe)!{1,3}", out[0].outputs[0].text)
    check_syncs(mode)
