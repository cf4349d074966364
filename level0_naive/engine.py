"""Level 0: the naive engine. Contiguous KV slabs and static batching.

What it is: `NaiveEngine`, the engine behind level 0's `LLM.generate`, working the way
serving systems did before vLLM:

  1. Admission: take waiting requests in order while each one's slab of
     `prompt + max_tokens` KV slots fits in the KV memory budget (and `max_num_seqs`).
  2. The batch runs to completion: one prefill of every prompt, then decode steps until
     the *longest* request finishes. Nobody joins a running batch (static batching).
  3. Only then are the slabs returned, and the next batch is admitted.

Two kinds of waste follow: slabs reserved for tokens that are never generated, and
requests waiting behind a batch's longest member. `self.stats` measures the first; the
per-request TTFT / latency in `RequestOutput.metrics` shows the second.

What it is not: fast, or clever. The KV cache is eight small methods (`_init_kv_cache`,
`check_fits`, `_admit_one`, `_make_room`, `_execute`, `_on_finish`, `_end_batch`,
`kv_usage`) around the batching loop. Level 1 removes the first waste with paged blocks by
replacing exactly those eight (adding `_evict`), and level 2 the second with continuous batching.

Reference: Yu et al., "Orca" (OSDI 2022) section 2 for static batching; Kwon et al.
(SOSP 2023) section 2.3 for reservation waste.
"""

from __future__ import annotations

from collections import deque

import torch

from ladder.progress import GenerateProgress

from .core import EngineBase
from .kv_cache import Slab, SlabAttention
from .model_runner import Chunk, FlatBatch, ModelRunner
from .outputs import Sequence
from .stats import Timer


class NaiveEngine(EngineBase):
    def __init__(self, model: str, **kwargs):
        super().__init__(model, **kwargs)
        self.waiting: deque[Sequence] = deque()
        self._init_kv_cache()

    # --- static batching ------------------------------------------------------------
    def run(self, seqs: list[Sequence], bar: GenerateProgress) -> None:
        self.waiting = deque(seqs)
        while self.waiting:
            batch = []
            while self.waiting and len(batch) < self.config.scheduler.max_num_seqs and self._admit_one(self.waiting[0]):
                batch.append(self.waiting.popleft())
            assert batch, "check_fits() guarantees a lone request fits an empty cache"
            self._run_batch(batch, bar)

    def _run_batch(self, batch: list[Sequence], bar: GenerateProgress) -> None:
        self.mark_scheduled(batch)
        # Prefill feeds every token the sequence holds (its prompt, and any output it already has).
        running = list(batch)
        chunks: list[Chunk] = [(s.all_token_ids, 0) for s in running]
        self.stats.prompt_tokens += sum(len(c) for c, _ in chunks)
        while running:
            with Timer() as t:
                running, chunks = self._make_room(running, chunks)
                logits = self._execute(running, chunks)  # [rows, V]: one per sequence (+ prompt logprobs' rows)
                logits = self.take_prompt_logprobs([(s, p, len(c), 1) for s, (c, p) in zip(running, chunks)], logits)
                tokens, logprobs = self.sample_tokens(logits, running)  # logits [len(running), V]
                for seq, tok, lp in zip(running, tokens, logprobs):
                    self.append_token(seq, tok, lp)
            self.stats.record_step(len(running), *self.kv_usage(), t.seconds)
            done = [s for s in running if s.is_finished]
            for s in done:
                self._on_finish(s)
            bar.update(finished=len(done), new_tokens=len(running))
            running = [s for s in running if not s.is_finished]
            chunks = [([s.output_token_ids[-1]], s.num_tokens - 1) for s in running]
        self._end_batch(batch)

    # --- the KV cache: the eight methods of the module docstring ------------------------------
    def _init_kv_cache(self) -> None:
        self.runner = ModelRunner(self.loaded.model)
        self.slabs: dict[int, Slab] = {}  # seq_id -> its slab
        self.reserved_tokens = 0

    def check_fits(self, seq: Sequence, i: int) -> None:
        need = seq.max_total_tokens * self.bytes_per_token
        if need > self.kv_budget:
            raise ValueError(
                f"prompt {i} needs {need} bytes of KV cache (prompt + max_tokens = {seq.max_total_tokens} tokens) "
                f"but kv_cache_memory is {self.kv_budget}"
            )

    def _admit_one(self, seq: Sequence) -> bool:
        """Reserve a slab for the whole possible length, or say no."""
        reserve = seq.max_total_tokens
        if (self.reserved_tokens + reserve) * self.bytes_per_token > self.kv_budget:
            return False
        self.slabs[seq.seq_id] = Slab(self.model_config, reserve, self.dtype, self.device)
        self.reserved_tokens += reserve
        return True

    def _make_room(self, running: list[Sequence], chunks: list[Chunk]) -> tuple[list[Sequence], list[Chunk]]:
        """Room for this step's new tokens, dropping whoever cannot have it: nobody, a slab has it."""
        return running, chunks

    @staticmethod
    def num_logits(running: list[Sequence], chunks: list[Chunk]) -> list[int]:
        """Logits rows per sequence: its last new token's, after the prompt logprobs' if it asked."""
        return [1 + s.prompt_logprob_rows(start, len(toks)) for s, (toks, start) in zip(running, chunks)]

    @torch.inference_mode()
    def _execute(self, running: list[Sequence], chunks: list[Chunk]) -> torch.Tensor:
        """One forward over the running sequences -> logits at each one's last new token
        (and, before it, the rows `Sequence.prompt_logprob_rows` counts)."""
        batch = FlatBatch.build(chunks, self.num_logits(running, chunks))
        attn = SlabAttention([self.slabs[s.seq_id] for s in running], batch.query_start_loc)
        logits = self.runner.forward(batch.to(self.device), attn)
        attn.commit()
        return logits

    def _on_finish(self, seq: Sequence) -> None:
        """A finished request keeps its slab (static batching frees only at batch end),
        but its tokens are dead weight from now on: they no longer count as used."""
        self.slabs[seq.seq_id].finished = True

    def _end_batch(self, batch: list[Sequence]) -> None:
        for s in batch:
            self.reserved_tokens -= self.slabs.pop(s.seq_id).reserved

    def kv_usage(self) -> tuple[int, int]:
        """(bytes reserved, bytes holding real tokens) right now."""
        used = sum(slab.used for slab in self.slabs.values() if not slab.finished)
        return self.reserved_tokens * self.bytes_per_token, used * self.bytes_per_token
