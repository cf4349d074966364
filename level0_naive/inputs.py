"""Prompts in, validated sequences out: every check runs before any work starts.

What it is: `InputProcessor`, shared by `LLM.generate` and level 2's `LLMEngine.add_request`.
It tokenizes text prompts (or checks token ids against the vocabulary, as it does
`stop_token_ids`), refuses an empty prompt or one that leaves no room to generate, asks the
engine whether the request could ever fit its KV cache, gives each of the `n` samples its own
seeded generator, runs the engine's request preparers (a room's work for the requests that ask:
structured outputs compile their spec and give each sample its constraint; ladder/rooms.py), and
numbers with two counters: request ids ("0", "1", ... for `generate`) and sequence ids (one per
sample, what KV caches key on). Ids and seeds are handed out only once every prompt of a call
has passed every check, so a refused call changes nothing.

What it is not: a tokenizer (the checkpoint's own is used) or a batching policy.

Reference: vLLM `v1/engine/processor.py` (Processor.process_inputs).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch

from .outputs import Sequence
from .sampling_params import SamplingParams

Prompt = str | list[int]
RequestPreparer = Callable[[list[Sequence], int], None]  # (a checked request's samples, its index) -> None


class InputProcessor:
    def __init__(self, loaded, max_model_len: int, seed: int, device: torch.device, sequence_class: type[Sequence],
                 check_fits: Callable[[Sequence, int], None], clock: Callable[[], float] = time.perf_counter,
                 preparers: tuple[RequestPreparer, ...] = ()):  # fmt: skip
        self.tokenizer, self.vocab_size = loaded.tokenizer, loaded.config.vocab_size
        self.eos_token_ids, self.path = loaded.eos_token_ids, loaded.path
        self.max_model_len, self.device = max_model_len, device
        self.sequence_class, self.check_fits, self.clock = sequence_class, check_fits, clock
        self.preparers = tuple(preparers)  # each may raise ValueError for a request it cannot serve
        self.takes_lora = False  # an engine with the LoRA room says so (and adds its preparer)
        self._rng = torch.Generator().manual_seed(seed)  # seeds every unseeded sampling request
        self._request_ids = itertools.count()
        self._seq_ids = itertools.count()

    def make_requests(self, prompts, sampling_params, lora_request=None) -> list[list[Sequence]]:
        """Prompts -> one group of `n` sequences per prompt. Every prompt is checked before any
        is numbered: a bad prompt 3 raises having used no request id and no random draw, so
        the next call numbers and seeds its requests as if the failed one never happened."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ValueError("prompts is empty: give at least one prompt")
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params or SamplingParams()] * len(prompts)
        )
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts")
        groups = [self._checked_group(prompt, p, i, lora)
                  for i, (prompt, p, lora) in enumerate(zip(prompts, params, loras))]  # fmt: skip
        return [self._number(group) for group in groups]

    def make_group(
        self, prompt: Prompt, params: SamplingParams, i: int = 0, request_id: str | None = None, lora_request=None
    ) -> list[Sequence]:
        """One validated prompt -> its `n` sequences (the samples of one request)."""
        return self._number(self._checked_group(prompt, params, i, lora_request), request_id)

    def _checked_group(self, prompt: Prompt, params: SamplingParams, i: int, lora_request=None) -> list[Sequence]:
        """Every check of one request; its sequences come back without ids or generators."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params for prompt {i} must be a SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"sampling_params.stop for prompt {i} needs a tokenizer, and the model has none (use stop_token_ids)"
            )
        # SamplingParams cannot know the vocabulary; an id past it would fail the whole batch
        # later (the min_tokens ban indexes the logits row with it), so it is refused here.
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise ValueError(
                f"SamplingParams.stop_token_ids={params.stop_token_ids!r} for prompt {i} has ids outside the "
                f"vocabulary [0, {self.vocab_size})"
            )
        ids = self.tokenize(prompt, i)
        text = prompt if isinstance(prompt, str) else None
        rest = (text, ids, params, self.max_model_len, self.eos_token_ids, None, self.tokenizer)
        if lora_request is not None and not self.takes_lora:
            raise ValueError(f"lora_request for prompt {i}: this engine has no LoRA (enable_lora=True, levels 2-5)")
        group = [self.sequence_class(-1, "", j, *rest, clock=self.clock, lora_request=lora_request)
                 for j in range(params.n)]  # fmt: skip
        self.check_fits(group[0], i)
        for prepare in self.preparers:
            prepare(group, i)
        if params.structured_outputs is not None and group[0].constraint is None:  # asked for, and no room answered
            raise ValueError(f"sampling_params.structured_outputs for prompt {i}: this engine has no preparer for it")
        return group

    def _number(self, group: list[Sequence], request_id: str | None = None) -> list[Sequence]:
        """Hand a checked group its request id, sequence ids and seeded generators (the only
        place the counters and the random generator advance)."""
        rid = request_id if request_id is not None else str(next(self._request_ids))
        for seq in group:
            seq.request_id, seq.seq_id = rid, next(self._seq_ids)
            seq.generator = self._generator(seq.index, seq.params)
        return group

    def tokenize(self, prompt: Prompt, i: int = 0) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {i} is text but the model has no tokenizer; pass token ids")
            ids = self.tokenizer(prompt)["input_ids"] if prompt else []
        else:
            ids = list(prompt)
            if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"prompt {i} has token ids outside [0, {self.vocab_size})")
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens; max_model_len={self.max_model_len} leaves no room to generate"
            )
        return ids

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the model at {self.path} has no chat template (tokenizer_config.json 'chat_template')")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _generator(self, index: int, p: SamplingParams) -> torch.Generator | None:
        """Sample `index`'s own generator: seeded by the request (`seed + index`), else by the engine's."""
        if p.greedy:
            return None
        seed = p.seed + index if p.seed is not None else int(torch.randint(2**62, (1,), generator=self._rng))
        return torch.Generator(device=self.device).manual_seed(seed)
