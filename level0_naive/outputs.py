"""What a request is while it runs (`Sequence`) and what the caller gets back (`RequestOutput`).

What it is: plain data plus the stop rules every level shares: EOS, `stop_token_ids`,
`stop` strings (removed from the text unless asked to keep them), `max_tokens` and the
context length. The output types mirror vLLM's (`RequestOutput` holding one
`CompletionOutput` per sample, `n` of them), so code written against vLLM reads the same.

What it is not: a scheduler state machine. Level 0 only needs "running" and "finished";
level 2's `Request` adds WAITING / RUNNING / PREEMPTED on top of this class.

Reference: vllm/outputs.py, vllm/v1/engine/detokenizer.py (stop strings).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams, SamplingState


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival (queueing included, as a user feels it)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics


@dataclass
class Sequence:
    """One sample of one request: its tokens so far and the rules that end it."""

    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_len: int  # prompt + output never exceeds this (max_model_len)
    eos_token_ids: list[int]
    generator: torch.Generator | None
    metrics: RequestMetrics = None  # type: ignore[assignment]
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""  # detokenized output; kept current only when a stop string needs it

    def __post_init__(self):
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=time.perf_counter())
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    # --- sizes -------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, n: int) -> list[int]:
        """Tokens start .. start+n-1 of prompt + output, without building the whole list
        (a decode step needs one token; `all_token_ids` would copy them all)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : start - p + n]
        if start + n <= p:
            return self.prompt_token_ids[start : start + n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: start + n - p]

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this sequence can ever hold: prompt + max_tokens, capped."""
        want = self.max_len if self.params.max_tokens is None else len(self.prompt_token_ids) + self.params.max_tokens
        return min(want, self.max_len)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def sampling_state(self) -> SamplingState:
        return SamplingState(self.params, self.prompt_token_ids, self.output_token_ids, self.generator, self.eos_token_ids)

    # --- one new token -----------------------------------------------------
    def append_token(self, token: int, tokenizer, logprob: dict[int, Logprob] | None = None) -> None:
        """Add a sampled token and decide whether it ends the sequence."""
        self.output_token_ids.append(token)
        now = time.perf_counter()
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        if logprob is not None and self.logprobs is not None:
            self.logprobs.append(logprob)
            self.cumulative_logprob += logprob[token].logprob
        self._check_stop(token, tokenizer)
        if self.is_finished:
            self.metrics.finished_time = now

    def _check_stop(self, token: int, tokenizer) -> None:
        p, n_out = self.params, len(self.output_token_ids)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                self.finish_reason, self.stop_reason = "stop", None
                return
            if token in p.stop_token_ids:
                self.finish_reason, self.stop_reason = "stop", token
                return
            if p.stop and self._check_stop_strings(tokenizer):
                return
        if (p.max_tokens is not None and n_out >= p.max_tokens) or self.num_tokens >= self.max_len:
            self.finish_reason = "length"

    def _check_stop_strings(self, tokenizer) -> bool:
        # Decoding and searching the whole output each step is O(n^2) over a request;
        # fine for a reference (vLLM decodes incrementally). Searching everything, not
        # just the new tail, stays right when a byte-level tokenizer's partial UTF-8
        # ('\ufffd') turns into a real character and the text changes length.
        self.text = decode(tokenizer, self.output_token_ids, self.params.skip_special_tokens)
        for stop in self.params.stop:
            at = self.text.find(stop)
            if at != -1:
                end = at + len(stop) if self.params.include_stop_str_in_output else at
                self.text = self.text[:end]
                self.finish_reason, self.stop_reason = "stop", stop
                return True
        return False

    def finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.metrics.finished_time = time.perf_counter()

    def completion(self, tokenizer) -> CompletionOutput:
        if self.stop_reason is None or not isinstance(self.stop_reason, str):
            self.text = decode(tokenizer, self.output_token_ids, self.params.skip_special_tokens)
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.output_token_ids),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


def decode(tokenizer, token_ids: list[int], skip_special_tokens: bool = True) -> str:
    if tokenizer is None:
        return ""
    return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def group_outputs(seqs: list[Sequence], tokenizer) -> RequestOutput:
    """The n samples of one request -> one RequestOutput (metrics from the slowest sample)."""
    first = seqs[0]
    metrics = RequestMetrics(
        arrival_time=first.metrics.arrival_time,
        first_scheduled_time=min((s.metrics.first_scheduled_time for s in seqs if s.metrics.first_scheduled_time), default=None),
        first_token_time=min((s.metrics.first_token_time for s in seqs if s.metrics.first_token_time), default=None),
        finished_time=max((s.metrics.finished_time for s in seqs if s.metrics.finished_time), default=None),
    )
    return RequestOutput(
        request_id=first.request_id,
        prompt=first.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=[s.completion(tokenizer) for s in sorted(seqs, key=lambda s: s.index)],
        finished=all(s.is_finished for s in seqs),
        metrics=metrics,
    )
