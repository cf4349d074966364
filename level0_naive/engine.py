"""Level 0: the naive engine. Contiguous KV slabs and static batching.

What it is: `LLM(model=...).generate(prompts, SamplingParams(...))`, vLLM's offline API,
implemented the way systems worked before PagedAttention and iteration-level scheduling:

  1. Admission: take waiting requests in order while each one's slab of
     `prompt + max_tokens` KV slots fits in the KV memory budget (and `max_num_seqs`).
  2. The batch runs to completion: one prefill of every prompt, then decode steps until
     the *longest* request finishes. Nobody joins a running batch (static batching).
  3. Only then are the slabs returned, and the next batch is admitted.

Two kinds of waste follow, and later levels each remove one: slabs reserved for tokens
that are never generated (level 1: paged blocks) and requests waiting behind a batch's
longest member (level 2: continuous batching). `self.stats` measures the first; the
per-request TTFT / latency in `RequestOutput.metrics` shows the second.

What it is not: fast, or clever. Each hook a later level replaces is a small method
(`_fits`, `_admit_one`, `_attention`, `_on_finish`, `_end_batch`, `_kv_usage`).

Reference: vLLM's `LLM` entry point (vllm/entrypoints/llm.py) for the API; Yu et al.,
"Orca" (OSDI 2022) section 2 for static batching; the PagedAttention paper section 2.3.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

import torch

from .config import EngineConfig, resolve_device, resolve_dtype, resolve_kv_budget
from .kv_cache import Slab, SlabAttention, kv_bytes_per_token
from .loader import load_model
from .outputs import RequestOutput, Sequence, group_outputs
from .progress import GenerateProgress
from .runner import ModelRunner
from .sampling import SamplingParams
from .stats import EngineStats, Timer

Prompt = str | list[int]


class LLM:
    """The offline engine: load once, call `generate` or `chat` many times."""

    config_class = EngineConfig
    sequence_class = Sequence  # level 2 swaps in its Request (a Sequence with a scheduler state)

    def __init__(self, model: str, **kwargs):
        self.config = self.config_class(model=str(model), **kwargs)
        self.device = resolve_device(self.config.device)
        self.dtype = resolve_dtype(self.config.dtype, self.device)
        loaded = load_model(self.config.model, self.dtype, self.device)
        self.loaded, self.model_config, self.tokenizer = loaded, loaded.config, loaded.tokenizer
        limit = loaded.config.max_position_embeddings
        self.max_model_len = self.config.max_model_len or limit
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={limit}")
        self.kv_budget = resolve_kv_budget(self.config, self.device)
        self.bytes_per_token = kv_bytes_per_token(loaded.config, self.dtype)
        self.runner = ModelRunner(loaded.model, loaded.tokenizer, self.device)
        self.stats = EngineStats()
        self._rng = torch.Generator().manual_seed(self.config.seed)
        self._ids = itertools.count()
        self._init_kv_cache()

    # --- the public API ------------------------------------------------------
    def generate(self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 progress: bool = True, use_tqdm: bool | None = None) -> list[RequestOutput]:  # fmt: skip
        """Generate for every prompt (a string or a list of token ids); outputs in prompt order.

        `use_tqdm` is vLLM's name for `progress` (the bar here is rich's), accepted as-is.
        """
        progress = progress if use_tqdm is None else use_tqdm
        groups = self._make_requests(prompts, sampling_params)  # validates everything first
        seqs = [s for g in groups for s in g]
        with Timer() as t, GenerateProgress(len(seqs), enabled=progress) as bar:
            self._run(seqs, bar)
        self.stats.busy_time += t.seconds
        return [group_outputs(g, self.tokenizer) for g in groups]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None, *, progress: bool = False) -> list[RequestOutput]:
        """Render conversation(s) with the checkpoint's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.apply_chat_template(c) for c in conversations], sampling_params, progress=progress)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the model at {self.loaded.path} has no chat template (tokenizer_config.json 'chat_template')")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    # --- requests --------------------------------------------------------------
    def _make_requests(self, prompts, sampling_params) -> list[list[Sequence]]:
        """Prompts -> one group of `n` sequences per prompt; every check runs before any work."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ValueError("prompts is empty: give at least one prompt")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        return [self._make_group(prompt, p, i) for i, (prompt, p) in enumerate(zip(prompts, params))]

    def _make_group(self, prompt: Prompt, params: SamplingParams, i: int = 0, request_id: str | None = None) -> list[Sequence]:
        """One validated prompt -> its `n` sequences (the samples of one request)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params for prompt {i} must be a SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"sampling_params.stop for prompt {i} needs a tokenizer, and the model has none (use stop_token_ids)")
        ids = self._tokenize(prompt, i)
        rid = request_id if request_id is not None else str(next(self._ids))
        text = prompt if isinstance(prompt, str) else None
        group = [self._new_sequence(rid, j, text, ids, params) for j in range(params.n)]
        self._fits(group[0], i)
        return group

    def _tokenize(self, prompt: Prompt, i: int) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {i} is text but the model has no tokenizer; pass token ids")
            ids = self.tokenizer(prompt)["input_ids"] if prompt else []
        else:
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt {i} has {len(ids)} tokens; max_model_len={self.max_model_len} leaves no room to generate")
        return ids

    def _new_sequence(self, rid: str, index: int, prompt: str | None, ids: list[int], p: SamplingParams) -> Sequence:
        gen = None
        if not p.greedy:
            seed = p.seed + index if p.seed is not None else int(torch.randint(2**62, (1,), generator=self._rng))
            gen = torch.Generator(device=self.device).manual_seed(seed)
        return self.sequence_class(next(self._ids), rid, index, prompt, ids, p, self.max_model_len, self.loaded.eos_token_ids, gen)

    # --- static batching --------------------------------------------------------
    def _run(self, seqs: list[Sequence], bar: GenerateProgress) -> None:
        self.waiting = deque(seqs)
        while self.waiting:
            batch = []
            while self.waiting and len(batch) < self.config.max_num_seqs and self._admit_one(self.waiting[0]):
                batch.append(self.waiting.popleft())
            assert batch, "_fits() guarantees a lone request fits an empty cache"
            self._run_batch(batch, bar)

    def _run_batch(self, batch: list[Sequence], bar: GenerateProgress) -> None:
        now = time.perf_counter()
        for s in batch:
            s.metrics.first_scheduled_time = s.metrics.first_scheduled_time or now
        # Prefill feeds every token not yet in the cache (the prompt, or more after a recompute).
        running = list(batch)
        chunks = [(s.all_token_ids, 0) for s in running]
        self.stats.prompt_tokens += sum(len(c) for c, _ in chunks)
        while running:
            with Timer() as t:
                attn, running, chunks = self._attention(running, chunks)
                logits = self.runner.forward(chunks, attn, list(range(len(running))))
                attn.commit()
                self.runner.sample_and_append(running, logits)
            self.stats.generated_tokens += len(running)
            self.stats.record_step(len(running), *self._kv_usage(), t.seconds)
            done = [s for s in running if s.is_finished]
            for s in done:
                self._on_finish(s)
            bar.update(finished=len(done), new_tokens=len(running))
            running = [s for s in running if not s.is_finished]
            chunks = [([s.output_token_ids[-1]], s.num_tokens - 1) for s in running]
        self._end_batch(batch)

    # --- the KV cache: the hooks level 1 replaces ----------------------------------
    def _init_kv_cache(self) -> None:
        self.slabs: dict[int, Slab] = {}  # seq_id -> its slab
        self.reserved_tokens = 0

    def _fits(self, seq: Sequence, i: int) -> None:
        """Refuse, up front, a request that could never run even alone."""
        need = seq.max_total_tokens * self.bytes_per_token
        if need > self.kv_budget:
            raise ValueError(f"prompt {i} needs {need} bytes of KV cache (prompt + max_tokens = {seq.max_total_tokens} tokens) but kv_cache_memory is {self.kv_budget}")

    def _admit_one(self, seq: Sequence) -> bool:
        """Reserve a slab for the whole possible length, or say no."""
        reserve = seq.max_total_tokens
        if (self.reserved_tokens + reserve) * self.bytes_per_token > self.kv_budget:
            return False
        self.slabs[seq.seq_id] = Slab(self.model_config, reserve, self.dtype, self.device)
        self.reserved_tokens += reserve
        return True

    def _attention(self, running: list[Sequence], chunks):
        """The backend for this step (level 1 may also trim `running` when memory is short)."""
        return SlabAttention([self.slabs[s.seq_id] for s in running], [len(c) for c, _ in chunks]), running, chunks

    def _on_finish(self, seq: Sequence) -> None:
        """A finished request keeps its slab (static batching frees only at batch end),
        but its tokens are dead weight from now on: they no longer count as used."""
        self.slabs[seq.seq_id].finished = True

    def _end_batch(self, batch: list[Sequence]) -> None:
        for s in batch:
            self.reserved_tokens -= self.slabs.pop(s.seq_id).reserved

    def _kv_usage(self) -> tuple[int, int]:
        """(bytes reserved, bytes holding real tokens) right now."""
        used = sum(slab.used for slab in self.slabs.values() if not slab.finished)
        return self.reserved_tokens * self.bytes_per_token, used * self.bytes_per_token
