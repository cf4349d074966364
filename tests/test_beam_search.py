"""Beam search, the fork and copy-on-write (level 3, issue 23).

What it is:
  - `LLM.beam_search` equals Hugging Face's `generate(num_beams=W, do_sample=False)` token
    for token, and its scores HF's `sequences_scores`, in float64 on every supported
    architecture (no EOS: both run to max_tokens), and with an EOS token for length
    penalties 0, 1 and 2 (finished hypotheses, early stopping); block_size 4, so beams fork
    inside partial blocks and copy them;
  - levels 4 and 5 (tensor and pipeline parallel: the copies travel in the step's input and
    each stage copies its own layers) give level 3's beams; every block comes back;
  - a state machine over fork / append / free / admit-as-fork on the KV manager, with a model
    of the physical memory the copies and writes go to: every sequence always reads its own
    tokens, reference counts equal holders, nothing leaks or is freed twice, and no write
    lands in a block another sequence holds;
  - `n` > 1 samples fork after the prompt: the same tokens as level 2 (seeded sampling),
    the prompt computed once, under preemption, chunked prefill, n-gram speculation and an
    abort; not with a draft model or prompt logprobs;
  - bad parameters and a busy engine are refused.

What it is not: the memory figures (benchmarks/beam_memory.py, which one test runs small).
"""

from __future__ import annotations

import collections

import pytest
import torch
from conftest import ARCHS, VOCAB
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import level2_continuous
import level3_prefix
import level4_speculative
import level5_multigpu
from level0_naive import SamplingParams
from level3_prefix import BeamSearchParams
from level3_prefix.beam_search import Beam
from level3_prefix.beam_search import beam_search as search
from level3_prefix.kv_cache_manager import PrefixCachingKVCacheManager

MAX_TOKENS = 8


def prompts_for(seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (5, 11, 3)]


def hf_beams(model, prompt: list[int], width: int, max_tokens: int, **kwargs):
    """HF's W best outputs (cut at their first EOS: HF pads a finished one with it) and their scores."""
    r = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                       max_new_tokens=max_tokens, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                       **kwargs)  # fmt: skip
    eos = model.generation_config.eos_token_id
    rows = []
    for row in r.sequences[:, len(prompt) :].tolist():
        rows.append(row[: row.index(eos) + 1] if eos is not None and eos in row else row)
    return rows, r.sequences_scores.tolist()


def check_against_hf(outs, model, prompts, width, max_tokens, **kwargs):
    for prompt, out in zip(prompts, outs):
        theirs, scores = hf_beams(model, prompt, width, max_tokens, **kwargs)
        assert [s.output_token_ids for s in out.sequences] == theirs
        assert [s.tokens[: len(prompt)] for s in out.sequences] == [prompt] * width
        for s, score in zip(out.sequences, scores):
            assert abs(s.score - score) < 1e-4 * abs(score)  # HF's scores are float32


@pytest.mark.parametrize("arch", list(ARCHS))
def test_beam_search_equals_hf_without_eos(arch, checkpoint_factory, oracle):
    path = checkpoint_factory(arch)
    llm = level3_prefix.LLM(path, dtype="float64", block_size=4)
    outs = llm.beam_search(prompts_for(), BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS))
    check_against_hf(outs, oracle.model(path), prompts_for(), 3, MAX_TOKENS)
    assert all(s.finish_reason == "length" and len(s.logprobs) == MAX_TOKENS for o in outs for s in o.sequences)
    for o in outs:
        for s in o.sequences:
            assert abs(sum(s.logprobs) - s.cum_logprob) < 1e-9
    kv = llm.llm_engine.kv
    assert kv.num_copied > 0  # beams forked inside partial blocks and copied them
    assert kv.num_free_blocks == llm.llm_engine.num_blocks  # every block came back


def test_beam_search_equals_hf_with_eos(checkpoint_factory, oracle):
    """An EOS the beams like (found without EOS first: the weights do not depend on it), so
    hypotheses finish early; length penalties that prefer short, neutral and long outputs."""
    plain = level3_prefix.LLM(checkpoint_factory("llama"), dtype="float64", block_size=4)
    outs = plain.beam_search(prompts_for(), BeamSearchParams(beam_width=4, max_tokens=12))
    liked = collections.Counter(t for o in outs for s in o.sequences for t in s.output_token_ids[1:6])
    eos = liked.most_common(1)[0][0]
    path = checkpoint_factory("llama", eos_token_id=eos)
    llm = level3_prefix.LLM(path, dtype="float64", block_size=4)
    reasons = collections.Counter()
    for width in (2, 4):
        for lp in (0.0, 1.0, 2.0):
            params = BeamSearchParams(
                beam_width=width, max_tokens=12, length_penalty=lp, include_stop_str_in_output=True
            )
            outs = llm.beam_search(prompts_for(), params)
            check_against_hf(outs, oracle.model(path), prompts_for(), width, 12, length_penalty=lp)
            reasons.update(s.finish_reason for o in outs for s in o.sequences)
    assert reasons["stop"] > 0 and reasons["length"] > 0  # both kinds of end were compared
    # without include_stop_str_in_output the EOS leaves the tokens (vLLM's default), not the score
    outs = llm.beam_search(prompts_for(), BeamSearchParams(beam_width=4, max_tokens=12, length_penalty=0.0))
    stopped = [s for o in outs for s in o.sequences if s.finish_reason == "stop"]
    assert stopped and all(
        eos not in s.output_token_ids and len(s.logprobs) == len(s.output_token_ids) + 1 for s in stopped
    )


def test_beam_search_ignore_eos_and_text(checkpoint_factory):
    path = checkpoint_factory("llama", tokenizer=True)
    llm = level3_prefix.LLM(path, dtype="float64", block_size=4)
    [out] = llm.beam_search(["To be"], BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True))
    tok = llm.get_tokenizer()
    for s in out.sequences:
        assert len(s.output_token_ids) == 6 and s.text == tok.decode(s.tokens) and s.text.startswith("To be")
    assert out.sequences[0].score >= out.sequences[1].score


def test_higher_levels_give_level3s_beams(checkpoint_factory):
    path = checkpoint_factory("llama")
    params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS)

    def beams(llm):
        outs = llm.beam_search(prompts_for(), params)
        assert llm.llm_engine.kv.num_free_blocks == llm.llm_engine.num_blocks
        return [[s.tokens for s in o.sequences] for o in outs]

    ref = beams(level3_prefix.LLM(path, dtype="float64", block_size=4))
    spec = {"model": str(path), "num_speculative_tokens": 2}
    assert beams(level4_speculative.LLM(path, dtype="float64", block_size=4, speculative_config=spec)) == ref
    for kw in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        llm = level5_multigpu.LLM(path, dtype="float64", block_size=4, **kw)
        try:
            assert beams(llm) == ref
        finally:
            llm.llm_engine.shutdown()


def test_prompts_beyond_the_cache_run_in_turns_and_bad_input_is_refused(checkpoint_factory):
    path = checkpoint_factory("llama")
    params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS)
    ref = level3_prefix.LLM(path, dtype="float64", block_size=4).beam_search(prompts_for(), params)
    # room for one prompt's worst case (3 beams x 5 blocks of 4) at a time
    small = level3_prefix.LLM(path, dtype="float64", block_size=4, kv_cache_memory=16 * 4 * 2 * 2 * 2 * 16 * 8)
    assert small.llm_engine.num_blocks == 16
    got = small.beam_search(prompts_for(), params)
    assert [[s.tokens for s in o.sequences] for o in got] == [[s.tokens for s in o.sequences] for o in ref]
    with pytest.raises(ValueError, match="prompt 0: beam_width=4"):
        small.beam_search([list(range(1, 12))], BeamSearchParams(beam_width=4, max_tokens=8))
    for bad in ({"beam_width": 0, "max_tokens": 4}, {"beam_width": 2, "max_tokens": 0},
                {"beam_width": 2, "max_tokens": 4, "temperature": -1.0}):  # fmt: skip
        with pytest.raises(ValueError, match="BeamSearchParams"):
            BeamSearchParams(**bad)
    with pytest.raises(ValueError, match="must be a BeamSearchParams"):
        small.beam_search([[1, 2]], SamplingParams())
    small.llm_engine.add_request("busy", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        small.beam_search([[1, 2]], params)


def test_an_interrupted_search_gives_its_blocks_back(checkpoint_factory):
    """An error mid-search (here the on_step callback's, as an interrupt or a worker's would be) frees the
    live beams' blocks; the next search, which reuses the beams' ids, runs as on a fresh engine."""
    path = checkpoint_factory("llama")
    params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS)
    llm = level3_prefix.LLM(path, dtype="float64", block_size=4, enable_prefix_caching=False)
    calls = []

    def interrupt(beams):
        calls.append(len(beams))
        if len(calls) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        search(llm.llm_engine, prompts_for(), params, on_step=interrupt)
    engine = llm.llm_engine
    assert engine.kv.num_free_blocks == engine.num_blocks and not engine.kv.take_block_copies()
    fresh = level3_prefix.LLM(path, dtype="float64", block_size=4, enable_prefix_caching=False)
    want = [[b.tokens for b in o.sequences] for o in fresh.beam_search(prompts_for(), params)]
    assert [[b.tokens for b in o.sequences] for o in llm.beam_search(prompts_for(), params)] == want


# --- copy-on-write: a state machine over the KV manager ------------------------------------
BS, NUM_BLOCKS = 4, 24


class ForkMachine(RuleBasedStateMachine):
    """Sequences that are admitted (with the prefix cache on), forked, appended to, admitted as a
    fork of a parent's prompt, and freed, against a model of the physical memory: every copy the
    manager records and every token written go into `mem`, so a write into a shared block or a
    missing copy shows up as a sequence that no longer reads its own tokens."""

    @initialize()
    def setup(self):
        self.kv = PrefixCachingKVCacheManager(NUM_BLOCKS, BS)
        self.mem = {b: [None] * BS for b in range(NUM_BLOCKS)}  # block -> the token in each slot
        self.seqs: dict[int, Beam] = {}
        self.next_id = 0

    def new_beam(self, prompt: list[int]) -> Beam:
        self.next_id += 1
        return Beam(self.next_id, list(prompt))

    def compute(self, seq: Beam) -> None:
        """Run the step: make the recorded copies, then write the uncomputed tokens into their slots."""
        copies = self.kv.take_block_copies()
        snapshot = {src: list(self.mem[src]) for src, _ in copies}  # all read before any is written
        for src, dst in copies:
            assert self.kv.pool.blocks[dst].ref_cnt == 1
            self.mem[dst] = snapshot[src]
        table = self.kv.block_table(seq)
        for p in range(seq.num_computed_tokens, seq.num_tokens):
            block = self.kv.pool.blocks[table[p // BS]]
            assert block.ref_cnt == 1, f"seq {seq.seq_id} writes into block {block.block_id} that others hold"
            self.mem[block.block_id][p % BS] = seq.token_slice(p, 1)[0]
        seq.num_computed_tokens = seq.num_tokens
        self.kv.cache_blocks(seq)

    def admit(self, seq: Beam) -> bool:
        hits, n = self.kv.get_computed_blocks(seq)
        seq.num_computed_tokens = n
        if not self.kv.allocate_slots(seq, seq.num_tokens - n, hits):
            seq.num_computed_tokens = 0
            return False
        self.seqs[seq.seq_id] = seq
        self.compute(seq)
        return True

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=10))
    def add(self, prompt):
        self.admit(self.new_beam(prompt))  # tokens from a small alphabet: prefix hits happen

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        child = self.new_beam(parent.prompt_token_ids)
        child.output_token_ids = list(parent.output_token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        self.kv.fork(parent, child)
        self.seqs[child.seq_id] = child

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def append(self, data, tokens):
        seq = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        seq.output_token_ids += tokens
        if not self.kv.allocate_slots(seq, len(tokens)):
            del seq.output_token_ids[-len(tokens) :]  # no room: as if never scheduled
            return
        self.compute(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def sample_fork(self, data):
        """A new sample of a sequence's prompt, admitted as a fork of it (level 3's n > 1)."""
        parent = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        child = self.new_beam(parent.prompt_token_ids)
        self.kv.fork_at_admission(child, parent)
        if not self.admit(child):
            self.kv.free(child)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq = self.seqs.pop(data.draw(st.sampled_from(sorted(self.seqs))))
        self.kv.free(seq)

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq in self.seqs.values():
            table = self.kv.block_table(seq)
            for p in range(seq.num_computed_tokens):
                assert self.mem[table[p // BS]][p % BS] == seq.token_slice(p, 1)[0]

    @invariant()
    def counts_equal_holders_and_nothing_leaks(self):
        holders = collections.Counter(b for seq in self.seqs.values() for b in self.kv.block_table(seq))
        assert self.kv.ref_counts() == [holders[b] for b in range(NUM_BLOCKS)]
        assert self.kv.num_free_blocks == NUM_BLOCKS - len(holders)
        assert not self.kv.block_copies  # every copy was made by the step that needed it


TestForkMachine = ForkMachine.TestCase
TestForkMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])  # fmt: skip


# --- n > 1: samples fork after the prompt ------------------------------------------------
SAMPLES = SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=7)


def sample_prompts() -> list[list[int]]:
    """Prompt lengths around the block size (4): the forked last token at a block's start, middle, end."""
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (1, 4, 5, 7, 8, 9, 14)]


def samples(llm, prompts=None, params=SAMPLES):
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts or sample_prompts(), params, progress=False)]


@pytest.fixture(scope="module")
def level2_samples(checkpoint_factory):
    return samples(level2_continuous.LLM(checkpoint_factory("llama"), dtype="float64", block_size=4))


def test_samples_fork_after_the_prompt(checkpoint_factory, level2_samples):
    llm = level3_prefix.LLM(checkpoint_factory("llama"), dtype="float64", block_size=4)
    assert samples(llm) == level2_samples
    kv, stats, prompts = llm.llm_engine.kv, llm.llm_engine.stats, sample_prompts()
    assert stats.prompt_tokens == sum(len(p) for p in prompts) + 3 * len(prompts)  # once each, + 1 token per fork
    assert kv.forked_tokens == 3 * sum(len(p) - 1 for p in prompts)
    assert kv.num_copied == 3 * sum((len(p) - 1) % 4 != 0 for p in prompts)  # a partial last block: copied
    assert kv.num_free_blocks == llm.llm_engine.num_blocks


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kv_cache_memory": 12 * 4 * 2 * 2 * 2 * 16 * 8},  # 12 blocks: preemption and recomputation
        {"max_num_batched_tokens": 3},  # chunked prefill: the parent's prompt takes several steps
        {"enable_prefix_caching": False},
    ],
    ids=["preemption", "chunked", "no-prefix-cache"],
)
def test_forked_samples_under_pressure(kwargs, checkpoint_factory, level2_samples):
    llm = level3_prefix.LLM(checkpoint_factory("llama"), dtype="float64", block_size=4, **kwargs)
    assert samples(llm) == level2_samples
    assert llm.llm_engine.kv.forked_tokens > 0
    if "kv_cache_memory" in kwargs:
        assert llm.llm_engine.stats.preemptions > 0


def test_forks_with_ngram_speculation_not_with_a_draft(checkpoint_factory, level2_samples):
    path = checkpoint_factory("llama")
    ngram = level4_speculative.LLM(path, dtype="float64", block_size=4,
                                   speculative_config={"method": "ngram", "num_speculative_tokens": 2})  # fmt: skip
    assert samples(ngram) == level2_samples and ngram.llm_engine.kv.forked_tokens > 0
    draft = level4_speculative.LLM(path, dtype="float64", block_size=4,
                                   speculative_config={"model": str(path), "num_speculative_tokens": 2})  # fmt: skip
    greedy = SamplingParams(n=3, max_tokens=6, temperature=0.0)
    assert samples(draft, params=greedy) == samples(
        level3_prefix.LLM(path, dtype="float64", block_size=4), params=greedy
    )
    assert draft.llm_engine.kv.forked_tokens == 0


def test_prompt_logprobs_do_not_fork_and_an_abort_leaks_nothing(checkpoint_factory):
    llm = level3_prefix.LLM(checkpoint_factory("llama"), dtype="float64", block_size=4)
    outs = llm.generate(
        sample_prompts()[:2], SamplingParams(n=2, max_tokens=3, prompt_logprobs=1, seed=1), progress=False
    )
    assert all(o.prompt_logprobs is not None for o in outs) and llm.llm_engine.kv.forked_tokens == 0
    engine = llm.llm_engine
    engine.add_request("a", list(range(1, 10)), SamplingParams(n=3, max_tokens=20, seed=2))
    engine.step()  # sample 0 prefills; 1 and 2 wait for it
    assert engine.num_waiting() == 2
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_free_blocks() == engine.num_blocks and not engine.kv.fork_parents


def test_the_memory_benchmark_counts_what_sharing_saves(checkpoint_factory, tmp_path, monkeypatch):
    """Small: one request, widths 2 and 4. A sequence holds at least its own last block, so w
    sequences can save at most (w - 1) / w of the blocks; more sequences share more."""
    from benchmarks import beam_memory

    monkeypatch.setenv("INFERENCE_LADDER_OUT", str(tmp_path))
    path = checkpoint_factory("llama", tokenizer=True)
    res = beam_memory.main(["--model", str(path), "--requests", "1", "--widths", "2", "4", "--mixes", "alpaca-like"])
    saved = {(r["method"], r["width"]): r["saved"] for r in res["rows"]}
    for (method, w), s in saved.items():
        assert 0 < s < (w - 1) / w, (method, w, s)
    assert saved["beam search", 4] > saved["beam search", 2]
    assert saved["parallel sampling", 4] > saved["parallel sampling", 2]
    assert (tmp_path / "beam_memory.json").is_file()


def test_block_count():
    from benchmarks.beam_memory import BlockCount

    c = BlockCount()
    c.add([[0, 1, 2], [0, 1, 3]])  # 4 held, 6 without sharing
    c.add([[5]])  # 1 and 1
    assert (c.shared, c.unshared) == (5, 7) and abs(c.saved - 2 / 7) < 1e-12
