"""What a request is while it runs (`Sequence`), and what the caller gets back (`RequestOutput`).

What it is: plain data; `Sequence.append_token`, where a sampled token joins its sample (then
`stop_checker.py`'s stop rules apply); and the `OutputProcessor`, which turns sequences into
outputs of the kind each request asked for (`RequestOutputKind`: cumulative, delta, final
only). Text comes from each sequence's `IncrementalDetokenizer`, so a step decodes only new
tokens, and a streaming output holds back what may yet be part of a stop string. A sequence
may carry a constraint on its tokens (`Constraint`: a room's, set when the request is
prepared; structured outputs through ladder/rooms.py). The output types mirror vLLM's (a
`RequestOutput` holds one `CompletionOutput` per sample), so code written against vLLM reads the same.

What it is not: a state machine. Level 0 only needs "running" and "finished" (level 2's
`Request` adds WAITING / RUNNING / PREEMPTED on top of this class).

Reference: vllm/outputs.py, vllm/v1/engine/output_processor.py and detokenizer.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .detokenizer import IncrementalDetokenizer, stop_holdback
from .logits_processors import SamplingState
from .sampling_params import RequestOutputKind, SamplingParams
from .stop_checker import check_stop, cut_at_stop


class Constraint(Protocol):
    """What a room may require of a sample's tokens (ladder/rooms.py); level 0 only asks two things."""

    def accept(self, token: int) -> bool:
        """Take one more token; False if the constraint forbids it (the sampler's mask should have)."""
        ...

    def is_terminated(self) -> bool:
        """The output is complete: the sample stops."""
        ...


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
    last_token_time: float | None = None
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
    # vLLM's: with SamplingParams(prompt_logprobs=k), one entry per prompt token, the first None (nothing
    # predicts it), each other {its own id: Logprob, and the k most likely}; a DELTA output has them once
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


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
    tokenizer: object | None = None  # for text and stop strings; None: token ids only
    metrics: RequestMetrics = None  # type: ignore[assignment]
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # filled as the prompt's logits come in
    constraint: Constraint | None = None  # accepts every appended token (a room's: ladder/rooms.py)
    lora_request: object | None = None  # the adapter it runs with (a room's LoRARequest), or None: the base model
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # what the OutputProcessor has already handed out (delta outputs send only the rest)
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    sent_prompt_logprobs: bool = False
    clock: Callable[[], float] = time.perf_counter  # the engine's clock: what its metrics' times are read from

    def __post_init__(self):
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=self.clock())
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # token 0: nothing before it predicts it
        self.detok = (
            None
            if self.tokenizer is None
            else IncrementalDetokenizer(self.tokenizer, self.output_token_ids, self.params.skip_special_tokens)
        )

    # --- sizes -------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, n: int) -> list[int]:
        """Tokens start .. start+n-1 of prompt + output, without copying them all (`all_token_ids` does)."""
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

    @property
    def text(self) -> str:
        """The output text decoded so far (complete characters; cut at a stop string)."""
        return self.detok.text if self.detok is not None else ""

    # --- prompt logprobs -----------------------------------------------------
    def prompt_logprob_rows(self, start: int, n: int) -> int:
        """Of a forward over positions start .. start + n - 1, how many rows (its last ones, before any
        sampling row) give prompt logprobs still missing: the logits at position p predict prompt token p + 1.

            prompt  t0 t1 t2 t3 t4 | (output)        recorded: t0 (None), t1
            forward    [t1 t2 t3]                    rows for t2, t3 -> positions 1, 2: 2 rows
        """
        if self.prompt_logprobs is None:
            return 0
        first, end = max(start, len(self.prompt_logprobs) - 1), min(start + n, len(self.prompt_token_ids) - 1)
        return max(0, end - first)

    def record_prompt_logprobs(self, logits: torch.Tensor, tokenizer) -> None:
        """logits [r, V]: the rows `prompt_logprob_rows` counted, in position order."""
        r = len(self.prompt_logprobs)  # the next prompt token to record
        targets = torch.tensor(self.prompt_token_ids[r : r + logits.shape[0]], device=logits.device)  # [r]
        k = self.params.prompt_logprobs
        self.prompt_logprobs += logprob_entries(logits, targets, [k if k >= 0 else logits.shape[-1]] * len(targets),
                                                tokenizer)  # fmt: skip

    def sampling_state(self) -> SamplingState:
        return SamplingState(
            self.params, self.prompt_token_ids, self.output_token_ids, self.generator, self.eos_token_ids, self.constraint
        )

    # --- one new token -----------------------------------------------------
    def append_token(self, token: int, logprob: dict[int, Logprob] | None = None) -> None:
        """Add a sampled token and decide whether it ends the sequence."""
        self.output_token_ids.append(token)
        now = self.clock()
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.last_token_time = now
        if logprob is not None and self.logprobs is not None:
            self.logprobs.append(logprob)
            self.cumulative_logprob += logprob[token].logprob
        if self.constraint is not None and not self.constraint.accept(token):
            raise RuntimeError(f"token {token} was sampled where the constraint forbids it (a bug: the mask let it through)")
        check_stop(self, token)
        if self.is_finished:
            self._end()

    def finish(self, reason: str) -> None:
        """End it from outside (an abort); a stop rule ends it from `append_token`."""
        self.finish_reason = reason
        self._end()

    def _end(self) -> None:
        self.metrics.finished_time = self.clock()
        if self.detok is not None and not isinstance(self.stop_reason, str):
            checked = len(self.detok.text)
            if self.detok.finish() and self.params.stop:  # bytes held back for an incomplete character
                cut_at_stop(self, checked)  # come out now; a stop string may end in them

    def visible_text(self) -> str:
        """The text an output may show now: all once finished; while running, less what may yet be a
        stop string cut from the output (`stop_holdback`)."""
        if self.detok is None:
            return ""
        self.detok.update()  # catch up: each token is decoded once, whenever this is asked
        hold = 0 if self.is_finished else stop_holdback(self.params.stop, self.params.include_stop_str_in_output)
        return self.detok.text[: len(self.detok.text) - hold] if hold else self.detok.text

    def completion(self, delta: bool = False) -> CompletionOutput:
        """This sample's output: everything so far, or (delta) what was not handed out yet."""
        text, tokens, logprobs = self.visible_text(), self.output_token_ids, self.logprobs
        if delta:
            t0, c0 = self.num_sent_tokens, self.num_sent_chars
            self.num_sent_tokens, self.num_sent_chars = len(tokens), max(len(text), c0)
            text, tokens, logprobs = text[c0:], tokens[t0:], None if logprobs is None else logprobs[t0:]
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=list(tokens),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=None if logprobs is None else list(logprobs),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


def top_logprobs(
    logits: torch.Tensor, chosen: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of the raw model distribution (before penalties/temperature, as vLLM V1 reports).

    logits [B, V], chosen [B] -> (chosen_logprob [B], chosen_rank [B], top_ids [B, n], top_logprobs [B, n]);
    rank 1 is the most likely token."""
    logp = torch.log_softmax(logits, dim=-1)  # [B, V], float32 or wider (compute_logits sees to it)
    chosen_lp = logp.gather(1, chosen[:, None])[:, 0]  # [B]
    rank = (logp > chosen_lp[:, None]).sum(-1) + 1  # [B]
    top = logp.topk(min(n, logp.shape[-1]), dim=-1) if n else None
    if top is None:
        empty = torch.empty(logits.shape[0], 0, device=logits.device)
        return chosen_lp, rank, empty.long(), empty
    return chosen_lp, rank, top.indices, top.values


def logprob_entries(
    logits: torch.Tensor, tokens: torch.Tensor, wanted: list[int | None], tokenizer
) -> list[dict[int, Logprob] | None]:
    """The logprobs entry of each row's token (None where `wanted[i]` is None): its logprob and
    rank, and the `wanted[i]` most likely alternatives, decoded for reading. `wanted` is each
    row's `SamplingParams.logprobs` for sampled tokens, its `prompt_logprobs` for prompt tokens."""
    want = [n for n in wanted if n is not None]
    if not want:
        return [None] * len(wanted)
    # One copy to the host per tensor (a sync each on a GPU), not one per row and value.
    chosen_lp, rank, top_ids, top_vals = top_logprobs(logits, tokens, max(want))
    chosen_lp, rank, top_ids, top_vals = chosen_lp.tolist(), rank.tolist(), top_ids.tolist(), top_vals.tolist()
    decode = (lambda t: None) if tokenizer is None else (lambda t: tokenizer.decode([t]))
    entries = []
    for i, (n, tok) in enumerate(zip(wanted, tokens.tolist())):
        if n is None:
            entries.append(None)
            continue
        entry = {t: Logprob(v, r + 1, decode(t)) for r, (t, v) in enumerate(zip(top_ids[i][:n], top_vals[i][:n]))}
        entry[tok] = Logprob(chosen_lp[i], rank[i], decode(tok))
        entries.append(entry)
    return entries


class OutputProcessor:
    """Sequences -> `RequestOutput`s of the kind each request asked for.

    One request is a group of `n` sequences (its samples). `make(group)` returns None for an
    unfinished FINAL_ONLY request; a DELTA request gets only the text, tokens and logprobs it
    has not had yet (concatenated, they are exactly the final cumulative output)."""

    def make(self, group: list[Sequence]) -> RequestOutput | None:
        kind = group[0].params.output_kind
        finished = all(s.is_finished for s in group)
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        completions = [s.completion(delta) for s in sorted(group, key=lambda s: s.index)]
        return self._output(group, completions, finished, delta)

    def final(self, group: list[Sequence]) -> RequestOutput:
        """The whole output of a finished request (what `LLM.generate` returns)."""
        return self._output(group, [s.completion() for s in sorted(group, key=lambda s: s.index)], True)

    @staticmethod
    def _prompt_logprobs(group: list[Sequence], delta: bool) -> list | None:
        """The prompt's logprobs once a sample has them all (each computes the same); a DELTA stream gets them once."""
        done = next((s for s in group if s.prompt_logprobs and len(s.prompt_logprobs) == len(s.prompt_token_ids)), None)
        if done is None or (delta and group[0].sent_prompt_logprobs):
            return None
        group[0].sent_prompt_logprobs = True
        return list(done.prompt_logprobs)

    @classmethod
    def _output(cls, group: list[Sequence], completions: list[CompletionOutput], finished: bool,
                delta: bool = False) -> RequestOutput:  # fmt: skip
        first = group[0]
        times = lambda name, pick: pick(
            (getattr(s.metrics, name) for s in group if getattr(s.metrics, name)), default=None
        )  # noqa: E731
        metrics = RequestMetrics(
            arrival_time=first.metrics.arrival_time,
            first_scheduled_time=times("first_scheduled_time", min),
            first_token_time=times("first_token_time", min),
            last_token_time=times("last_token_time", max),
            finished_time=times("finished_time", max) if finished else None,
        )
        return RequestOutput(first.request_id, first.prompt, first.prompt_token_ids, completions, finished, metrics,
                             cls._prompt_logprobs(group, delta))  # fmt: skip
