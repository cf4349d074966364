# Lab 0c: your copy of level0_naive/sampling.py.
# Fill in every function that raises NotImplementedError (search for TODO), then run
#     python -m labs check 0c THIS_FILE
# Made by `python -m labs starters` from the reference; everything else is the reference, unchanged.
"""Sampling: the parameters a vLLM user passes, what a row of logits knows, and the maths.

What it is: `SamplingParams` with vLLM's field names and validation (a `ValueError`
that names the field); `SamplingState`, one row's params and history; and the pure
functions the sampler (`sampler.py`) is made of: penalties (OpenAI's presence and
frequency, HF's repetition), the top-k / top-p / min-p filter, and the logprobs that
outputs report.

What it is not: the sampler. `sampler.Sampler` turns logits into tokens through a chain
of logits processors; this file only defines what they compute.

Reference: vLLM `SamplingParams` (vllm/sampling_params.py) and `v1/sample/`; the OpenAI
API for presence/frequency penalties; Hugging Face's `RepetitionPenaltyLogitsProcessor`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .structured import Grammar, StructuredOutputsParams


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step()` returns for a request that moved (vLLM's names)."""

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
    structured_outputs: StructuredOutputsParams | None = None  # a JSON schema, regex, choice, grammar (structured.py)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

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
                self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
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


@dataclass
class SamplingState:
    """What the sampler needs to know about one row: its params and its history."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None  # None only for greedy rows
    eos_token_ids: list[int] = field(default_factory=list)
    grammar: Grammar | None = None  # structured outputs: the state after the accepted output tokens


def apply_penalties(logits: torch.Tensor, st: SamplingState) -> torch.Tensor:
    """logits [V] -> penalised logits [V], as OpenAI (presence/frequency) and HF (repetition) define them."""
    # TODO (lab 0c): apply_penalties
    # logits [V] of one row, st.params its settings. Repetition (p.repetition_penalty != 1, Hugging Face's): every
    # token in st.prompt_token_ids + st.output_token_ids, seen once or more, has its logit divided by the penalty
    # if it is positive and multiplied by it otherwise. Then presence and frequency (OpenAI's, output tokens only):
    # subtract p.frequency_penalty x (times the token was generated) + p.presence_penalty x (1 if it was at all).
    # Return a new tensor; leave `logits` as it was.
    raise NotImplementedError("lab 0c: write apply_penalties")


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """logits [V] (already divided by temperature) -> logits [V] with disallowed tokens at -inf.

    Applied in HF's and vLLM's order: keep the k most likely (top_k > 0); then, of what
    is left, the smallest set of most likely tokens whose renormalised probability
    reaches top_p (the token that crosses the line is kept); then drop tokens below
    min_p times the top probability (a ratio, so renormalising does not change it).
    """
    # TODO (lab 0c): filter_logits
    # One row, already divided by the temperature; disallowed tokens become -inf, in this order. top_k (0: off):
    # keep the tokens at least as large as the k-th largest. top_p (1: off), over the probabilities of what top-k
    # left: sort them best first (stable), keep each token whose better tokens' mass is still under top_p (the
    # token that crosses the line is kept). min_p (0: off): keep the tokens whose probability is at least min_p x
    # the top probability. The most likely token always survives.
    raise NotImplementedError("lab 0c: write filter_logits")


def filter_logits_batch(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """`filter_logits` for every row at once, each with its own settings.

    logits [B, V] (already divided by each row's temperature); top_k [B] long (0: off);
    top_p [B], min_p [B] in logits' dtype -> logits [B, V] with disallowed tokens at -inf.
    Row i's result equals ``filter_logits(logits[i], top_k[i], top_p[i], min_p[i])``
    (tests/test_sampling.py): a per-row k becomes a per-row threshold read from one sort,
    and a row whose setting is off keeps every token, as its twin would.
    """
    # TODO (lab 0c): filter_logits_batch
    # filter_logits for every row of logits [B, V] at once, row i with top_k[i], top_p[i], min_p[i] (tensors [B]),
    # and bit for bit what filter_logits gives row i: no Python loop over rows. top_k: a row's k-th largest is one
    # gather from one descending sort (k of 0 or >= V: keep everything). top_p: one stable sort, a cumulative sum
    # per row, top_p as a column; a row whose top_p is 1 keeps everything. min_p: against each row's own max.
    raise NotImplementedError("lab 0c: write filter_logits_batch")


def _splitmix64(x: int) -> int:
    """Steele et al.'s 64-bit mixer: nearby inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return x ^ (x >> 31)


def keyed_gumbel(seed: int, position: int, vocab_size: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Gumbel noise [V] that is a function of (seed, position) alone.

    argmax(log p + noise) is an exact sample from p (the Gumbel-max trick: the argmax of
    log p_i + G_i, G_i independent Gumbel(0, 1), is i with probability p_i). Keyed by the
    token's position instead of drawn from a generator whose state advances with every
    draw, the sample at a position does not depend on how many draws were made before it,
    or whether some were thrown away and made again. `batch_invariant=True` draws this way
    (sampler.py); the default draws from the request's generator, as vLLM does.

    The key: (seed, position) mixed by splitmix64 and folded to the 32 bits PyTorch's CPU
    generator keeps (two positions share noise with probability about 2**-32).
    """
    key = _splitmix64((seed % 2**64) ^ _splitmix64(position))
    u = torch.rand(
        vocab_size, generator=torch.Generator().manual_seed((key ^ key >> 32) & 0xFFFFFFFF), dtype=torch.float64
    )  # [V]
    return (-torch.log(-torch.log(u))).to(dtype=dtype, device=device)  # u = 0 gives -inf: never the argmax


def top_logprobs(
    logits: torch.Tensor, chosen: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of the raw model distribution (before penalties/temperature, as vLLM V1 reports).

    logits [B, V], chosen [B] -> (chosen_logprob [B], chosen_rank [B], top_ids [B, n], top_logprobs [B, n]).
    Rank 1 is the most likely token.
    """
    logp = torch.log_softmax(logits, dim=-1)  # [B, V], float32 or wider (compute_logits sees to it)
    chosen_lp = logp.gather(1, chosen[:, None])[:, 0]  # [B]
    rank = (logp > chosen_lp[:, None]).sum(-1) + 1  # [B]
    top = logp.topk(min(n, logp.shape[-1]), dim=-1) if n else None
    if top is None:
        empty = torch.empty(logits.shape[0], 0)
        return chosen_lp, rank, empty.long(), empty
    return chosen_lp, rank, top.indices, top.values
