"""Level 4: the rejection sampler's distribution, the engine's, and the bookkeeping around them.

What it is:
  - the rejection sampler on random p and q over a small vocabulary: the emitted token
    is distributed as p, the acceptance rate is sum(min(p, q)), by a chi-square test at
    fixed seeds, with a negative control (a wrong residual) that must fail; and the
    vectorised sampler equals the readable loop draw for draw;
  - the whole engine at temperature 1 with small random models over a tiny vocabulary:
    the distribution over whole generated sequences equals the target's alone, computed
    exactly from target forwards (chi-square; the negative control again);
  - draft = target: greedy acceptance is exactly 100 % (an off-by-one in the draft's KV
    would show as a lower rate, not as wrong text);
  - stop rules cut inside an accepted run and nothing after the stop leaks;
  - both caches (target and draft) hold, for every computed position, what a fresh recomputation gives, after
    rollbacks; blocks are named only when verified in both caches; preemption resets the
    draft's progress; a seeded request gives the same tokens whatever else is in its batch
    (while its own k is the same: see docs/level4_speculative.md);
  - configuration errors name the key.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
from conftest import build_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare
from test_equivalence import kv_bytes

import level3_prefix
import level4_speculative.rejection_sampler as rs
from level0_naive import SamplingParams
from level0_naive.kv_cache import causal_attention
from level3_prefix.block_hash import hash_block
from level4_speculative import LLM, LLMEngine

pytestmark = pytest.mark.level4

GREEDY = dict(temperature=0, ignore_eos=True)


def spec(model, k=3) -> dict:
    return {"model": str(model), "num_speculative_tokens": k}


# --- the rejection sampler alone ------------------------------------------------------------------
def random_pq(gen: torch.Generator, V: int, K: int, B: int):
    """B requests of K draft positions: p [B, K+1, V], q [B, K, V] (peaked, unlike each other),
    and drafts drawn from q."""
    p = torch.softmax(2.0 * torch.randn(B, K + 1, V, generator=gen, dtype=torch.float64), -1)
    q = torch.softmax(2.0 * torch.randn(B, K, V, generator=gen, dtype=torch.float64), -1)
    draft = torch.multinomial(q.reshape(-1, V), 1, generator=gen).reshape(B, K)
    return p, q, draft


def first_emitted(p, q, draft, seed: int, final=rs._final_distribution) -> tuple[torch.Tensor, torch.Tensor]:
    """Many draws of the vectorised sampler, each request with its own generator: the first
    emitted token of every request, and whether its first draft token was accepted."""
    B, K = draft.shape
    gens = [torch.Generator().manual_seed(seed + i) for i in range(B)]
    old, rs._final_distribution = rs._final_distribution, final
    try:
        out, accepted = rs.rejection_sample(draft, torch.full((B,), K), q, p, gens)
    finally:
        rs._final_distribution = old
    return torch.tensor([o[0] for o in out]), torch.tensor(accepted) > 0


@pytest.mark.parametrize("negative_control", [False, True])
def test_the_emitted_token_is_distributed_as_p(negative_control):
    """One (p, q) pair repeated N times: the first emitted token must follow p[0] exactly;
    the acceptance rate of the first draft token must be sum(min(p, q)). The control uses
    the residual p instead of max(0, p - q): its output leans toward q, and must fail."""
    gen, V, N = torch.Generator().manual_seed(0), 6, 20_000
    p1, q1, _ = random_pq(gen, V, 1, 1)
    p, q = p1.expand(N, 2, V).contiguous(), q1.expand(N, 1, V).contiguous()
    draft = torch.multinomial(q1[0, 0], N, replacement=True, generator=gen)[:, None]  # d ~ q, N times
    wrong = lambda p_row, q_row: p_row  # noqa: E731  the residual forgotten
    first, acc = first_emitted(p, q, draft, seed=1, final=wrong if negative_control else rs._final_distribution)
    counts = torch.bincount(first, minlength=V).double()
    pvalue = chisquare(counts.numpy(), (N * p1[0, 0]).numpy()).pvalue
    if negative_control:
        assert pvalue < 1e-6, "a wrong residual went unnoticed: the test cannot fail"
    else:
        assert pvalue > 1e-3
        alpha = torch.minimum(p1[0, 0], q1[0, 0]).sum().item()
        assert abs(acc.double().mean().item() - alpha) < 4 * math.sqrt(alpha * (1 - alpha) / N)


@settings(max_examples=10)
@given(seed=st.integers(0, 2**16), K=st.integers(1, 5), B=st.integers(1, 6), V=st.integers(2, 12))
def test_vectorised_sampler_equals_the_loop(seed, K, B, V):
    gen = torch.Generator().manual_seed(seed)
    p, q, draft = random_pq(gen, V, K, B)
    num = torch.randint(1, K + 1, (B,), generator=gen)
    fast, accepted = rs.rejection_sample(draft, num, q, p, [torch.Generator().manual_seed(seed + i) for i in range(B)])
    for i in range(B):
        k = int(num[i])
        ref = rs.rejection_sample_ref(
            draft[i, :k].tolist(), q[i, :k], p[i, : k + 1], torch.Generator().manual_seed(seed + i)
        )
        assert fast[i] == ref and accepted[i] == len(ref) - 1


def test_greedy_verify_accepts_exactly_the_matching_prefix():
    draft = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 2, 3]])
    argmax = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [4, 2, 3, 0]])
    out, acc = rs.greedy_verify(draft, torch.tensor([3, 3, 2]), argmax)
    assert out == [[5, 6, 7, 8], [5, 6], [4]] and acc == [3, 1, 0]


# --- the engine ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A target and a draft over a vocabulary of 4 tokens, different weights (so p != q)."""
    kw = dict(vocab_size=4, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
              num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip
    target = build_checkpoint(tmp_path_factory.mktemp("tiny-target"), "llama", seed=11, **kw)
    draft = build_checkpoint(tmp_path_factory.mktemp("tiny-draft"), "llama", seed=12, **kw)
    return target, draft


def exact_sequence_probs(path: Path, prompt: list[int], length: int, V: int) -> dict[tuple, float]:
    """P(x_1..x_length | prompt) for every sequence, from target forwards (float64, HF)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    probs = {}
    with torch.inference_mode():
        for seq in itertools.product(range(V), repeat=length):
            logits = model(torch.tensor([prompt + list(seq)])).logits[0]  # [P + length, V]
            logp = torch.log_softmax(logits, -1)
            probs[seq] = math.exp(sum(logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(seq)))
    return probs


def sequences_pvalue(out, target: Path, prompt: list[int], length: int, V: int) -> float:
    """Chi-square of the output's whole sequences against the target's exact probabilities (cells expected
    fewer than 5 times pooled into one, as chi-square needs)."""
    N = len(out.outputs)
    counts = {seq: 0 for seq in itertools.product(range(V), repeat=length)}
    for c in out.outputs:
        counts[tuple(c.token_ids)] += 1
    exact = exact_sequence_probs(target, prompt, length, V)
    big = [c for c in sorted(counts) if N * exact[c] >= 5]
    observed, expected = [counts[c] for c in big], [N * exact[c] for c in big]
    if len(big) < len(counts):  # the rare sequences, pooled into one cell
        observed.append(N - sum(observed))
        expected.append(N - sum(expected))
    return chisquare(observed, expected).pvalue


@pytest.mark.parametrize("negative_control", [False, True])
def test_whole_sequences_follow_the_target_alone(tiny_pair, negative_control, monkeypatch):
    """Four generated tokens (the first comes from the prefill; the next step drafts k = 2, the
    most that fits before max_tokens), so 256 possible sequences; cells expected fewer than 5
    times are pooled, as chi-square needs."""
    target, draft = tiny_pair
    V, length, N, prompt = 4, 4, 6000, [1, 2, 3]
    if negative_control:  # forget the residual: the draft's preferences leak into the output
        monkeypatch.setattr(rs, "_final_distribution", lambda p_row, q_row: p_row)
    llm = LLM(target, dtype="float64", speculative_config=spec(draft, k=2), max_num_seqs=256)
    params = SamplingParams(n=N, max_tokens=length, temperature=1.0, seed=1234, ignore_eos=True)
    out = llm.generate([prompt], params, progress=False)[0]
    pvalue = sequences_pvalue(out, target, prompt, length, V)
    stats = llm.spec_decode_stats()
    assert stats.num_draft_tokens > 0 and 0 < stats.acceptance_rate < 1  # speculation really ran, and rejected
    if negative_control:
        assert pvalue < 1e-6, "a wrong residual went unnoticed: the test cannot fail"
    else:
        assert pvalue > 1e-3


def test_draft_equal_to_target_is_accepted_every_time(checkpoint_factory):
    """Greedy, draft = target: every draft token is the target's argmax, so the acceptance rate
    is exactly 1 (a KV slot off by one shows here as a lower rate). max_tokens is not a
    multiple of k + 1, and EOS falls inside an accepted run."""
    base = checkpoint_factory("llama")
    free = LLM(base, dtype="float64").generate([[7, 7, 7]], SamplingParams(max_tokens=20, **GREEDY), progress=False)[0]
    llm = LLM(base, dtype="float64", speculative_config=spec(base, k=3))
    out = llm.generate([[7, 7, 7], [1, 2]], SamplingParams(max_tokens=10, **GREEDY), progress=False)
    s = llm.spec_decode_stats()
    assert s.num_draft_tokens > 0 and s.acceptance_rate == 1.0 and s.per_position() == [1.0, 1.0, 1.0]
    assert [len(o.outputs[0].token_ids) for o in out] == [10, 10] and out[0].outputs[0].token_ids == free.outputs[
        0
    ].token_ids[:10]
    # EOS inside an accepted run: with k = 4 the first verifying step emits tokens 1..5, so an
    # EOS at 1..4 has accepted tokens after it in the same run, which must be dropped
    eos = free.outputs[0].token_ids[3]
    first = free.outputs[0].token_ids.index(eos)
    assert 1 <= first < 5, "the test's EOS must fall inside the first accepted run"
    target = checkpoint_factory("llama", eos_token_id=eos)  # same weights, EOS id set
    llm = LLM(target, dtype="float64", speculative_config=spec(target, k=4))
    o = llm.generate([[7, 7, 7]], SamplingParams(max_tokens=20, temperature=0, logprobs=1), progress=False)[0].outputs[
        0
    ]
    assert o.finish_reason == "stop" and o.token_ids == free.outputs[0].token_ids[: first + 1]
    assert len(o.logprobs) == len(o.token_ids) and llm.stats.generated_tokens == len(o.token_ids)


def test_stop_strings_cut_inside_an_accepted_run(checkpoint_factory):
    base = checkpoint_factory("llama", tokenizer=True)
    plain = level3_prefix.LLM(base, dtype="float64")
    llm = LLM(base, dtype="float64", speculative_config=spec(base, k=4))
    ref = plain.generate(["ROMEO:"], SamplingParams(max_tokens=30, **GREEDY), progress=False)[0].outputs[0]
    stop = ref.text[7:9]  # two characters that appear after a few tokens
    for include in (False, True):
        p = SamplingParams(
            max_tokens=30, stop=[stop], include_stop_str_in_output=include, logprobs=0, min_tokens=2, **GREEDY
        )
        a = plain.generate(["ROMEO:"], p, progress=False)[0].outputs[0]
        b = llm.generate(["ROMEO:"], p, progress=False)[0].outputs[0]
        assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == (
            a.text,
            a.token_ids,
            a.finish_reason,
            a.stop_reason,
        )
        assert len(b.logprobs) == len(b.token_ids) < 30
    assert llm.spec_decode_stats().acceptance_rate == 1.0


class RecordingAttention:
    """Dense causal attention that keeps every layer's k and v: a fresh recomputation."""

    def __init__(self):
        self.k, self.v = {}, {}

    def __call__(self, layer, q, k, v):
        self.k[layer], self.v[layer] = k, v
        return causal_attention(q, k, v, 0)


def test_both_caches_equal_a_fresh_recomputation_after_rollbacks(checkpoint_factory):
    target, draft = checkpoint_factory("llama"), checkpoint_factory("llama", seed=5)
    engine = LLMEngine(target, dtype="float64", block_size=4, speculative_config=spec(draft, k=4))
    engine.add_request("a", [3, 1, 4, 1, 5], SamplingParams(max_tokens=40, temperature=1.0, seed=3))
    engine.add_request("b", [2, 7], SamplingParams(max_tokens=40, **GREEDY))
    for _ in range(8):
        engine.step()
    assert engine.spec_stats.num_draft_tokens > engine.spec_stats.num_accepted_tokens > 0  # rollbacks happened
    bs, draft_worker = 4, engine.proposer.worker
    for req in engine.scheduler.running:
        table = engine.kv.block_table(req)
        # the target's cache for its verified tokens, and the draft's for the tokens it holds (same slots, other tensors)
        for worker, n in ((engine.worker, req.num_computed_tokens), (draft_worker, req.draft_num_computed)):
            model, cache = worker.model, worker.cache
            attn = RecordingAttention()
            with torch.inference_mode():
                model(torch.tensor(req.token_slice(0, n)), torch.arange(n), attn)
            slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
            for layer in range(model.config.num_layers):
                flat_k = cache.k[layer].view(-1, *cache.k[layer].shape[2:])
                flat_v = cache.v[layer].view(-1, *cache.v[layer].shape[2:])
                torch.testing.assert_close(flat_k[slots], attn.k[layer], rtol=1e-10, atol=1e-10)
                torch.testing.assert_close(flat_v[slots], attn.v[layer], rtol=1e-10, atol=1e-10)


def test_blocks_are_named_only_when_verified_in_both_caches(checkpoint_factory):
    target, draft = checkpoint_factory("llama"), checkpoint_factory("llama", seed=5)
    engine = LLMEngine(target, dtype="float64", block_size=2, speculative_config=spec(draft, k=3))
    engine.add_request("a", list(range(1, 10)), SamplingParams(max_tokens=30, **GREEDY))
    for _ in range(6):
        engine.step()
        (req,) = engine.scheduler.running
        named = engine.kv.num_named[req.seq_id]
        assert named * 2 <= min(req.num_computed_tokens, req.draft_num_computed), (
            "a block named before both caches hold it"
        )
        assert named == min(req.num_computed_tokens, req.draft_num_computed) // 2
        # and each named block is named after its own tokens (chained), not a truncated slice
        want, parent = [], None
        for i in range(named):
            parent = hash_block(parent, tuple(req.token_slice(2 * i, 2)))
            want.append(parent)
        assert req.block_hashes[:named] == want
    # preemption resets both models' progress: the request is recomputed from scratch
    engine.scheduler._preempt(req, type("Out", (), {"preempted": []})())
    assert req.num_computed_tokens == req.draft_num_computed == 0


def test_the_next_turn_hits_the_previous_answer_as_at_level_3(checkpoint_factory):
    """Blocks completed by accepted draft runs are shareable: a prompt made of the last prompt and
    its answer finds as many cached tokens at level 4 as at level 3."""
    base = checkpoint_factory("llama")
    hits = []
    for llm in (level3_prefix.LLM(base, dtype="float64", block_size=2),
                LLM(base, dtype="float64", block_size=2, speculative_config=spec(base, k=3))):  # fmt: skip
        first = llm.generate([[3, 1, 4, 1, 5]], SamplingParams(max_tokens=17, **GREEDY), progress=False)[0]
        before = llm.llm_engine.kv.hits
        llm.generate([[3, 1, 4, 1, 5, *first.outputs[0].token_ids, 9]], SamplingParams(max_tokens=2, **GREEDY),
                     progress=False)  # fmt: skip
        hits.append(llm.llm_engine.kv.hits - before)
    assert hits[0] == hits[1] >= 5 + 17 - 2


def test_preemption_and_a_tight_budget_keep_outputs_exact(checkpoint_factory):
    target, draft = checkpoint_factory("llama"), checkpoint_factory("llama", seed=5)
    prompts, lengths = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]], [20, 25, 18, 30]
    ref = level3_prefix.LLM(target, dtype="float64")
    want = [
        o.outputs[0].token_ids
        for o in ref.generate(prompts, [SamplingParams(max_tokens=n, **GREEDY) for n in lengths], progress=False)
    ]
    budget = kv_bytes(target, 4 * 12) + kv_bytes(draft, 4 * 12)
    llm = LLM(
        target,
        dtype="float64",
        block_size=4,
        kv_cache_memory=budget,
        max_num_batched_tokens=6,
        speculative_config=spec(draft, k=4),
    )
    got = [
        o.outputs[0].token_ids
        for o in llm.generate(prompts, [SamplingParams(max_tokens=n, **GREEDY) for n in lengths], progress=False)
    ]
    assert got == want and llm.stats.preemptions > 0 and llm.spec_decode_stats().num_draft_tokens > 0
    assert llm.llm_engine.kv.num_free_blocks == llm.llm_engine.num_blocks


def test_a_seeded_request_gives_the_same_tokens_whatever_the_batch(checkpoint_factory):
    target, draft = checkpoint_factory("llama"), checkpoint_factory("llama", seed=5)
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, presence_penalty=0.5, seed=42)
    alone = LLM(target, dtype="float64", speculative_config=spec(draft, k=3)).generate(
        [[5, 6, 7]], params, progress=False
    )[0]
    others = [SamplingParams(max_tokens=n, temperature=1.0, seed=n) for n in (9, 30, 17)]
    crowd = LLM(target, dtype="float64", speculative_config=spec(draft, k=3)).generate(
        [[1, 2], [5, 6, 7], [3, 3, 3, 3], [8]], [others[0], params, others[1], others[2]], progress=False
    )
    assert crowd[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_metrics_have_vllms_names(checkpoint_factory):
    base = checkpoint_factory("llama")
    llm = LLM(base, dtype="float64", speculative_config=spec(base, k=2))
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=7, **GREEDY), progress=False)
    m = {x.name: x for x in llm.get_metrics()}
    s = llm.spec_decode_stats()
    assert m["vllm:spec_decode_num_draft_tokens"].value == s.num_draft_tokens > 0
    assert m["vllm:spec_decode_num_accepted_tokens"].value == s.num_accepted_tokens == s.num_draft_tokens
    assert m["vllm:spec_decode_num_drafts"].value == s.num_drafts
    assert m["vllm:spec_decode_num_accepted_tokens_per_pos"].values == s.accepted_per_pos
    assert m["vllm:generation_tokens"].value == 7 and s.mean_acceptance_length == 3.0
    assert "vllm:prefix_cache_hits" in m and "vllm:num_preemptions" in m


def test_ngram_proposer_finds_the_latest_repeat():
    from level4_speculative.proposers import NgramProposer

    ng = NgramProposer(1, 3)
    assert ng.lookup([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 2) == [8, 1]  # the latest "1 2 3" was followed by 8
    assert ng.lookup([5, 6, 7], 3) == []
    assert NgramProposer(2, 2).lookup([4, 4, 1, 4, 4], 2) == [1, 4]


def test_bad_speculative_configs_name_the_key(checkpoint_factory):
    base = checkpoint_factory("llama")
    other_vocab = checkpoint_factory("llama", vocab_size=101)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(base, dtype="float64", speculative_config=spec(other_vocab))
    for bad, key in [({"model": str(base)}, "num_speculative_tokens"), ({"model": str(base), "num_speculative_tokens": 0}, "num_speculative_tokens"),
                     ({"num_speculative_tokens": 2}, "method"), ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup"),
                     ({"model": str(base), "num_speculative_tokens": 2, "temperature": 1}, "unknown keys")]:  # fmt: skip
        with pytest.raises(ValueError, match=key):
            LLM(base, dtype="float64", speculative_config=bad)


def test_draft_tokens_are_trimmed_to_what_a_step_can_keep():
    """The documented trimming: `num_drafts` gives k drafts for a decoding request, fewer when its
    max_tokens or max_model_len leave less room (a step emits at most k + 1 tokens), none while it
    prefills or recomputes, none while the running batch is larger than disable_by_batch_size; and
    level 2's scheduler, unchanged, schedules only the drafts the step's token budget covers, which
    are the only ones fed and given logits rows. Outputs stay exact under any trimming."""
    from level2_continuous.kv_cache_manager import SimpleKVCacheManager
    from level2_continuous.scheduler import Scheduler
    from level4_speculative.engine import num_drafts
    from level4_speculative.request import SpecRequest

    def req(prompt_len: int, outputs: int, max_tokens: int, computed: int, max_len: int = 10_000) -> SpecRequest:
        r = SpecRequest(0, "r", 0, None, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), max_len, [], None)  # fmt: skip
        r.output_token_ids.extend([5] * outputs)
        r.num_computed_tokens = computed
        return r

    decoding = req(6, 2, 20, 7)  # 8 tokens, 7 in the cache: it feeds the token it sampled last step
    assert num_drafts(decoding, 4, 1, None) == 4
    assert num_drafts(req(6, 2, 4, 7), 4, 1, None) == 1, "2 tokens left to max_tokens: 1 draft + 1 more"
    assert num_drafts(req(6, 3, 4, 8), 4, 1, None) == 0, "the last token: nothing to speculate"
    assert num_drafts(req(6, 2, 20, 7, max_len=10), 4, 1, None) == 1, "max_model_len caps it too"
    assert num_drafts(req(6, 0, 20, 0), 4, 1, None) == 0, "a prefill drafts nothing"
    assert num_drafts(req(6, 2, 20, 0), 4, 1, None) == 0, "a recomputation drafts nothing"
    assert num_drafts(decoding, 4, 2, 2) == 4, "a batch of exactly disable_by_batch_size drafts"
    assert num_drafts(decoding, 4, 3, 2) == 0, "a larger batch drafts nothing"
    for budget, want in ((100, [9, 8, 7, 6]), (3, [9, 8]), (1, [])):
        tight = Scheduler(SimpleKVCacheManager(64, 4), budget, 8)
        r = req(6, 2, 20, 7)
        r.spec_token_ids = [9, 8, 7, 6]
        tight.running = [r]
        out = tight.schedule()
        n = 1 + len(want)
        assert out.scheduled == [(r, n)], "draft tokens count against the token budget"
        assert r.token_slice(r.num_computed_tokens, n) == [5] + want and r.num_logits(n) == n, (
            "the drafts the budget covers are fed, each with a logits row; the ones cut are not"
        )
