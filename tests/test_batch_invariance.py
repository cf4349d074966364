"""Batch invariance: with `batch_invariant=True` a request's tokens and logprobs are bit for bit
the same whatever else is in the batch.

What it is:
  - the property, in float32 (where batching does change bits), drawn by hypothesis at levels
    0-4: a workload run together, with staggered arrivals, tight KV budgets (preemption and
    recomputation), small token budgets (chunked prefill), prefix caching and speculation
    (a draft model or n-grams, k up to 5), against every request run alone on a fresh engine:
    token ids and logprobs equal with `==`, greedy and seeded sampled requests alike;
  - its negative control: the same workload without the mode gives different logprobs
    (float32), so the property has the power to fail;
  - level 5 within one layout (TP = 2): the same comparison;
  - each invariant kernel against its default twin (close) and against itself on one row
    alone versus among 1..64 rows (identical bits), in float32, bfloat16 and float64;
  - the mode's errors: CUDA, float16, another attention backend; LADDER_BATCH_INVARIANT=1.

What it is not: a test of equality across modes or machines (the mode promises neither;
docs/batch_invariance.md), or a speed test.
"""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB
from hypothesis import given, settings
from hypothesis import strategies as st
from test_equivalence import eagle_checkpoint

import level0_naive
import level1_paged
import level2_continuous
import level3_prefix
import level4_speculative
from features.batch_invariance.ops import LIBRARY, InvariantOps, invariant_ops
from level0_naive import SamplingParams
from level0_naive.config import EngineConfig
from level0_naive.loader import load_metadata
from level0_naive.ops import DEFAULT_OPS

pytestmark = pytest.mark.skipif(not LIBRARY.available(), reason=f"the compiled kernels did not build: {LIBRARY.error}")


def kv_bytes(tokens: int, layers: int = 2, kv_heads: int = 2, head_dim: int = 16, dtype_bytes: int = 4) -> int:
    return tokens * 2 * layers * kv_heads * head_dim * dtype_bytes


def engine_kwargs(level: str, need: int, data, draft, target=None) -> dict:
    """The knobs a level has, drawn: KV budget (x the largest request, 1 forces preemption),
    block size, token budget (chunked prefill), prefix caching, speculation (a draft model, n-grams, or a
    random EAGLE head over `target`)."""
    kw: dict = dict(max_num_seqs=data.draw(st.integers(1, 8), label="max_num_seqs"))
    if level == "level0":
        kw["kv_cache_memory"] = kv_bytes(need * data.draw(st.sampled_from([1, 3, 100]), label="kv x"))
        return kw
    bs = data.draw(st.sampled_from([1, 4, 16]), label="block_size")
    blocks = -(-need // bs) * data.draw(st.sampled_from([1, 2, 100]), label="kv budget (x largest request)")
    kw.update(block_size=bs, kv_cache_memory=kv_bytes(blocks * bs))
    if level in ("level2", "level3", "level4"):
        kw["max_num_batched_tokens"] = data.draw(st.sampled_from([1, 5, 16, 2048]), label="token budget")
    if level in ("level3", "level4"):
        kw["enable_prefix_caching"] = data.draw(st.booleans(), label="enable_prefix_caching")
    if level == "level4":
        k = data.draw(st.integers(1, 5), label="num_speculative_tokens")
        proposer = data.draw(st.sampled_from(["draft model", "ngram"] + (["eagle"] if target else [])), label="proposer")
        if proposer == "draft model":
            kw["speculative_config"] = {"model": str(draft), "num_speculative_tokens": k}
            kw["kv_cache_memory"] += kv_bytes(blocks * bs, layers=1, kv_heads=2, head_dim=8)
        elif proposer == "eagle":  # its one layer has the target's shape; and a feature filed per token
            kw["speculative_config"] = {"method": "eagle", "model": str(eagle_checkpoint(target)), "num_speculative_tokens": k}
            hidden = load_metadata(target).config.hidden_size
            kw["kv_cache_memory"] += kv_bytes(blocks * bs, layers=1) + blocks * bs * hidden * 4
        else:
            kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}
    return kw


MODULES = {"level0": level0_naive, "level1": level1_paged, "level2": level2_continuous, "level3": level3_prefix,
           "level4": level4_speculative}  # fmt: skip


@st.composite
def workloads(draw):
    """2-6 requests sharing prefixes of a common stem; greedy or seeded sampling; logprobs on."""
    stem = draw(st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=30), label="stem")
    out = []
    for i in range(draw(st.integers(2, 6), label="requests")):
        k = draw(st.integers(0, len(stem)), label="shared prefix")
        tail = draw(st.lists(st.integers(0, VOCAB - 1), min_size=0 if k else 1, max_size=10), label="own tokens")
        sampled = draw(st.booleans(), label="sampled")
        params = SamplingParams(max_tokens=draw(st.integers(1, 12), label="max_tokens"), ignore_eos=True, logprobs=2,
                                temperature=0.8 if sampled else 0, top_p=0.9 if sampled else 1.0, seed=i)  # fmt: skip
        out.append((stem[:k] + tail, params))
    return out


def signature(out) -> tuple:
    """What must not move: the tokens, and every logprob reported for them (with the top-2)."""
    c = out.outputs[0]
    return tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in d.items())) for d in c.logprobs)


def together_and_alone(llm_of, workload) -> tuple[list, list]:
    prompts, params = [p for p, _ in workload], [s for _, s in workload]
    together = [signature(o) for o in llm_of().generate(prompts, params, progress=False)]
    alone = [signature(llm_of().generate([p], [s], progress=False)[0]) for p, s in workload]
    return together, alone


@pytest.mark.parametrize("level", [pytest.param(name, marks=getattr(pytest.mark, name)) for name in MODULES])
@settings(max_examples=25)
@given(workload=workloads(), data=st.data(), arch=st.sampled_from(["llama", "qwen3"]))
def test_each_request_is_bit_identical_alone_and_in_any_batch(level, workload, data, arch, checkpoint_factory):
    """The mode on: together (any arrival order the batch makes) == each alone, ==; float32 mostly, and
    bfloat16 and float64 (the KV budget is sized in float32 bytes: generous for bfloat16, tight for float64)."""
    path = checkpoint_factory(arch, intermediate_size=data.draw(st.sampled_from([96, 37]), label="ff"))
    draft = checkpoint_factory("llama", seed=7, hidden_size=32, head_dim=8, num_hidden_layers=1)
    need = max(len(p) + s.max_tokens for p, s in workload)
    kw = engine_kwargs(level, need, data, draft, path)
    dtype = data.draw(st.sampled_from(["float32", "float32", "bfloat16", "float64"]), label="dtype")
    if dtype == "float64" and "kv_cache_memory" in kw:
        kw["kv_cache_memory"] *= 2
    llm_of = lambda: MODULES[level].LLM(path, dtype=dtype, batch_invariant=True, **kw)
    together, alone = together_and_alone(llm_of, workload)
    assert together == alone


@pytest.mark.level2
def test_without_the_mode_the_same_comparison_finds_a_difference(checkpoint_factory):
    """The negative control: float32 without the mode, a fixed workload with decodes and chunked
    prefills; at least one request's logprobs move (so the property above can fail)."""
    path = checkpoint_factory("llama")
    g = torch.Generator().manual_seed(0)
    workload = [([int(t) for t in torch.randint(0, VOCAB, (n,), generator=g)],
                 SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)) for n in (3, 17, 9, 30)]  # fmt: skip
    llm_of = lambda mode: (
        lambda: level2_continuous.LLM(path, dtype="float32", max_num_batched_tokens=16, batch_invariant=mode)
    )
    together, alone = together_and_alone(llm_of(False), workload)
    assert together != alone, "without the mode, float32 logprobs should depend on the batch"
    together, alone = together_and_alone(llm_of(True), workload)
    assert together == alone  # the same workload with the mode


@pytest.mark.level5
def test_level5_is_invariant_within_a_layout(checkpoint_factory):
    """TP = 2 (gloo, two ranks): together == alone with the mode, float32, chunked prefill."""
    import level5_multigpu

    path = checkpoint_factory("llama")
    g = torch.Generator().manual_seed(1)
    prompts = [[int(t) for t in torch.randint(0, VOCAB, (n,), generator=g)] for n in (3, 17, 9, 30, 1)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    llm = level5_multigpu.LLM(path, dtype="float32", tensor_parallel_size=2, batch_invariant=True,
                              max_num_batched_tokens=16, distributed_timeout_s=60)  # fmt: skip
    try:
        together = [signature(o) for o in llm.generate(prompts, params, progress=False)]
        alone = [signature(llm.generate([p], params, progress=False)[0]) for p in prompts]
    finally:
        llm.llm_engine.shutdown()
    assert together == alone


@pytest.mark.level5
def test_past_two_ranks_the_all_reduce_adds_in_rank_order(monkeypatch):
    """With fixed_order and four TP ranks, Comm.all_reduce gathers the parts and adds them 0 + 1 + 2 + 3,
    whatever the message's size (a ring would group them by chunk); two ranks keep the library's."""
    from level5_multigpu import parallel_state as ps

    parts = [torch.tensor([1e8, 0.5, 3.0]), torch.tensor([1.0, -1e-8, 2.0]), torch.tensor([-1e8, 1e-8, 1.0]),
             torch.tensor([3.14159, 0.25, -6.0])]  # fmt: skip
    calls = []
    monkeypatch.setattr(ps.dist, "all_gather", lambda out, x, group=None: [o.copy_(p) for o, p in zip(out, parts)])
    monkeypatch.setattr(ps.dist, "all_reduce", lambda x, group=None: calls.append("all_reduce"))
    comm = object.__new__(ps.Comm)
    comm.stats, comm.tp_group, comm.fixed_order, comm.device = ps.CommStats(), None, True, torch.device("cpu")
    comm.topo = ps.Topology(4, 1, 0)
    got = comm.all_reduce(parts[0].clone())
    want = ((parts[0] + parts[1]) + parts[2]) + parts[3]
    assert torch.equal(got, want) and not calls and comm.stats.by_kind["all_gather"][0] == 1
    comm.topo = ps.Topology(2, 1, 0)
    comm.all_reduce(parts[0].clone())
    assert calls == ["all_reduce"]  # a + b == b + a: the library's all-reduce is fine for two


# --- keyed draws: sampled tokens as a function of (seed, position) ---------------------------------
@pytest.mark.level4
@pytest.mark.parametrize("negative_control", [False, True])
def test_keyed_draws_with_speculation_sample_the_target_exactly(negative_control, checkpoint_factory, monkeypatch):
    """With the mode, a sampled token is argmax(log p + Gumbel noise keyed by seed and position), and
    a draft guess is accepted iff it is that token. Whole 3-token sequences over a 4-token vocabulary
    (n = 4000 samples, each its own seed) must follow the target's exact probabilities by chi-square;
    the control uses the uniform draw itself as the noise, which is not an exact sampler, and must fail."""
    import math

    from scipy.stats import chisquare
    from transformers import AutoModelForCausalLM

    from features.batch_invariance import sampler as sampler_module

    kw = dict(vocab_size=4, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
              head_dim=8, num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip
    target, draft = checkpoint_factory("llama", seed=11, **kw), checkpoint_factory("llama", seed=12, **kw)
    if negative_control:
        real = sampler_module.keyed_gumbel
        monkeypatch.setattr(sampler_module, "keyed_gumbel", lambda *a: torch.exp(-torch.exp(-real(*a))))  # the uniform
    V, length, N, prompt = 4, 3, 4000, [1, 2, 3]
    llm = level4_speculative.LLM(target, dtype="float64", batch_invariant=True, max_num_seqs=512,
                                 speculative_config={"model": str(draft), "num_speculative_tokens": 2})  # fmt: skip
    params = SamplingParams(n=N, max_tokens=length, temperature=1.0, seed=99, ignore_eos=True)
    counts: dict = {}
    for c in llm.generate([prompt], params, progress=False)[0].outputs:
        counts[tuple(c.token_ids)] = counts.get(tuple(c.token_ids), 0) + 1
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64).eval()
    exact = {}
    with torch.inference_mode():
        for seq in __import__("itertools").product(range(V), repeat=length):
            logp = torch.log_softmax(model(torch.tensor([prompt + list(seq)])).logits[0], -1)
            exact[seq] = math.exp(sum(logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(seq)))
    big = [c for c in sorted(exact) if N * exact[c] >= 5]
    observed, expected = [counts.get(c, 0) for c in big], [N * exact[c] for c in big]
    if len(big) < len(exact):  # the rare sequences, pooled into one cell
        observed.append(N - sum(observed))
        expected.append(N - sum(expected))
    pvalue = chisquare(observed, expected).pvalue
    stats = llm.spec_decode_stats()
    assert stats.num_draft_tokens > 0 and 0 < stats.acceptance_rate < 1  # speculation ran, and rejected
    if negative_control:
        assert pvalue < 1e-6, "noise that is not Gumbel went unnoticed: the test cannot fail"
    else:
        assert pvalue > 1e-3


@pytest.mark.level4
def test_with_the_mode_speculation_changes_no_token_sampled_or_greedy(checkpoint_factory):
    """Keyed draws make a sampled token a function of its seed and position: the same requests,
    speculating (a random draft, k = 3) or not, give the same tokens and logprobs, bit for bit."""
    path = checkpoint_factory("llama")
    draft = checkpoint_factory("llama", seed=7, hidden_size=32, head_dim=8, num_hidden_layers=1)
    g = torch.Generator().manual_seed(2)
    prompts = [[int(t) for t in torch.randint(0, VOCAB, (n,), generator=g)] for n in (4, 11, 7)]
    params = [SamplingParams(max_tokens=12, temperature=t, seed=5, ignore_eos=True, logprobs=1) for t in (0, 0.7, 1.3)]
    runs = [
        [signature(o) for o in level4_speculative.LLM(path, dtype="float32", batch_invariant=True, **kw)
         .generate(prompts, params, progress=False)]
        for kw in ({}, {"speculative_config": {"model": str(draft), "num_speculative_tokens": 3}})
    ]  # fmt: skip
    assert runs[0] == runs[1]


# --- the kernels ----------------------------------------------------------------------------------
DTYPES = [torch.float32, torch.bfloat16, torch.float64]
ULPS = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float64: 1e-12}


@pytest.mark.level0
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(256, 256), (37, 101), (1024, 96)])  # (K, N): odd sizes hit every tail
def test_fixed_order_linear_is_close_to_torch_and_row_invariant(dtype, shape):
    K, N = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, K, generator=g).to(dtype)  # [64, K]
    w, b = torch.randn(N, K, generator=g).to(dtype), torch.randn(N, generator=g).to(dtype)
    ops = InvariantOps()
    got = ops.linear(x, w, b)  # [64, N]
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    tol = ULPS[dtype] * K**0.5 * 8
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    for n in (1, 2, 5, 17, 63):  # the first n rows alone, and row 3 after 1..60 others: the same bits
        assert torch.equal(ops.linear(x[:n], w, b), got[:n])
        assert torch.equal(ops.linear(x[3 : 3 + n], w, b)[0], got[3])
    assert torch.equal(ops.linear(x.view(8, 8, K), w, b), got.view(8, 8, N))  # [..., K] as in nn.Linear


@pytest.mark.level0
@pytest.mark.parametrize("dtype", DTYPES)
def test_fixed_order_norm_and_swiglu_are_close_and_row_invariant(dtype):
    g = torch.Generator().manual_seed(1)
    ops = InvariantOps()
    x = (torch.randn(64, 256, generator=g) * 3).to(dtype)
    w = torch.randn(256, generator=g).to(dtype)
    gate_up = (torch.randn(64, 2 * 37, generator=g) * 4).to(dtype)  # [T, 2 ff]: level 5's [gate | up], ff odd
    gate, up = gate_up.chunk(2, dim=-1)
    norm, swiglu = ops.rms_norm(x, w, 1e-5), ops.silu_mul(gate, up)
    tol = ULPS[dtype] * 4
    norm_tol = ULPS[torch.float32] * 4 if dtype == torch.float64 else tol  # HF normalises float64 in float32
    torch.testing.assert_close(norm, DEFAULT_OPS.rms_norm(x, w, 1e-5), rtol=norm_tol, atol=norm_tol)
    torch.testing.assert_close(swiglu, DEFAULT_OPS.silu_mul(gate, up), rtol=tol, atol=tol)
    for n in (1, 3, 33):
        assert torch.equal(ops.rms_norm(x[:n], w, 1e-5), norm[:n])
        assert torch.equal(ops.silu_mul(gate[:n], up[:n]), swiglu[:n])
        assert torch.equal(ops.silu_mul(gate[:n].contiguous(), up[:n].contiguous()), swiglu[:n])


@pytest.mark.level0
def test_torchs_own_silu_is_not_one_code_path():
    """Why silu_mul is in the seam: PyTorch's CPU loop computes a tensor's last elements with a
    scalar SiLU, the rest with a vector one, and somewhere in a few thousand values they differ.
    (If a future PyTorch makes them agree, this test says so and the doc's example should change.)"""
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0)) * 5
    full = torch.nn.functional.silu(x)
    moved = sum(not torch.equal(torch.nn.functional.silu(x[i - 32 : i + 1])[-1], full[i]) for i in range(40, 4000))
    assert moved > 0


@pytest.mark.level1
def test_the_mode_says_what_it_cannot_do(monkeypatch, checkpoint_factory):
    path = checkpoint_factory("llama")
    with pytest.raises(ValueError, match="float32, bfloat16 or float64, not torch.float16"):
        level1_paged.LLM(path, dtype="float16", batch_invariant=True)
    with pytest.raises(ValueError, match="attention_backend='torch'"):
        level1_paged.LLM(path, dtype="float32", batch_invariant=True, attention_backend="torch")
    with pytest.raises(ValueError, match="runs on the CPU .*not cuda"):
        invariant_ops(torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="batch_invariant=1 must be True or False"):
        EngineConfig(str(path), batch_invariant=1)
    monkeypatch.setenv("LADDER_BATCH_INVARIANT", "1")
    assert EngineConfig(str(path)).model.batch_invariant is True
    assert isinstance(level1_paged.LLM(path, dtype="float32").llm_engine.ops, InvariantOps)
    monkeypatch.setenv("LADDER_BATCH_INVARIANT", "0")
    assert EngineConfig(str(path)).model.batch_invariant is False
