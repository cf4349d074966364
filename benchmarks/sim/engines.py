"""The ladder's own engines with the model replaced by a cost: a GPU's clock, not its arithmetic.

What it is: each system the PagedAttention paper compares, built from the ladder's classes
with only the forward pass and the sampler's draw replaced:

    Simulated           a mixin for an engine: weights never load (the shape comes from a
                        config.json), the worker is clock.py's `SimulatedExecutor` (a forward
                        is the cost model's time on the clock, and no logits), `prepare_input`
                        describes the step instead of building tensors, and `sample` takes each
                        request's next token from the workload: a filler token, and EOS at the
                        request's target length
    level 2, level 3    vLLM: `SimulatedContinuous`, `SimulatedPrefix` (the real Scheduler, the
                        real block managers, preemption by recompute, prefix hits)
    Orca (max / pow2 / oracle)
                        orca.py: level 2's iteration scheduling over contiguous reservations
                        (it builds on `SimulatedContinuous`, so this file does not import it)
    FasterTransformer   level 0's static batches and max-length slabs (`SimulatedStatic`), its
                        batches formed from the requests that have arrived
    level 4             `SimulatedSpeculative`: the real engine's guesses and verification, each
                        guess accepted with probability alpha per position
    level 5             `SimulatedPipeline`: pipeline parallelism's batch queue, pp micro-batches
                        of disjoint requests in flight, overlapping on the stages' clocks

Everything that decides (admission, block tables, preemption, prefix hits, when a request
joins or leaves the batch) is the code a reader has read; only the time is modelled.

What it is not: the clock or the executor (clock.py), a model of tokens (a request's output
length is given, not sampled), or of level 5's ranks (TP's all-reduces and PP's sends are a
cost: docs/what_if.md).

Reference: Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention" (SOSP 2023), section 6.1 for the baselines; Vidur (MLSys 2024).
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from level0_naive.engine import NaiveEngine
from level0_naive.loader import LoadedModel
from level0_naive.model import ModelConfig
from level1_paged.block_table import num_blocks_for_budget
from level2_continuous.engine import ContinuousEngine
from level2_continuous.scheduler import ModelRunnerOutput, SchedulerOutput
from level3_prefix.engine import PrefixCachingEngine
from level4_speculative.engine import SpeculativeEngine
from level5_multigpu.engine import ParallelEngine

from .clock import SimClock, SimStep, SimulatedExecutor
from .cost import Hardware, ModelShape, model_dir, quantized, repeated_context, step_time


def read_again(kv, scheduled) -> int:
    """`repeated_context` of one scheduled step: each (request, new tokens)'s block table in `kv` and
    its context once the step has run (the real engines' steps too: benchmarks/sim/validate.py)."""
    return repeated_context([kv.block_table(r) for r, _ in scheduled],
                            [r.num_computed_tokens + n for r, n in scheduled], kv.block_size)  # fmt: skip


def dtype_bytes(dtype: str) -> int:
    """Bytes per value of a dtype by name ("bfloat16": 2)."""
    return getattr(torch, dtype).itemsize


def engine_model_config(hf: dict) -> ModelConfig:
    """The ModelConfig an engine needs (KV bytes, positions) from any shipped config.json, OPT's included."""
    s = ModelShape.from_hf(hf)
    return ModelConfig(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                       num_layers=s.num_layers, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
                       head_dim=s.head_dim, max_position_embeddings=s.max_len)  # fmt: skip


class Simulated:
    """Mixin for an engine: no weights, a simulated executor, tokens from the workload.

    `targets[request_id]` is the output length the request ends at (with EOS)."""

    def __init__(self, model: str, *, hardware: Hardware, clock: SimClock, tp: int = 1, keep_trace: bool = False,
                 dtype: str = "bfloat16", pp: int = 1, **kwargs):  # fmt: skip
        self.hardware, self.tp, self.keep_trace, self.pp = hardware, tp, keep_trace, pp
        self.targets: dict[str, int] = {}
        path = Path(model) if (Path(model) / "config.json").is_file() else model_dir(str(model))  # a shipped shape
        self.hf = json.loads((path / "config.json").read_text())
        shape = replace(ModelShape.from_hf(self.hf, path.name), dtype_bytes=dtype_bytes(dtype))
        # quantization: the cost model's widths (the engine's own pool sizes itself from kv_cache_dtype)
        self.shape = quantized(shape, kwargs.get("quantization"), kwargs.get("kv_cache_dtype", "auto"))
        self.filler = (self.shape.eos_token_id + 1) % self.shape.vocab
        super().__init__(str(path), clock=clock, dtype=dtype, **kwargs)

    def load_model(self) -> LoadedModel:
        """The config alone: no weights, no tokenizer (prompts are token ids)."""
        path = Path(self.config.model.model)
        return LoadedModel(None, engine_model_config(self.hf), None, [self.shape.eos_token_id], path, self.hf, {})

    def make_executor(self, num_blocks: int) -> SimulatedExecutor:
        return SimulatedExecutor(num_blocks, self.hardware, self.shape, self.clock, self.tp, self.keep_trace, self.pp)

    def next_token(self, req, ahead: int = 0) -> int:
        """The workload's token `ahead` places past the request's output: EOS at its target length."""
        done = len(req.output_token_ids) + ahead + 1 >= self.targets[req.request_id]
        return self.shape.eos_token_id if done else self.filler


class SimulatedContinuous(Simulated, ContinuousEngine):
    """Level 2 (vLLM without prefix caching) on the modelled clock."""

    def make_worker(self) -> SimulatedExecutor:
        worker = self.make_executor(num_blocks_for_budget(self.kv_budget, self.config.cache.block_size, self.bytes_per_token))
        worker.probe = self.kv_tokens
        return worker

    def kv_tokens(self) -> tuple[int, int]:
        used_blocks, stored = self.kv.usage()
        return used_blocks * self.kv.block_size, stored

    def prepare_input(self, sched: SchedulerOutput) -> SimStep:
        take = getattr(self.kv, "take_block_copies", None)
        if take is not None:
            take()  # (copy-on-write pairs: a copy is a memory move the model does not count)
        shared = 0
        if self.hardware.kv_reuse or self.hardware.shared_context_overhead_s is not None:  # (else it costs nothing)
            shared = read_again(self.kv, sched.scheduled)
        return SimStep([(r.num_computed_tokens, n) for r, n in sched.scheduled],
                       sum(r.num_logits(n) for r, n in sched.scheduled), shared)  # logits rows (k + 1 when verifying)

    def sample(self, sched: SchedulerOutput, logits) -> ModelRunnerOutput:
        reqs = [r for r, n in sched.scheduled if r.num_logits(n)]
        return ModelRunnerOutput(reqs, [[self.next_token(r)] for r in reqs], [[None] for _ in reqs])


class SimulatedPrefix(SimulatedContinuous, PrefixCachingEngine):
    """Level 3 (vLLM with prefix caching) on the modelled clock."""


class SimulatedPipeline(SimulatedPrefix, ParallelEngine):
    """Level 5 with `pp` pipeline stages on the modelled clock: its batch queue keeps up to pp micro-batches
    of disjoint requests in flight (`ParallelEngine._step`), and the executor's stage clocks overlap them,
    so a pipeline buys speed as well as memory once it has as many micro-batches as stages to run. The
    scheduler is level 3's (`enable_prefix_caching=False`: level 2's decisions), TP inside each stage as
    every simulated level models it; no draft. With pp = 1 this is `SimulatedPrefix`, step for step."""

    tp = pp = 1  # plain attributes here (the Simulated mixin sets them), not level 5's config properties
    parallel = False  # no ranks to start, shard or measure: the stages are the executor's clocks

    def load_model(self) -> LoadedModel:
        loaded = super().load_model()
        self.load_draft(loaded)  # level 4's speculation settings: none (no speculative_config)
        return loaded


class SimProposer:
    """Level 4's proposer Protocol without a model: k filler guesses per request. A draft model's time
    (k decode steps of its shape over the drafting requests) goes on the clock; n-grams cost nothing."""

    has_kv_cache = False

    def __init__(self, engine: SimulatedSpeculative):
        self.engine = engine

    def prefill(self, sched: SchedulerOutput) -> None:
        """The draft computes the step's prompt chunks too (its cache keeps up with the target's)."""
        e, chunks = self.engine, []
        for r, n in sched.scheduled:  # the prompt tokens in each chunk (a decode has none)
            if (end := min(r.num_computed_tokens + n, len(r.prompt_token_ids))) > r.num_computed_tokens:
                chunks.append((r.num_computed_tokens, end - r.num_computed_tokens))
        if e.draft_shape is not None and e.draft_cost and chunks:
            e.clock.advance(step_time(e.draft_hardware, e.draft_shape, chunks, 0, e.tp, e.pp))

    def propose(self, drafting: list) -> None:
        e = self.engine
        for req, k in drafting:
            req.spec_token_ids, req.spec_probs = [e.filler] * k, None
        if e.draft_shape is not None and e.draft_cost and drafting:
            for j in range(max(k for _, k in drafting)):
                chunks = [(req.num_tokens + j - 1, 1) for req, k in drafting if k > j]
                e.clock.advance(step_time(e.draft_hardware, e.draft_shape, chunks, len(chunks), e.tp, e.pp))


class SimulatedSpeculative(SimulatedContinuous, SpeculativeEngine):
    """Level 4 on the modelled clock: the real engine's guesses, verification rows, KV slots and
    `disable_by_batch_size`; a guess at position j (1-based) is accepted with probability `alpha[j-1]`
    (one alpha for every position if a float), the first rejection ending the run, as in
    Leviathan et al.'s analysis. `draft_shape`: the draft model, whose cache takes its share of the
    KV budget as the real engine's does and whose prefills and guesses cost time (`draft_cost=False`:
    not on the clock, when a calibration already counts them); None: no draft (n-grams: free).
    `draft_hardware`: what the draft's passes cost on (default: the target's hardware; a CPU's
    calibration gives the draft its own per-pass overhead, benchmarks/sim/validate.py)."""

    def __init__(self, model: str, *, num_speculative_tokens: int = 4, alpha: float | list[float] = 0.7,
                 draft_shape: ModelShape | None = None, draft_cost: bool = True,
                 draft_hardware: Hardware | None = None, disable_by_batch_size: int | None = None, seed: int = 0,
                 **kwargs):  # fmt: skip
        import random

        self.draft_cost, self.draft_hardware = draft_cost, draft_hardware or kwargs["hardware"]
        k = num_speculative_tokens
        self.alpha = [alpha] * k if isinstance(alpha, (int, float)) else list(alpha)
        if len(self.alpha) < k:
            raise ValueError(f"alpha has {len(self.alpha)} positions, fewer than num_speculative_tokens={k}")
        self.draft_shape, self.rng = draft_shape, random.Random(seed)
        spec = {"method": "ngram", "num_speculative_tokens": k, "disable_by_batch_size": disable_by_batch_size}
        super().__init__(model, speculative_config=spec, **kwargs)

    def load_model(self) -> LoadedModel:
        loaded = super().load_model()
        self.load_draft(loaded)  # (an n-gram config: no draft model is loaded)
        return loaded

    def make_proposer(self) -> SimProposer:
        return SimProposer(self)

    def prepare_input(self, sched: SchedulerOutput) -> SimStep:
        """The step described, as level 2's (SimulatedContinuous comes first in the MRO), after the draft's
        pass over its prompt chunks (what level 4's own prepare_input adds)."""
        self.proposer.prefill(sched)
        return super().prepare_input(sched)

    def draft_kv_bytes_per_token(self) -> int:
        """The draft's cache shares the budget (level 4's split), in the target's dtype."""
        return replace(self.draft_shape, dtype_bytes=self.shape.dtype_bytes).kv_bytes_per_token if self.draft_shape else 0

    def sample(self, sched: SchedulerOutput, logits) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        for req, n in sched.scheduled:
            rows = req.num_logits(n)
            if not rows:
                continue
            k = rows - 1
            accepted = 0
            while accepted < k and self.rng.random() < self.alpha[accepted]:
                accepted += 1
            if k:
                self.spec_stats.record(k, accepted)
            tokens = []
            for _ in range(accepted + 1):  # the accepted guesses and the target's own next token
                tokens.append(self.next_token(req, len(tokens)))
                if tokens[-1] == self.shape.eos_token_id:
                    break
            out.requests.append(req)
            out.token_ids.append(tokens)
            out.logprobs.append([None] * len(tokens))
        return out


@dataclass
class StaticSlab:
    """Level 0's slab without its tensors: how much it reserves and holds."""

    reserved: int
    used: int = 0
    finished: bool = False


class SimulatedStatic(Simulated, NaiveEngine):
    """FasterTransformer: level 0's static batching and max-length slabs, on the modelled clock. Its
    batch is formed from the requests that have arrived (`pending`, in arrival order), and runs to
    its longest member before the next is formed."""

    def _init_kv_cache(self) -> None:
        self.slabs: dict[int, StaticSlab] = {}
        self.reserved_tokens = 0
        self.worker = self.make_executor(0)
        self.worker.probe = lambda: (self.reserved_tokens, sum(s.used for s in self.slabs.values() if not s.finished))

    def _admit_one(self, seq) -> bool:
        reserve = seq.max_total_tokens
        if (self.reserved_tokens + reserve) * self.bytes_per_token > self.kv_budget:
            return False
        self.slabs[seq.seq_id] = StaticSlab(reserve)
        self.reserved_tokens += reserve
        return True

    def _execute(self, running, chunks) -> None:
        for s, (toks, start) in zip(running, chunks):
            self.slabs[s.seq_id].used = start + len(toks)
        self.worker.execute(SimStep([(start, len(toks)) for toks, start in chunks], len(running)))

    def sample_tokens(self, logits, seqs) -> tuple[list[int], list]:
        return [self.next_token(s) for s in seqs], [None] * len(seqs)

    def run(self, seqs, bar) -> None:
        """Level 0's loop, with arrivals, as a static-batching server runs it (benchmarks/engines.py,
        `static_batches`): the requests that have arrived form a round, which runs to its end (in as
        many batches as memory needs) before whoever arrived meanwhile is looked at."""
        pending = deque(sorted(seqs, key=lambda s: s.metrics.arrival_time))
        while pending:
            self.clock.now = max(self.clock.now, pending[0].metrics.arrival_time)
            self.waiting = deque()
            while pending and pending[0].metrics.arrival_time <= self.clock.now:
                self.waiting.append(pending.popleft())
            while self.waiting:
                batch = []
                while self.waiting and len(batch) < self.config.scheduler.max_num_seqs and self._admit_one(self.waiting[0]):
                    batch.append(self.waiting.popleft())
                self._run_batch(batch, bar)
