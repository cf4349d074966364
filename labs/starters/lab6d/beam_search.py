# Lab 6d: your copy of level6_serving/beam_search.py.
# Fill in every function that raises NotImplementedError (search for TODO), then run
#     python -m labs check 6d THIS_FILE
# Made by `python -m labs starters` from the reference; everything else is the reference, unchanged.
"""Beam search behind the server: a loop of one-token requests that the prefix cache makes cheap.

What it is: `beam_search(engine, request_id, prompt, params)`, what `"use_beam_search": true`
runs on /v1/completions and /v1/chat/completions, as vLLM's front end does it
(`EngineClient.beam_search`). Offline, level 3 runs the search on an idle engine and forks each
beam's blocks (level3_prefix/beam_search.py); a server's engine is never idle, so here every
step sends each live beam to it as a request of its own, beside everything else it serves:

    step t:  prompt + beam A's tokens ─┐  max_tokens=1, the top k logprobs of the next token
             prompt + beam B's tokens ─┴> the engine (its prefix cache holds every full block of
                                          each: only the last, partial one is computed again)
             the answers' top k ──> level 3's rule (`Search.advance`, HF's) ──> the next beams

k is what that rule looks at per step (2W candidates with one EOS token, W = beam width = the
request's `n`): the best 2W of all (beam, token) pairs are among each beam's own best 2W, so
the choice is the offline one, made from the same log-probabilities.

What it is not: offline beam search in another costume. Each step is a round trip through the
engine's queue, and the blocks are shared by the prefix cache, by hash, not by forking (a beam's
partial last block is recomputed each step). The scores are the raw model log-probabilities,
as the engine reports them (`temperature` does not reshape them: vLLM's one-token requests
report raw log-probabilities too). Not streamed: the answer is known only when the search ends.

Reference: vLLM `vllm/engine/protocol.py` (`EngineClient.beam_search`) and
`vllm/entrypoints/openai/serving_completion.py` (`use_beam_search`).
"""

from __future__ import annotations

import asyncio
import itertools  # noqa: F401 (your code will need it)

import torch  # noqa: F401 (your code will need it)

from level3_prefix.beam_search import BeamSearchOutput, BeamSearchParams, Search  # noqa: F401 (your code will need it)

from .async_engine import AsyncLLMEngine
from .base import SamplingParams  # noqa: F401 (your code will need it)


class SearchAborted(RuntimeError):
    """A step's request was aborted from outside (a drain, an operator): the search cannot go on."""


class SharedByHash:
    """What `Search` asks of a KV cache, here nothing: the engine's prefix cache shares the blocks."""

    def fork(self, parent, child) -> None:
        pass

    def free(self, beam) -> None:
        pass


async def gather_or_cancel(coros) -> list:
    """Every result, in order; the first error cancels the others (aborting their requests) and is
    raised as it is, not in a group."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # their requests are aborted before we go on
        raise


async def next_token_logprobs(engine: AsyncLLMEngine, request_id: str, tokens: list[int], k: int) -> dict:
    """{token id: log-probability} of the k most likely next tokens after `tokens`, from one
    engine request (its one generated token is not used)."""
    # TODO (lab 6d): next_token_logprobs
    # One engine request for `tokens` that generates one token and reports the k most likely next tokens:
    # SamplingParams(max_tokens=1, temperature=0.0, logprobs=k, ignore_eos=True), sent with
    # `engine.generate(tokens, params, request_id)` (an async generator of RequestOutputs: read it to its end, as
    # leaving it early aborts the request). The answer is the first logprobs entry of its outputs' completions
    # ({token id: Logprob}): return {token id: its .logprob}. No logprobs entry at all means the request was aborted
    # before it answered: raise SearchAborted.
    raise NotImplementedError("lab 6d: write next_token_logprobs")


async def beam_search(engine: AsyncLLMEngine, request_id: str, prompt: list[int],
                      params: BeamSearchParams) -> BeamSearchOutput:  # fmt: skip
    """The search for one tokenized prompt on a running engine: the hypotheses best first, each `text`
    its output's (offline, `text` is the prompt's and the output's). Cancelling it aborts the step's
    requests."""
    # TODO (lab 6d): beam_search
    # The EOS tokens are engine.inputs.eos_token_ids (none with params.ignore_eos). Make a level-3 Search(prompt,
    # params, max_tokens, eos, new_id): max_tokens no more than engine.max_model_len - len(prompt) allows, new_id
    # a counter. Each step, for every live beam (search.live) at once: next_token_logprobs of prompt + the beam's
    # output_token_ids, each request with an id of its own (f"{request_id}-{step}-{j}"), all through
    # gather_or_cancel (cancelling the search must abort them). k is as many per beam as Search.advance looks at
    # in all (read it). Put the answers in a float64 [live beams, engine.inputs.vocab_size] tensor of -inf and call
    # search.advance(logprobs, SharedByHash()); stop when search.done. Each finished hypothesis's text is
    # `await engine.decode(its output_token_ids)`; return BeamSearchOutput(search.finished).
    raise NotImplementedError("lab 6d: write beam_search")
