"""Beam search through the server (`"use_beam_search": true`, level6_serving/beam_search.py).

What it is:
  - /v1/completions and /v1/chat/completions with `use_beam_search` give offline `LLM.beam_search`'s
    hypotheses (float64: the same tokens, not luck at a near-tie), best first, n per prompt, with their
    finish reasons and the usage they add up to; `n`, `length_penalty`, `ignore_eos` and
    `include_stop_str_in_output` become the search's parameters (`temperature` does not: raw scores);
  - what a search cannot honour is a 400 naming the field (stream, logprobs, stop, a sampling filter, a
    beam width past what the logprobs allow), never silently dropped;
  - a search whose reader goes away leaves no request behind in the engine;
  - the k logprobs each step asks for are enough: on a stand-in engine whose next-token
    distributions are a seeded table with an EOS often near the top, the search that sees each
    beam's best k only picks what the search that sees whole rows picks (asking for the beam
    width, not twice it, fails there).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import zlib
from types import SimpleNamespace

import httpx
import pytest
import torch
from level6_helpers import NAME, metrics, wait_for

from level3_prefix.beam_search import BeamSearchParams, Search
from level6_serving.beam_search import SearchAborted, SharedByHash, beam_search, next_token_logprobs
from level6_serving.metrics import value
from level6_serving.protocol import CompletionRequest

pytestmark = pytest.mark.level6

PROMPTS = ["To be, or not", "O Romeo"]


def offline_beams(llm, prompts, **kw) -> list[list[tuple[list[int], str]]]:
    """Offline `LLM.beam_search`: per prompt, its hypotheses' (output token ids, finish reason), best first."""
    outs = llm.beam_search(prompts, BeamSearchParams(**kw))
    return [[(s.output_token_ids, s.finish_reason) for s in out.sequences] for out in outs]


def on_server_loop(server, coro):
    """Run `coro` on the server's event loop (where the engine's streams live); its result."""
    return asyncio.run_coroutine_threadsafe(coro, server.engine._loop).result(120)


@pytest.mark.parametrize("beam_width", [1, 3, 6])
def test_the_servers_search_finds_the_offline_hypotheses(server, llm, beam_width):
    """Token for token: each step's one-token requests, answered beside each other, score as the offline fork does."""
    kw = dict(beam_width=beam_width, max_tokens=10)
    for prompt in PROMPTS:
        ids = server.engine.inputs.tokenize(prompt, 0)
        out = on_server_loop(server, beam_search(server.engine, f"direct-{prompt}", ids, BeamSearchParams(**kw)))
        assert [(s.output_token_ids, s.finish_reason) for s in out.sequences] == offline_beams(llm, [prompt], **kw)[0]


def test_with_an_eos_the_beams_like_hypotheses_finish_early_as_offline(checkpoint_factory, llm):
    """An EOS the beams like (found with the EOS-less model: the weights do not depend on it), so
    some hypotheses stop early, EOS kept or not, and the length penalty decides between lengths."""
    from level6_helpers import ENGINE, serve

    from level6_serving import LLM

    prompts = [llm.llm_engine.inputs.tokenize(p, 0) for p in PROMPTS]
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=12))
    liked = collections.Counter(t for o in outs for s in o.sequences for t in s.output_token_ids[1:6])
    path = checkpoint_factory("llama", tokenizer=True, eos_token_id=liked.most_common(1)[0][0])
    offline, reasons = LLM(str(path), **ENGINE), collections.Counter()
    with serve(path, ENGINE) as srv:
        for width, lp, keep in ((2, 0.0, False), (4, 1.0, True), (4, 2.0, False)):
            kw = dict(beam_width=width, max_tokens=12, length_penalty=lp, include_stop_str_in_output=keep)
            want = offline_beams(offline, prompts, **kw)
            for i, ids in enumerate(prompts):
                out = on_server_loop(srv, beam_search(srv.engine, f"eos-{width}-{lp}-{i}", ids, BeamSearchParams(**kw)))
                assert [(s.output_token_ids, s.finish_reason) for s in out.sequences] == want[i]
            reasons.update(reason for beams in want for _, reason in beams)
    assert reasons["stop"] > 0 and reasons["length"] > 0  # both kinds of end were compared


def test_completions_with_use_beam_search(server, llm):
    W, n = 3, 10
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": NAME, "prompt": PROMPTS, "max_tokens": n, "n": W, "use_beam_search": True,
        "temperature": 0.7})  # fmt: skip
    assert r.status_code == 200, r.text
    body, tok = r.json(), llm.get_tokenizer()
    want = offline_beams(llm, PROMPTS, beam_width=W, max_tokens=n)
    want_choices = [(tok.decode(ids), reason) for beams in want for ids, reason in beams]
    assert [(c["text"], c["finish_reason"]) for c in body["choices"]] == want_choices
    assert [c["index"] for c in body["choices"]] == list(range(len(PROMPTS) * W))
    assert body["usage"]["completion_tokens"] == sum(len(ids) for beams in want for ids, _ in beams)
    assert body["usage"]["prompt_tokens"] == sum(len(server.engine.inputs.tokenize(p, 0)) for p in PROMPTS)
    assert server.engine.num_unfinished == 0, "every step's requests finished with the response"


def test_chat_with_use_beam_search(server, llm):
    messages = [{"role": "user", "content": "Speak of the king"}]
    r = server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, n=2,
                                              extra_body={"use_beam_search": True, "ignore_eos": True})  # fmt: skip
    ids = llm.llm_engine.inputs.apply_chat_template(messages)
    want = offline_beams(llm, [ids], beam_width=2, max_tokens=8, ignore_eos=True)[0]
    tok = llm.get_tokenizer()
    assert [(c.message.content, c.finish_reason) for c in r.choices] == [(tok.decode(i), f) for i, f in want]
    assert all(reason == "length" for _, reason in want)  # ignore_eos reached the search


def test_the_request_fields_become_the_searchs_params():
    req = CompletionRequest(prompt="x", n=3, use_beam_search=True, length_penalty=0.5, ignore_eos=True,
                            include_stop_str_in_output=True, temperature=0.7)  # fmt: skip
    assert req.beam_search_params(7) == BeamSearchParams(beam_width=3, max_tokens=7, ignore_eos=True,
                                                         length_penalty=0.5, include_stop_str_in_output=True)  # fmt: skip
    assert CompletionRequest(prompt="x", use_beam_search=True).beam_search_params(16) == BeamSearchParams(1, 16)


@pytest.mark.parametrize("extra, field", [
    ({"stream": True}, "stream"), ({"logprobs": 2}, "logprobs"), ({"stop": ["\n"]}, "stop"),
    ({"top_p": 0.5}, "top_p"), ({"n": 11}, "n"), ({"echo": True}, "echo"),
    ({"guided_choice": ["a", "b"]}, "guided_choice"), ({"length_penalty": "x"}, "length_penalty"),
])  # fmt: skip
def test_what_a_search_cannot_honour_is_a_400_naming_it(server, extra, field):
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": NAME, "prompt": "Hi", "max_tokens": 4, "use_beam_search": True, **extra})  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text


def test_a_cancelled_search_leaves_no_request_behind(server):
    engine = server.engine
    ids = engine.inputs.tokenize("Now is the winter", 0)

    async def cancel_mid_search() -> int:  # on the server's event loop, where the engine's streams live
        params = BeamSearchParams(beam_width=4, max_tokens=200, ignore_eos=True)
        task = asyncio.ensure_future(beam_search(engine, "cancelled", ids, params))
        while engine.num_unfinished == 0 and not task.done():  # its first step reached the engine
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return engine.num_unfinished

    assert on_server_loop(server, cancel_mid_search()) == 0

    def in_engine() -> float:
        m = metrics(server.url)
        return value(m, "vllm:num_requests_running") + value(m, "vllm:num_requests_waiting")

    wait_for(lambda: in_engine() == 0, 60, "the engine to drop the aborted steps")


def test_a_step_aborted_from_outside_ends_the_search_with_an_error():
    """A drain that gives up, or an operator's abort, ends a step's request with no token: the search
    says so (the server answers 503), rather than choose from nothing."""
    from level6_serving import CompletionOutput, RequestOutput

    class AbortingEngine:  # what an abort that lands while the step is in flight looks like from here
        async def generate(self, prompt, params, request_id):
            yield RequestOutput(
                request_id, None, prompt, [CompletionOutput(0, "", [], None, None, "abort")], True, None
            )

    with pytest.raises(SearchAborted, match="aborted before it answered"):
        asyncio.run(next_token_logprobs(AbortingEngine(), "step-0", [1, 2, 3], 4))


class TableEngine:
    """A stand-in for the engine behind `beam_search`: the next token's log-probabilities after any
    context are a seeded random row over a small vocabulary (the EOS raised, so beams often rank it
    first), and, as the real engine does, a request with `logprobs=k` is told only the k best."""

    EOS, VOCAB = 0, 8
    max_model_len = 64

    def __init__(self, seed: int):
        self.seed, self.asked = seed, []
        self.inputs = SimpleNamespace(eos_token_ids=[self.EOS], vocab_size=self.VOCAB)

    def row(self, tokens: list[int]) -> torch.Tensor:  # [V] float64
        g = torch.Generator().manual_seed(zlib.crc32(repr((self.seed, tokens)).encode()))
        logits = 2 * torch.randn(self.VOCAB, generator=g, dtype=torch.float64)
        logits[self.EOS] += 1.5
        return logits.log_softmax(-1)

    async def generate(self, prompt, params, request_id):
        from level6_serving import CompletionOutput, Logprob, RequestOutput

        self.asked.append(params.logprobs)
        lps, toks = self.row(list(prompt)).topk(params.logprobs)
        entry = {t: Logprob(lp, rank + 1) for rank, (lp, t) in enumerate(zip(lps.tolist(), toks.tolist()))}
        out = CompletionOutput(0, "", [toks[0].item()], None, [entry], "length")
        yield RequestOutput(request_id, None, list(prompt), [out], True, None)

    async def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


def whole_rows_search(engine: TableEngine, prompt: list[int], params: BeamSearchParams) -> list[tuple]:
    """Level 3's rule fed every token's log-probability: what the server's search must find."""
    ids = itertools.count()
    search = Search(prompt, params, params.max_tokens, {engine.EOS}, lambda: next(ids))
    while not search.done:
        search.advance(torch.stack([engine.row(prompt + b.output_token_ids) for b in search.live]), SharedByHash())
    return [(s.output_token_ids, s.finish_reason, s.score) for s in search.finished]


@pytest.mark.parametrize("beam_width", [2, 3])
def test_each_beams_best_k_are_enough_to_choose_as_with_whole_rows(beam_width):
    """Over 40 seeded tables (the EOS among a beam's best W often, the (W+1)-th best child then needed),
    the search told each beam's best k next tokens picks the hypotheses the whole rows pick."""
    for seed in range(40):
        engine = TableEngine(seed)
        for lp in (0.0, 1.0):
            params = BeamSearchParams(beam_width=beam_width, max_tokens=6, length_penalty=lp)
            out = asyncio.run(beam_search(engine, f"table-{seed}", [1, 2], params))
            got = [(s.output_token_ids, s.finish_reason, s.score) for s in out.sequences]
            assert got == whole_rows_search(engine, [1, 2], params), (seed, lp)
    assert set(engine.asked) == {2 * beam_width}  # the k the docstring gives (2W with one EOS)
