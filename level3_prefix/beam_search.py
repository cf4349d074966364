"""Beam search on the paged cache: beams share their parent's blocks, and copy only the last one on write.

What it is: vLLM's `BeamSearchParams`, `BeamSearchSequence`, `BeamSearchOutput` and the loop
behind `LLM.beam_search(prompts, params)` (level 3's `engine.py`). Every step runs each live
beam's newest token through the model, scores every (beam, next token) pair, keeps the best
`beam_width` as the next beams, and gives each child its parent's blocks by reference count
(`PrefixCachingKVCacheManager.fork`, copy_on_write.py). A parent with two children is two
references to the same blocks; when a child then writes into the shared, partial last block,
the manager copies that one block first (copy-on-write) and the worker makes the copy in the step:

    step t:  beam A [ b0 | b1 | b2 (5/8) ]   beam B [ b0 | b1 | b3 (5/8) ]     b0, b1 ref 2
    best children: A+x, A+y (B dies)
    fork:    A+x [ b0 | b1 | b2 ]  A+y [ b0 | b1 | b2 ]   b2 ref 2, B's b3 freed
    step t+1 writes position 21: A+x copies b2 -> b3, A+y keeps b2; the prompt's blocks stay shared

The rule, each step, for one prompt with W = beam_width (Hugging Face's, `generate(num_beams=W,
do_sample=False)`, which the tests compare with token for token):
  - every candidate's score is its beam's cumulative log-probability plus the token's
    (log-softmax of the logits, of logits / temperature when temperature > 0);
  - of all beams x vocabulary, the 2W best are taken in order; one that ends in EOS (unless
    `ignore_eos`) is a finished hypothesis if it is among the first W, scored
    cum_logprob / len(output) ** length_penalty (its EOS counted); the others fill the W next beams;
  - at `max_tokens` the best W candidates finish the same way;
  - the search stops once W hypotheses are finished and the best live beam, scored as if it
    ended now, is not better than the worst of them (HF's `early_stopping=False`);
  - the answer: the W best finished hypotheses, best first.
vLLM's `LLM.beam_search` differs in two ways (docs/beam_search.md): it divides by the whole
length (prompt included, EOS not) and it keeps every EOS candidate, not the first W; it never
stops early. Without EOS and with equal lengths the three agree.

What it is not: sampling (`temperature` only reshapes the scores), online (level 6 serves it), or a
scheduler: the search runs its own loop on an idle engine, batching all live beams of all
admitted prompts in one forward; prompts are admitted while their worst case (W beams of
full length, nothing shared) fits the KV cache. Beams' blocks are not named for the prefix
cache (a later request does not hit them); a prompt's prefix already cached is used.

Reference: Kwon et al., SOSP 2023, section 4.4 (beam search, copy-on-write); vLLM
`vllm/beam_search.py` and `LLM.beam_search`; HF `GenerationMixin._beam_search`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from level0_naive.sampling_params import SamplingParams
from level1_paged.block_table import blocks_for
from level1_paged.model_input import ModelInput

from .copy_on_write import CopyOnWriteInput

_PARAMS = SamplingParams()  # what the KV manager reads of a sequence's parameters (no prompt logprobs)


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # > 0: scores are log-softmax(logits / temperature)
    length_penalty: float = 1.0  # finished score = cum_logprob / len(output) ** length_penalty
    include_stop_str_in_output: bool = False  # keep the EOS token in `tokens` and `text`

    def __post_init__(self):
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"BeamSearchParams.beam_width must be an int >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"BeamSearchParams.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"BeamSearchParams.temperature must be >= 0, got {self.temperature!r}")


@dataclass
class BeamSearchSequence:
    """One hypothesis: `tokens` is prompt + output (vLLM's convention), `logprobs` one float per output token."""

    tokens: list[int]
    logprobs: list[float]
    cum_logprob: float
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    score: float = 0.0  # what the hypotheses were ranked by
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


@dataclass
class Beam:
    """A live beam: what the KV manager needs of a sequence (its id, tokens, how many are cached)."""

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    params: ClassVar[SamplingParams] = _PARAMS  # the same for every beam

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, n: int) -> list[int]:
        return (self.prompt_token_ids + self.output_token_ids)[start : start + n]


class Search:
    """The beams and finished hypotheses of one prompt."""

    def __init__(self, prompt: list[int], params: BeamSearchParams, max_tokens: int, eos: set[int], new_id):
        self.prompt, self.params, self.max_tokens, self.eos = prompt, params, max_tokens, eos
        self.new_id = new_id
        self.live = [Beam(new_id(), prompt)]
        self.finished: list[BeamSearchSequence] = []
        self.done = False

    def worst_case_blocks(self, block_size: int) -> int:
        return self.params.beam_width * blocks_for(len(self.prompt) + self.max_tokens, block_size)

    def _score(self, cum: float, length: int) -> float:
        return cum / length**self.params.length_penalty

    def _finish(self, parent: Beam, token: int, lp: float, cum: float, reason: str) -> None:
        keep = reason == "length" or self.params.include_stop_str_in_output
        out = parent.output_token_ids + [token]  # the EOS counts in the length, as in HF
        seq = BeamSearchSequence(
            self.prompt + (out if keep else out[:-1]), parent.logprobs + [lp], cum,
            finish_reason=reason, score=self._score(cum, len(out)), num_prompt_tokens=len(self.prompt),
        )  # fmt: skip
        self.finished = sorted(self.finished + [seq], key=lambda s: -s.score)[: self.params.beam_width]

    def advance(self, logprobs: torch.Tensor, kv) -> None:
        """logprobs [len(live), V]: pick the next beams, fork them from their parents, free the rest."""
        W, V = self.params.beam_width, logprobs.shape[-1]
        cum = torch.tensor([b.cum_logprob for b in self.live], dtype=logprobs.dtype, device=logprobs.device)
        scores = (cum[:, None] + logprobs).flatten()  # [len(live) * V]
        k = min(max(2, 1 + len(self.eos)) * W, scores.numel())  # HF keeps enough for W beams past the EOS ones
        top, idx = scores.topk(k)
        lps = logprobs.flatten()[idx].tolist()  # each candidate's own logprob: one copy to the host, not one each
        improvable = len(self.finished) < W or self._best_live_score() > self.finished[-1].score
        last = len(self.live[0].output_token_ids) + 1 >= self.max_tokens
        children: list[tuple[Beam, int, float, float]] = []
        for rank, (score, i, lp) in enumerate(zip(top.tolist(), idx.tolist(), lps)):
            parent, token = self.live[i // V], i % V
            is_eos = token in self.eos  # (empty with ignore_eos)
            if is_eos or last:
                if rank < W and improvable:
                    self._finish(parent, token, lp, score, "stop" if is_eos else "length")
            elif len(children) < W:
                children.append((parent, token, lp, score))
        new_live = []
        for parent, token, lp, score in children:
            child = Beam(self.new_id(), self.prompt, parent.output_token_ids + [token], parent.logprobs + [lp], score,
                         parent.num_tokens, list(parent.block_hashes))  # fmt: skip
            kv.fork(parent, child)  # the parent's blocks, ref +1 each; nothing copied yet
            new_live.append(child)
        for parent in self.live:
            kv.free(parent)  # a parent no child chose gives its blocks back (those no one else holds)
        self.live = new_live  # (none after the last step: every candidate finished or was dropped)
        if not self.live or (len(self.finished) == W and self._best_live_score() <= self.finished[-1].score):
            self.stop(kv)

    def _best_live_score(self) -> float:
        best = max(self.live, key=lambda b: b.cum_logprob)
        return self._score(best.cum_logprob, max(1, len(best.output_token_ids)))

    def stop(self, kv) -> None:
        for beam in self.live:
            kv.free(beam)
        self.live, self.done = [], True


def beam_search(engine, prompts: list, params: BeamSearchParams, on_step=None) -> list[BeamSearchOutput]:
    """The search for every prompt (a string or token ids) on `engine` (level 3 or above, idle).
    `on_step(beams)`, if given, sees the live beams after each step's blocks are allocated
    (benchmarks/beam_memory.py counts the blocks they share)."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    if engine.has_unfinished_requests():
        raise RuntimeError(
            "beam_search() needs an idle engine: finish or abort the requests added with add_request first"
        )
    inputs, kv, bs = engine.inputs, engine.kv, engine.config.cache.block_size
    eos = set() if params.ignore_eos else set(inputs.eos_token_ids)
    ids = iter(range(-1, -(2**62), -1))  # beams' seq ids: negative, never a request's

    def new_id() -> int:
        return next(ids)

    searches = []
    for i, prompt in enumerate(prompts):
        tokens = inputs.tokenize(prompt, i)
        s = Search(tokens, params, min(params.max_tokens, inputs.max_model_len - len(tokens)), eos, new_id)
        if s.worst_case_blocks(bs) > engine.num_blocks:
            raise ValueError(
                f"prompt {i}: beam_width={params.beam_width} beams of up to {len(tokens) + s.max_tokens} tokens "
                f"need up to {s.worst_case_blocks(bs)} KV blocks unshared; the cache has {engine.num_blocks}"
            )
        searches.append(s)
    waiting, active = list(searches), []
    try:
        while waiting or active:
            reserved = sum(s.worst_case_blocks(bs) for s in active)  # admit while the worst case still fits
            while waiting and reserved + waiting[0].worst_case_blocks(bs) <= engine.num_blocks:
                reserved += waiting[0].worst_case_blocks(bs)
                active.append(waiting.pop(0))
            beams = [b for s in active for b in s.live]
            for b in beams:
                if b.num_computed_tokens == 0:  # a prompt's first step: its cached prefix, if any
                    hits, n = kv.get_computed_blocks(b)
                    b.num_computed_tokens = n
                    ok = kv.allocate_slots(b, b.num_tokens - n, hits)
                else:  # a child: one new token, into its own copy of a shared last block
                    ok = kv.allocate_slots(b, b.num_tokens - b.num_computed_tokens)
                assert ok, "admission reserved the worst case, so a beam always finds its blocks"
            if on_step is not None:
                on_step(beams)
            chunks = [(b.token_slice(b.num_computed_tokens, b.num_tokens), b.num_computed_tokens) for b in beams]
            tables = [kv.block_table(b) for b in beams]
            mi = CopyOnWriteInput.with_copies(ModelInput.build(chunks, tables, bs, [1] * len(beams)), kv.take_block_copies())
            engine.bind_connector()  # a KV connector's loads (a prefix from its tier) and saves, first
            if engine.lora is not None:
                engine.lora.clear()  # the search runs the base model: no adapter row (not the last step's mapping)
            logits = engine.worker.execute(mi)  # [B, V]
            for b in beams:
                b.num_computed_tokens = b.num_tokens
                kv.record_fill(b)  # how full its blocks are (for usage); no block is named
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            if params.temperature > 0:
                logits = logits / params.temperature
            logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]
            row = 0
            for s in active:
                n = len(s.live)
                s.advance(logprobs[row : row + n], kv)
                row += n
            active = [s for s in active if not s.done]
    finally:  # an error or an interrupt mid-search: the live beams give their blocks back (ids are reused)
        if waiting or active:
            for s in searches:
                s.stop(kv)
            kv.take_block_copies()
    tok = inputs.tokenizer
    for s in searches:
        for seq in s.finished:
            seq.text = tok.decode(seq.tokens) if tok is not None else None
    return [BeamSearchOutput(s.finished) for s in searches]
