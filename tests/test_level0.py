"""Level 0: the model against Hugging Face, the naive engine, and its bookkeeping."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import ARCHS, VOCAB

from level0_naive import LLM, SamplingParams, load_model
from level0_naive.kv_cache import Slab, SlabAttention, causal_attention

pytestmark = pytest.mark.level0

GREEDY = dict(temperature=0, ignore_eos=True)


def our_logits(loaded, prompts: list[list[int]]) -> list[torch.Tensor]:
    """One flattened forward over several prompts; logits [len(prompt), V] for each."""
    slabs = [Slab(loaded.config, len(p), torch.float64, "cpu") for p in prompts]
    attn = SlabAttention(slabs, torch.tensor([0, *itertools.accumulate(len(p) for p in prompts)]))
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.tensor([i for p in prompts for i in range(len(p))])
    logits = loaded.model.compute_logits(loaded.model(ids, pos, attn))
    return list(logits.split([len(p) for p in prompts]))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_transformers(arch, checkpoint_factory, oracle):
    path = checkpoint_factory(arch)
    loaded = load_model(path, torch.float64)
    hf = oracle.model(path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (1, 7, 130)]
    for prompt, ours in zip(prompts, our_logits(loaded, prompts)):
        theirs = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_generate_matches_hf_generate(arch, checkpoint_factory, oracle):
    """Single and batched (left-padded, as a user would call HF) with different prompt lengths."""
    path = checkpoint_factory(arch)
    hf = oracle.model(path)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (3, 11, 25)]
    llm = LLM(path, dtype="float64")
    ours = [
        o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, **GREEDY), progress=False)
    ]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    batched = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)[:, width:]
    assert ours == batched.tolist()
    single = hf.generate(torch.tensor([prompts[1]]), max_new_tokens=12, do_sample=False, pad_token_id=0)[
        0, len(prompts[1]) :
    ]
    assert ours[1] == single.tolist()


def test_causal_attention_offset_against_full_recompute():
    """Attending with a cached prefix equals the matching rows of attention over everything."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(9, 4, 8, generator=g, dtype=torch.float64)
    k, v = (
        torch.randn(9, 2, 8, generator=g, dtype=torch.float64),
        torch.randn(9, 2, 8, generator=g, dtype=torch.float64),
    )
    full = causal_attention(q, k, v, 0)
    torch.testing.assert_close(causal_attention(q[6:], k, v, 6), full[6:])
    assert not torch.allclose(causal_attention(q[6:], k, v, 5)[:2], full[6:8])  # a wrong offset shows


def test_kv_waste_is_measured_exactly(llama_dir):
    """One request alone: reserved = prompt + max_tokens every step; used grows by one."""
    llm = LLM(llama_dir, dtype="float64")
    P, N = 5, 8
    llm.generate([[1] * P], SamplingParams(max_tokens=N, **GREEDY), progress=False)
    # step j (1-based) has P + j - 1 tokens stored (the newest sampled token is not cached yet)
    used = sum(P + j - 1 for j in range(1, N + 1))
    assert llm.stats.steps == N
    assert llm.stats.kv_waste == pytest.approx(1 - used / (N * (P + N)))
    assert llm.stats.generated_tokens == N and llm.stats.peak_running == 1


def test_static_batching_holds_later_requests_back(llama_dir):
    """With room for two at a time, the third request starts only after the first batch ends."""
    llm = LLM(llama_dir, dtype="float64", max_num_seqs=2)
    outs = llm.generate(
        [[1, 2], [3, 4], [5, 6]], [SamplingParams(max_tokens=n, **GREEDY) for n in (2, 9, 2)], progress=False
    )
    first_batch_end = max(o.metrics.finished_time for o in outs[:2])
    assert outs[2].metrics.first_scheduled_time >= first_batch_end
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 9, 2]
    assert llm.stats.peak_running == 2


def test_kv_budget_limits_the_batch(llama_dir):
    llm = LLM(llama_dir, dtype="float64")
    per_request = (4 + 6) * llm.llm_engine.bytes_per_token
    llm2 = LLM(llama_dir, dtype="float64", kv_cache_memory=3 * per_request)
    out = llm2.generate([[1, 2, 3, 4]] * 7, SamplingParams(max_tokens=6, **GREEDY), progress=False)
    assert llm2.stats.peak_running == 3
    assert all(o.outputs[0].token_ids == out[0].outputs[0].token_ids for o in out)
    del llm


def test_finish_reasons_and_stop_tokens(llama_dir):
    llm = LLM(llama_dir, dtype="float64")
    greedy = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=10, **GREEDY), progress=False)[0].outputs[0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 10
    stop_tok = greedy.token_ids[4]
    first = greedy.token_ids.index(stop_tok)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=10, stop_token_ids=[stop_tok], **GREEDY), progress=False)[
        0
    ].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == greedy.token_ids[: first + 1]
    # min_tokens suppresses the stop token until enough tokens exist
    out = llm.generate(
        [[1, 2, 3]],
        SamplingParams(max_tokens=10, min_tokens=first + 2, stop_token_ids=[stop_tok], **GREEDY),
        progress=False,
    )[0].outputs[0]
    assert stop_tok not in out.token_ids[: first + 2]


def test_eos_stops_unless_ignored(checkpoint_factory):
    # The same seed gives the same weights; only the EOS id differs. Pick as EOS a token
    # the model really emits greedily, so the stop is sure to be exercised.
    free = (
        LLM(checkpoint_factory("llama"), dtype="float64")
        .generate([[7, 7, 7]], SamplingParams(max_tokens=20, **GREEDY), progress=False)[0]
        .outputs[0]
    )
    eos = free.token_ids[5]
    llm = LLM(checkpoint_factory("llama", eos_token_id=eos), dtype="float64")
    out = llm.generate([[7, 7, 7]], SamplingParams(max_tokens=20, temperature=0), progress=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]
    ignored = llm.generate([[7, 7, 7]], SamplingParams(max_tokens=20, **GREEDY), progress=False)[0].outputs[0]
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


def test_stop_strings_are_honoured_and_removed(checkpoint_factory):
    path = checkpoint_factory("llama", tokenizer=True)
    llm = LLM(path, dtype="float64")
    free = llm.generate(["Once upon"], SamplingParams(max_tokens=40, **GREEDY), progress=False)[0].outputs[0]
    # A stop string of one whole character: a random model's bytes may be partial UTF-8,
    # whose decoding ('\ufffd') changes as more bytes arrive; a complete character never does.
    spots = [i for i in range(3, len(free.text)) if free.text[i] != "\ufffd"]
    assert spots, free.text
    stop = free.text[spots[0]]
    out = llm.generate(["Once upon"], SamplingParams(max_tokens=40, stop=[stop], **GREEDY), progress=False)[0].outputs[
        0
    ]
    at = free.text.find(stop)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[:at]
    kept = llm.generate(
        ["Once upon"],
        SamplingParams(max_tokens=40, stop=stop, include_stop_str_in_output=True, **GREEDY),
        progress=False,
    )[0].outputs[0]
    assert kept.text == free.text[: at + len(stop)]


def test_text_prompts_and_chat(checkpoint_factory):
    path = checkpoint_factory("llama", tokenizer=True)
    llm = LLM(path, dtype="float64")
    out = llm.generate("hello", SamplingParams(max_tokens=5, **GREEDY), progress=False)[0]
    assert out.prompt_token_ids == list(b"hello") and len(out.outputs[0].token_ids) == 5
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, **GREEDY))[0]
    assert chat.prompt_token_ids == list(b"USER:\nhi\n\nASSISTANT:\n")


def test_logprobs_are_those_of_the_model(llama_dir, oracle):
    llm = LLM(llama_dir, dtype="float64")
    out = llm.generate([[4, 5, 6]], SamplingParams(max_tokens=3, logprobs=4, **GREEDY), progress=False)[0].outputs[0]
    hf = oracle.model(llama_dir)
    seq = [4, 5, 6] + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0], -1)  # [len, V]
    total = 0.0
    for j, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[2 + j]
        assert entry[tok].rank == 1  # greedy picks the top token
        assert entry[tok].logprob == pytest.approx(float(row[tok]), abs=1e-9)
        assert sorted(entry) == sorted(row.topk(4).indices.tolist())
        total += entry[tok].logprob
    assert out.cumulative_logprob == pytest.approx(total)


def test_seeded_sampling_is_reproducible_and_n_samples_differ(llama_dir):
    llm = LLM(llama_dir, dtype="float64")
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=123, n=3, ignore_eos=True)
    a = llm.generate([[1, 2, 3]], p, progress=False)[0]
    b = llm.generate([[9, 9], [1, 2, 3]], p, progress=False)[1]  # another batch around it
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1
    # unseeded requests differ from each other but repeat with the engine seed
    q = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    r1 = [
        o.outputs[0].token_ids
        for o in LLM(llama_dir, dtype="float64", seed=5).generate([[1, 2, 3]] * 2, q, progress=False)
    ]
    r2 = [
        o.outputs[0].token_ids
        for o in LLM(llama_dir, dtype="float64", seed=5).generate([[1, 2, 3]] * 2, q, progress=False)
    ]
    assert r1 == r2 and r1[0] != r1[1]


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(n=0), "n"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(stop=[""]), "stop"),
        (dict(max_tokens=3, min_tokens=5), "min_tokens"),
    ],
)
def test_bad_sampling_params_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


def test_bad_prompts_are_refused_before_any_work(llama_dir):
    llm = LLM(llama_dir, dtype="float64", max_model_len=32)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        llm.generate([[1, 2], []], progress=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * 32], progress=False)
    with pytest.raises(ValueError, match="outside"):
        llm.generate([[VOCAB + 5]], progress=False)
    assert llm.stats.steps == 0  # nothing ran
    ok = llm.generate([[1, 2]], SamplingParams(max_tokens=50, **GREEDY), progress=False)[0].outputs[0]
    assert len(ok.token_ids) == 30 and ok.finish_reason == "length"  # capped by max_model_len


def test_stop_token_ids_outside_the_vocabulary_are_refused_when_added(llama_dir):
    """An id >= V would fail the min_tokens ban inside a step, and with it every running
    request; it is refused when the request is added (`make_group`, what level 2's
    `add_request` calls), naming the field."""
    llm = LLM(llama_dir, dtype="float64")
    bad = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[3, VOCAB])
    with pytest.raises(ValueError, match=r"stop_token_ids=\[3, 97\].*vocabulary \[0, 97\)"):
        llm.llm_engine.inputs.make_group([1, 2], bad)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([[1, 2], [3, 4]], [SamplingParams(max_tokens=4), bad], progress=False)
    assert llm.stats.steps == 0  # nothing ran
    edge = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[VOCAB - 1], **GREEDY)
    assert len(llm.generate([[1, 2]], edge, progress=False)[0].outputs[0].token_ids) == 4


def test_a_refused_call_uses_no_request_id_and_no_random_draw(llama_dir):
    """Every prompt is checked before ids and seeds are handed out: after a call whose
    last prompt is refused, the engine numbers and samples as if it never happened."""
    q = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    refused, fresh = LLM(llama_dir, dtype="float64", seed=5), LLM(llama_dir, dtype="float64", seed=5)
    with pytest.raises(ValueError, match="prompt 3 is empty"):
        refused.generate([[1, 2, 3]] * 3 + [[]], q, progress=False)
    after, clean = (llm.generate([[1, 2, 3]] * 2, q, progress=False) for llm in (refused, fresh))
    assert [o.request_id for o in after] == [o.request_id for o in clean] == ["0", "1"]
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in clean]
    assert refused.llm_engine.inputs.make_group([1], q)[0].seq_id == 2  # no sequence id was used either


def test_unknown_model_path_names_where_it_looked(tmp_path):
    with pytest.raises(ValueError, match="looked in"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="not found|looked in"):
        LLM("no-such-org/no-such-model")


def test_unsupported_architecture_is_named(tmp_path, llama_dir):
    import json
    import shutil

    bad = tmp_path / "gpt2ish"
    shutil.copytree(llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(bad)


def test_sharded_checkpoint_loads(tmp_path, checkpoint_factory):
    from transformers import AutoModelForCausalLM

    src = checkpoint_factory("qwen2")
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float64)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    a = LLM(src, dtype="float64").generate([[3, 4]], SamplingParams(max_tokens=6, **GREEDY), progress=False)
    b = LLM(tmp_path, dtype="float64").generate([[3, 4]], SamplingParams(max_tokens=6, **GREEDY), progress=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_sliding_window_caps_the_context_instead_of_being_ignored():
    from level0_naive.loader import model_config_from_hf

    base = dict(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=512,
    )
    assert model_config_from_hf({**base, "model_type": "mistral", "sliding_window": 64}).max_position_embeddings == 64
    assert (
        model_config_from_hf({**base, "model_type": "mistral", "sliding_window": None}).max_position_embeddings == 512
    )
    qwen2 = {**base, "model_type": "qwen2", "sliding_window": 64}
    assert model_config_from_hf({**qwen2, "use_sliding_window": False}).max_position_embeddings == 512
    assert model_config_from_hf({**qwen2, "use_sliding_window": True}).max_position_embeddings == 64


def test_token_slice_matches_slicing_everything(llama_dir):
    llm = LLM(llama_dir, dtype="float64")
    [seq] = llm.llm_engine.inputs.make_group([1, 2, 3, 4], SamplingParams(max_tokens=5))
    seq.output_token_ids += [7, 8, 9]
    for start in range(7):
        for n in range(1, 8 - start):
            assert seq.token_slice(start, n) == seq.all_token_ids[start : start + n]
