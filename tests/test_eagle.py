"""EAGLE at level 4 (level4_speculative/eagle.py): a head over the target's own features proposes, the
rejection sampler decides, so the output is the target's whatever the head is.

  - greedy: the built-in target with its trained head gives level 3's tokens (float64), and its drafts are
    accepted at about the rate its card states (models/README.md), more tokens a step than the draft
    model's on the same prompts; a random head on random llama and qwen3 targets gives level 3's tokens
    with k = 1..5, preemption (a pool of a few blocks), chunked prefill (8 tokens a step) and prefix hits
    (the batch twice) (tests/test_equivalence.py draws the same among its level-4 proposers);
  - sampled: whole sequences follow the target alone (chi-square over every 4-token sequence of a
    4-token vocabulary, as tests/test_level4.py does for the draft model), and the negative control
    (a residual forgotten) fails it;
  - a head that does not fit is a one-line error.
"""

from __future__ import annotations

import pytest
import torch
from test_equivalence import eagle_checkpoint, kv_bytes
from test_level4 import sequences_pvalue, tiny_pair  # noqa: F401 (a fixture)

import level3_prefix
import level4_speculative
from ladder.models import BUILTIN, BUILTIN_EAGLE
from level0_naive import SamplingParams
from level4_speculative import rejection_sampler as rs

pytestmark = pytest.mark.level4

PROMPTS = ["ROMEO:\nBut, soft! what light", "JULIET:\nO Romeo, Romeo!", "KING RICHARD III:\nNow is the winter",
           "First Citizen:\nBefore we proceed", "HAMLET:\nTo be, or not", "MENENIUS:\nWhat work's, my countrymen"]  # fmt: skip


def eagle(head, k: int = 4) -> dict:
    return {"method": "eagle", "model": str(head), "num_speculative_tokens": k}


def test_the_built_in_head_gives_level_3s_tokens_and_drafts_as_its_card_says():
    """float64; six prompts of 80 tokens. Measured here: the head's first guess accepted 0.80 of the time, 3.5
    tokens a step with 4 guesses, against the draft model's 3.3 (offline, the card: 0.826 and 3.45)."""
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in level3_prefix.LLM("tiny-shakespeare", dtype="float64").generate(
        PROMPTS, params, progress=False)]  # fmt: skip
    stats = {}
    for name, spec in (("eagle", eagle("tiny-shakespeare-eagle")),
                       ("draft", {"model": "tiny-shakespeare-draft", "num_speculative_tokens": 4})):  # fmt: skip
        llm = level4_speculative.LLM("tiny-shakespeare", dtype="float64", speculative_config=spec)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, progress=False)] == base, name
        stats[name] = llm.llm_engine.spec_stats
    first = stats["eagle"].per_position()[0]
    assert first >= 0.7, first
    assert stats["eagle"].mean_acceptance_length > stats["draft"].mean_acceptance_length


def test_a_prefix_hit_drafts_exactly_what_computing_the_prefix_drafts():
    """The head's slots fill from 0 with no gap (row p at slot p - 1), so the blocks of a hit hold exactly what
    computing them would have written, and a hit's first row reads this step's feature: the same prompts again,
    each on a hit of its first 64 tokens, get exactly the first pass's drafts accepted (float64, greedy)."""
    prompts = [(p * 20)[:67] for p in PROMPTS]  # 67 characters (tokens): four full blocks of 16, three more
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    llm = level4_speculative.LLM("tiny-shakespeare", dtype="float64", block_size=16, speculative_config=eagle(
        "tiny-shakespeare-eagle"))  # fmt: skip
    engine, passes = llm.llm_engine, []
    for _ in range(2):
        hits, st = engine.kv.hits, engine.spec_stats
        drafted, accepted, per_position = st.num_draft_tokens, st.num_accepted_tokens, list(st.accepted_per_pos)
        llm.generate(prompts, params, progress=False)
        passes.append((engine.kv.hits - hits, st.num_draft_tokens - drafted, st.num_accepted_tokens - accepted,
                       [a - b for a, b in zip(st.accepted_per_pos, per_position)]))  # fmt: skip
    assert passes[0][0] == 0 and passes[1][0] == 64 * len(prompts)
    assert passes[1][1:] == passes[0][1:] and passes[0][2] > 0, passes


def causal(layer, q, k, v):
    """A plain causal attention backend (q [T, Hq, D], k, v [T, Hkv, D]): one sequence, no cache."""
    import torch.nn.functional as F

    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                         enable_gqa=True)  # fmt: skip
    return out.transpose(0, 1)  # [T, Hq, D]


@torch.no_grad()
def test_the_engines_head_computes_what_the_trainer_trained():
    """The engine's EagleModel and the trainer's EagleHead (Hugging Face's Llama layer, models/train_eagle.py) on
    the committed weights, float64: the same g for the same tokens and features, row t reading the token at
    position t + 1 and the target's feature at t, at RoPE position t + 1."""
    from ladder.models import train_eagle_module
    from level0_naive.loader import load_metadata, load_model
    from level4_speculative.eagle import load_eagle

    te = train_eagle_module()
    hf_target = te.load_hf(str(BUILTIN), torch.float64)
    theirs = te.load_head(BUILTIN_EAGLE, hf_target).double()
    target = load_model(BUILTIN, torch.float64)
    ours = load_eagle(str(BUILTIN_EAGLE), target, torch.float64, "cpu").model
    assert load_metadata(BUILTIN).config.hidden_size == ours.config.hidden_size
    ids = torch.tensor(list(b"ROMEO:\nBut, soft! what light through yonder window breaks?"))  # [L] bytes are tokens
    f = te.target_features(hf_target, ids[None])[0]  # [L, H] the target's features
    rows = len(ids) - 1
    want = theirs(hf_target.model.embed_tokens(ids[None, 1:]), f[None, :-1])[0]  # [L-1, H]
    ours.features = f[:-1]  # row t: f_t, beside the token at t + 1
    got = ours(ids[1:], torch.arange(1, rows + 1), causal)  # [L-1, H]
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-9), (got - want).abs().max()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_a_random_head_gives_level_3s_tokens_under_preemption_chunks_and_hits(arch, k, checkpoint_factory):
    path = checkpoint_factory(arch)
    head = eagle_checkpoint(path)
    prompts = [[(7 * i + j) % 90 + 3 for j in range(5 + 3 * i)] for i in range(4)]
    prompts += [prompts[0] + [11, 12], prompts[2][:6] + [40]]  # prefixes of earlier prompts: hits, the second time
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in level3_prefix.LLM(path, dtype="float64").generate(prompts, params, progress=False)]
    need = max(len(p) for p in prompts) + 12 + k + 1
    budget = kv_bytes(path, need + 4) + kv_bytes(head, need + 4)  # about one request's blocks in both caches
    llm = level4_speculative.LLM(path, dtype="float64", block_size=4, kv_cache_memory=budget, max_num_batched_tokens=8,
                                 speculative_config=eagle(head, k))  # fmt: skip
    engine = llm.llm_engine
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, progress=False)] == base
    assert engine.stats.preemptions > 0, "the pool was meant to preempt"
    assert engine.spec_stats.num_draft_tokens > 0


def spy_on_features(llm) -> list:
    """Every forward's features of the engine's head, as it reads them (a copy each)."""
    proposer, seen = llm.llm_engine.proposer, []
    run = proposer._run

    def spied(*args, **kwargs):
        out = run(*args, **kwargs)
        seen.append(proposer.head.features.clone())
        return out

    proposer._run = spied
    return seen


@pytest.mark.level5
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # (qwen2's checkpoints tie the LM head to the embeddings)
def test_over_tensor_parallel_ranks_the_head_on_the_driver_reads_the_same_features(arch, checkpoint_factory):
    """tensor_parallel_size=2: the head runs on the driver with a copy of the target's two ends (embeddings, LM
    head), reading the hidden states the driver's own rank computed (every TP rank holds them whole after the
    last all-reduce): the same features, drafts and tokens as in one process; pipeline parallelism is refused."""
    import level5_multigpu

    path = checkpoint_factory(arch)
    spec = eagle(eagle_checkpoint(path), 3)
    prompts, params = [[5, 6, 7, 8, 9], [30, 31] * 5, [3] * 9], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    one = level4_speculative.LLM(path, dtype="float64", block_size=4, speculative_config=spec)
    one_features = spy_on_features(one)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params, progress=False)]
    with level5_multigpu.LLM(path, dtype="float64", block_size=4, speculative_config=spec, tensor_parallel_size=2,
                             distributed_timeout_s=60) as llm:  # fmt: skip
        assert llm.llm_engine.draft.model.lm_head is not one.llm_engine.draft.model.lm_head  # (a copy: no target here)
        features = spy_on_features(llm)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, progress=False)] == want
        assert llm.spec_decode_stats().num_draft_tokens == one.spec_decode_stats().num_draft_tokens > 0
    assert len(features) == len(one_features) > 3
    for a, b in zip(features, one_features):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)  # (the ranks' halves summed: float64's rounding)
        assert a.abs().sum() > 0
    with pytest.raises(ValueError, match=r"method 'eagle' at pipeline_parallel_size > 1 is not built"):
        level5_multigpu.LLM(path, dtype="float64", speculative_config=spec, pipeline_parallel_size=2)


@pytest.mark.parametrize("arch,sharded", [("llama", False), ("qwen2", False), ("qwen2", True)])
def test_the_target_ends_are_the_targets_embeddings_and_lm_head_alone(arch, sharded, checkpoint_factory, tmp_path):
    """What the head shares where the target's layers live elsewhere (level 5): read alone from the checkpoint
    (single file or shards, the LM head tied to the embeddings or not), the loaded model's very tensors."""
    from level0_naive.loader import load_metadata, load_model
    from level0_naive.ops import DEFAULT_OPS
    from level4_speculative.eagle import target_ends

    path = checkpoint_factory(arch)
    if sharded:
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).save_pretrained(tmp_path, max_shard_size="20KB")
        assert (tmp_path / "model.safetensors.index.json").exists()
        path = tmp_path
    whole, ends = load_model(path, torch.float64).model, target_ends(load_metadata(path), torch.float64, "cpu", DEFAULT_OPS)
    assert len(ends.model.layers) == 0
    assert torch.equal(ends.model.embed_tokens.weight, whole.model.embed_tokens.weight)
    assert torch.equal(ends.lm_head.weight, whole.lm_head.weight)
    tied = whole.config.tie_word_embeddings
    assert tied == (arch == "qwen2") and (ends.lm_head.weight is ends.model.embed_tokens.weight) == tied


def test_a_request_that_never_drafts_still_names_its_prompts_blocks(checkpoint_factory):
    """The head's rows over a prompt chunk are computed right after the target's forward (as a draft model's
    prefill keeps up), so a block is named at once: one token each, the same prompt again hits every full block."""
    path = checkpoint_factory("llama")
    llm = level4_speculative.LLM(path, dtype="float64", block_size=4, speculative_config=eagle(eagle_checkpoint(path)))
    prompt, hits = list(range(3, 26)), []  # 23 tokens: 5 full blocks of 4
    for _ in range(2):
        before = llm.llm_engine.kv.hits
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), progress=False)
        hits.append(llm.llm_engine.kv.hits - before)
    assert hits == [0, 20], hits


def test_the_features_the_head_waits_for_are_counted_in_the_kv_budget(checkpoint_factory):
    """While a crowded batch does not draft (`disable_by_batch_size`), the head does not catch up, and each running
    request's filed features grow a row a step: never more rows than the tokens it holds in the cache, and none
    once its blocks are freed (preempted, finished), so all of them together never exceed the pool's slots: why
    the engine's budget counts a row of the hidden size per token beside the head's own cache."""
    path = checkpoint_factory("llama")
    head = eagle_checkpoint(path)
    budget = kv_bytes(path, 48) + kv_bytes(head, 48)  # 12 blocks of 4, for three requests of 24 tokens: preemption
    llm = level4_speculative.LLM(path, dtype="float64", block_size=4, kv_cache_memory=budget,
                                 speculative_config={**eagle(head, 2), "disable_by_batch_size": 1})  # fmt: skip
    engine = llm.llm_engine
    assert engine.draft_kv_bytes_per_token() == kv_bytes(head, 1)  # its one layer's K and V, and the feature
    assert engine.num_blocks == 12
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for i, prompt in enumerate([[3, 4, 5, 6], [6, 7, 8, 9], [10, 11, 12, 13]]):
        engine.add_request(str(i), prompt, params)
    reqs, most = list(engine.scheduler.waiting), 0
    while engine.has_unfinished_requests():
        engine.step()
        rows = {r.request_id: len(r.eagle_features[1]) if r.eagle_features else 0 for r in reqs}
        for r in reqs:
            assert rows[r.request_id] <= (r.num_computed_tokens if r in engine.scheduler.running else 0)
        assert sum(rows.values()) <= engine.num_blocks * 4
        most = max(most, *rows.values())
    assert engine.stats.preemptions > 0 and most >= 10  # the pool preempted; rows waited while nobody drafted
    assert all(r.eagle_features is None for r in reqs)  # finished: gone with their blocks


def test_a_heads_copy_of_the_embeddings_never_reaches_the_target(checkpoint_factory, tmp_path):
    """Some published heads carry the target's embeddings or LM head: they are dropped, never loaded into the
    modules the head shares with the target (a zeroed copy here: the target's tokens stay level 3's)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    path = checkpoint_factory("llama")
    head = tmp_path / "head"
    shutil.copytree(eagle_checkpoint(path), head)
    cfg = json.loads((head / "config.json").read_text())
    state = load_file(str(head / "model.safetensors"))
    state["embed_tokens.weight"] = torch.zeros(cfg["vocab_size"], cfg["hidden_size"])
    state["lm_head.weight"] = torch.zeros(cfg["vocab_size"], cfg["hidden_size"])
    save_file(state, str(head / "model.safetensors"))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    want = [o.outputs[0].token_ids for o in level3_prefix.LLM(path, dtype="float64").generate(prompts, params, progress=False)]
    llm = level4_speculative.LLM(path, dtype="float64", speculative_config=eagle(head))
    assert llm.llm_engine.loaded.model.model.embed_tokens.weight.abs().sum() > 0
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, progress=False)] == want


@pytest.mark.parametrize("negative_control", [False, True])
def test_whole_sequences_follow_the_target_alone_with_a_head(tiny_pair, negative_control, monkeypatch):  # noqa: F811
    """As test_level4's for the draft model: 6,000 samples of 4 tokens from a 4-token vocabulary, every sequence's
    frequency against the target's exact probability (rare ones pooled)."""
    target, _ = tiny_pair
    V, length, N, prompt = 4, 4, 6000, [1, 2, 3]
    if negative_control:  # forget the residual: the head's preferences leak into the output
        monkeypatch.setattr(rs, "_final_distribution", lambda p_row, q_row: p_row)
    llm = level4_speculative.LLM(target, dtype="float64", speculative_config=eagle(eagle_checkpoint(target), 2),
                                 max_num_seqs=256)  # fmt: skip
    out = llm.generate([prompt], SamplingParams(n=N, max_tokens=length, temperature=1.0, seed=1234, ignore_eos=True),
                       progress=False)[0]  # fmt: skip
    pvalue = sequences_pvalue(out, target, prompt, length, V)
    stats = llm.spec_decode_stats()
    assert stats.num_draft_tokens > 0 and 0 < stats.acceptance_rate < 1
    if negative_control:
        assert pvalue < 1e-6, "a wrong residual went unnoticed: the test cannot fail"
    else:
        assert pvalue > 1e-3


def test_a_head_that_does_not_fit_is_a_one_line_error(checkpoint_factory):
    path = checkpoint_factory("llama")
    other = checkpoint_factory("llama", seed=3, hidden_size=32, head_dim=8)
    with pytest.raises(ValueError, match=r"EAGLE head .* hidden size 32 .* the target's are 64"):
        level4_speculative.LLM(path, dtype="float64", speculative_config=eagle(eagle_checkpoint(other)))
    with pytest.raises(ValueError, match=r"is not an EAGLE head"):
        level4_speculative.LLM(path, dtype="float64", speculative_config=eagle(other))
    with pytest.raises(ValueError, match=r"speculative_config.model is required for method 'eagle'"):
        level4_speculative.LLM(path, speculative_config={"method": "eagle", "num_speculative_tokens": 2})
