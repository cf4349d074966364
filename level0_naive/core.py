"""What every engine of the ladder has, whatever its batching: the parts around the model loop.

What it is: `EngineBase`, the constructor and the small services every engine shares: the
configuration, the loaded model and tokenizer, `max_model_len`, the KV budget and the bytes
one cached token costs, the `InputProcessor` (prompts -> validated sequences), the
`OutputProcessor` (sequences -> outputs), the sampling stage, and the statistics. Rooms plug
in at the ops, the sampler and the request preparer (`ladder/rooms.py` picks them by `ops=`,
`batch_invariant=`, `structured_outputs_backend=`). A subclass adds the loop (`run`), its KV
cache, and whether a request could ever fit (`check_fits`).

The engine's `clock` (default `time.perf_counter`) is what every request's times (arrival,
first scheduled, first and last token, finish: TTFT, ITL, end-to-end latency) and every
step record are read from: a simulator passes a modelled GPU clock, a test a fake one. The
stats' step timers (`Timer`) stay on the real clock: they measure what this machine spent.

What it is not: an engine by itself, and not a home for hooks: nothing here is a batching
idea. Level 2's engine subclasses it too (with its own `sequence_class`), level 4 adds its
draft's cache to `kv_bytes_per_token`, and level 5's ranks each load their shard in `load_model`.

Reference: vLLM `v1/engine/llm_engine.py` and `core.py` (what EngineCore owns).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ladder import rooms
from ladder.metrics import Metric
from ladder.progress import GenerateProgress

from .config import PARTS, EngineConfig, resolve_device, resolve_dtype, resolve_kv_budget
from .inputs import InputProcessor
from .kv_cache import kv_bytes_per_token
from .loader import LoadedModel, load_model
from .logits_processors import DEFAULT_PROCESSORS
from .ops import Ops
from .outputs import OutputProcessor, Sequence, logprob_entries
from .sampler import Sampler
from .stats import EngineStats


class EngineBase:
    config_parts = PARTS  # the config's part classes (config.py); a level swaps or adds its own
    sequence_class = Sequence  # what each sample is made as; a subclass may swap in a subclass of it

    def __init__(self, model: str, *, clock: Callable[[], float] = time.perf_counter, **kwargs):
        self.clock = clock
        self.config = EngineConfig(str(model), self.config_parts, **kwargs)
        m = self.config.model
        self.device = resolve_device(m.device)
        self.dtype = resolve_dtype(m.dtype, self.device)
        self.ops = self.make_ops()
        self.loaded = self.load_model()
        self.model_config, self.tokenizer = self.loaded.config, self.loaded.tokenizer
        limit = self.model_config.max_position_embeddings
        # A checkpoint's positions can exceed what it was trained on (the built-in models: 2048
        # positions, 256-token windows). The tokenizer's model_max_length is Hugging Face's
        # "inputs up to": the default when it says less. Past it, ask explicitly (-1: all positions).
        trained = getattr(self.tokenizer, "model_max_length", None)
        default = min(limit, trained) if isinstance(trained, int) and trained >= 2 else limit
        self.max_model_len = {None: default, -1: limit}.get(m.max_model_len, m.max_model_len)
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={limit}")
        if self.tokenizer is not None:  # else transformers warns of "indexing errors" past the trained window
            self.tokenizer.model_max_length = self.max_model_len
        self.kv_budget = resolve_kv_budget(self.config.cache, self.device)
        self.bytes_per_token = self.kv_bytes_per_token()
        self.stats = EngineStats()
        # what prepares a request that asks for a room: structured outputs' compiler (ladder/rooms.py)
        self.request_preparer = rooms.request_preparer(self.tokenizer, self.model_config.vocab_size,
                                                       self.loaded.eos_token_ids, m.structured_outputs_backend)
        self.inputs = InputProcessor(self.loaded, self.max_model_len, m.seed, self.device,
                                     self.sequence_class, self.check_fits, self.clock, (self.request_preparer,))  # fmt: skip
        self.outputs = OutputProcessor()
        self.sampler = self.make_sampler()

    def make_sampler(self) -> Sampler:
        """The sampler over `logits_processors()`; a room's sampler class replaces level 0's where a
        setting asks (`batch_invariant=True`: ladder/rooms.py)."""
        sampler_class = rooms.sampler_class(self.config.model.batch_invariant) or Sampler
        return sampler_class(self.logits_processors())

    def logits_processors(self) -> list:
        """The sampler's chain: level 0's, then the rooms' (each applies only to the requests that ask).
        Extend it here (`[*super().logits_processors(), Mine()]`): the rooms' stay in the chain."""
        return [*DEFAULT_PROCESSORS, *rooms.logits_processors()]

    @property
    def model_path(self):
        """Where the checkpoint was loaded from (a Path)."""
        return self.loaded.path

    def make_ops(self) -> Ops:
        """What the model's linears, norms, RoPE and SwiGLU compute with: ops.py's, or a room's kernels
        (`ops=`, `batch_invariant=`: ladder/rooms.py says which, and why when they cannot run here)."""
        m = self.config.model
        return rooms.ops(m.ops, m.batch_invariant, self.device, self.dtype)

    def load_model(self) -> LoadedModel:
        """Weights, config and tokenizer; with `quantization=`, the projections' weights quantized (the room's)."""
        loaded = load_model(self.config.model.model, self.dtype, self.device, self.ops)
        rooms.quantize(loaded.model, self.config.model.quantization)
        return loaded

    def kv_bytes_per_token(self) -> int:
        """What one cached token costs, summed over every KV cache the engine keeps (here one)."""
        return kv_bytes_per_token(self.model_config, self.dtype)

    # --- what an engine must say ---------------------------------------------------------------
    def check_fits(self, seq: Sequence, i: int) -> None:
        """Raise ValueError, up front, for a request that could never run even alone."""
        raise NotImplementedError

    def run(self, seqs: list[Sequence], bar: GenerateProgress) -> None:
        """Run these sequences to the end (what `LLM.generate` calls)."""
        raise NotImplementedError

    # --- the sampling stage, the same at every level -------------------------------------------
    @torch.inference_mode()
    def sample_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list]:
        """logits [len(seqs), V] -> (one token per sequence, its logprobs entry or None)."""
        tokens = self.sampler.sample(logits, [s.sampling_state() for s in seqs])  # [B]
        return tokens.tolist(), logprob_entries(logits, tokens, [s.params.logprobs for s in seqs], self.tokenizer)

    def take_prompt_logprobs(self, chunks: list[tuple[Sequence, int, int, int]], logits: torch.Tensor) -> torch.Tensor:
        """Record the prompt logprobs a forward's logits hold; return the rows left for sampling
        (`logits` itself when no request asked for prompt logprobs).

        chunks[i] = (sequence, position of its first new token, its new tokens, its sampling rows),
        in batch order; a sequence's rows are its `prompt_logprob_rows`, then its sampling rows."""
        counts = [seq.prompt_logprob_rows(start, n) for seq, start, n, _ in chunks]
        if not any(counts):
            return logits
        keep, row = [], 0
        for (seq, _, _, sampled), k in zip(chunks, counts):
            if k:
                seq.record_prompt_logprobs(logits[row : row + k], self.tokenizer)
            keep += range(row + k, row + k + sampled)
            row += k + sampled
        return logits[keep]

    def append_token(self, seq: Sequence, token: int, logprob=None) -> None:
        """One new token for one sequence (stop rules applied), counted, its inter-token latency recorded."""
        before = seq.metrics.last_token_time
        seq.append_token(token, logprob)
        self.stats.generated_tokens += 1
        if before is not None:
            self.stats.itl.observe(seq.metrics.last_token_time - before)
        if seq.is_finished:
            self.stats.record_finished(seq)

    def get_metrics(self) -> list[Metric]:
        """vLLM's offline metrics: a list of counters, gauges and histograms."""
        return self.stats.metrics()

    def mark_scheduled(self, seqs: list[Sequence]) -> None:
        now = self.clock()
        for s in seqs:
            s.metrics.first_scheduled_time = s.metrics.first_scheduled_time or now
