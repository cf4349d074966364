"""The parameters a vLLM user passes with each request: `SamplingParams`, and the kind of output it wants.

What it is: `SamplingParams` with vLLM's field names, defaults and validation (a
`ValueError` that names the field, raised when the object is made), and
`RequestOutputKind` (cumulative, delta, final only: what level 2's `LLMEngine.step()` returns).

What it is not: the sampling: the logits processors (penalties, min-tokens) are in `logits_processors.py`,
temperature, top-k, top-p, min-p and the draw in `sampler.py`, the stop rules in `stop_checker.py`.

Reference: vLLM `vllm/sampling_params.py`; the OpenAI API for presence/frequency penalties.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ladder import rooms


class RequestOutputKind(enum.Enum):
    """What an output reports of a request that moved (vLLM's names)."""

    CUMULATIVE = 0  # everything so far, every step
    DELTA = 1  # only what is new since the last output (streaming)
    FINAL_ONLY = 2  # nothing until the request finishes


# Below this, logits / temperature overflows float32 (1e-38 gives inf, then NaN probabilities, and one
# request's NaN would fail the whole batch's draw). vLLM clamps to the same floor (its _MAX_TEMP).
MIN_TEMPERATURE = 1e-2
MIN_REPETITION_PENALTY = 1e-2  # logits / 1e-40 overflows the same way


@dataclass
class SamplingParams:
    n: int = 1  # independent samples per prompt
    max_tokens: int | None = 16  # None: until the context is full
    min_tokens: int = 0  # EOS and stop_token_ids are suppressed before this many tokens
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # OpenAI: -= p for every token already generated
    frequency_penalty: float = 0.0  # OpenAI: -= p * count of the token in the output
    repetition_penalty: float = 1.0  # HF/CTRL: over prompt + output, > 1 discourages
    logprobs: int | None = None  # top-N logprobs per generated token (plus the chosen one)
    prompt_logprobs: int | None = None  # top-N per prompt token (and the prompt's own); -1: all of them
    structured_outputs: object | None = None  # a StructuredOutputsParams: a room's (ladder/rooms.py), the output's shape
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's: anything a room or a plugin reads from the request (a KV connector's kv_transfer_params);
    # the sampler never looks
    extra_args: dict | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.temperature, (int, float)) and 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE  # as sharp as float32 allows: practically greedy, never NaN
        checks = [
            ("n", isinstance(self.n, int) and self.n >= 1, "must be an integer >= 1"),
            (
                "max_tokens",
                self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
                "must be an integer >= 1 (or None)",
            ),
            ("min_tokens", isinstance(self.min_tokens, int) and self.min_tokens >= 0, "must be an integer >= 0"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens, "must be <= max_tokens"),
            ("temperature", self.temperature >= 0, "must be >= 0 (0 means greedy)"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "must be 0 or -1 (off) or a positive integer"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            (
                "repetition_penalty",
                self.repetition_penalty >= MIN_REPETITION_PENALTY,
                f"must be >= {MIN_REPETITION_PENALTY} (smaller overflows float32)",
            ),
            (
                "logprobs",
                self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
                "must be an integer >= 0 (or None)",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and self.prompt_logprobs >= -1),
                "must be an integer >= 0, or -1 for the whole vocabulary (or None)",
            ),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            (
                "stop_token_ids",
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "must be non-negative integers",  # and < the vocabulary: checked when the request is added
            ),
            (
                "seed",
                self.seed is None or (isinstance(self.seed, int) and -(2**63) <= self.seed < 2**63),
                "must be an integer in [-2**63, 2**63) (or None)",  # what a torch.Generator takes, with room for n
            ),
            ("output_kind", isinstance(self.output_kind, RequestOutputKind), "must be a RequestOutputKind"),
            (
                "structured_outputs",
                self.structured_outputs is None
                or isinstance(self.structured_outputs, rooms.export("StructuredOutputsParams")),
                "must be a StructuredOutputsParams (or None)",
            ),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} {why}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
