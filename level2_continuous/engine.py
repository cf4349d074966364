"""Level 2: continuous batching. The engine asks the scheduler every step.

What it is: `ContinuousEngine` (exported as `LLMEngine`, vLLM's name), vLLM's online
core API (`add_request`, `abort_request`, `step`, `has_unfinished_requests`,
`get_metrics`), composed of a `Scheduler`, a `KVCacheManager` and a `Worker`; and `LLM`,
level 0's front end over it. One step reads as vLLM's `EngineCore.step` does:

    sched  = self.schedule()                               who runs, how many tokens (may preempt)
    logits = self.worker.execute(self.prepare_input(sched)) the flattened batch through the paged cache
    output = self.sample(sched, logits)                    processed probabilities, then the draw
    moved  = self.scheduler.update_from_output(sched, output)  tokens join, stop rules, finish, free
    self.post_step(sched)                                  nothing here: a hook after the books are kept

then `step()` turns the requests that moved into outputs (cumulative, delta or final
only), and each observer is called with the step's StepRecord and a KVSnapshot
(observers.py). Each stage is a method a later level can override.

A request leaves the batch the step it finishes, its blocks go back at once, and a
waiting one joins the next step: nobody waits for the batch's longest member.

What it is not: asynchronous or multi-device. It inherits no static-batching code: `EngineBase`
gives it only configuration, model loading, input/output processing and statistics. Level 3
swaps the KV manager and the scheduler, level 4 overrides `prepare_input`, `sample` and `post_step`, level 5
replaces the worker with an executor over ranks, and level 6 wraps the engine in asyncio.

Reference: vLLM V1 `v1/engine/core.py` (EngineCore.step), `v1/engine/llm_engine.py`,
`v1/core/sched/scheduler.py` (update_from_output).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ladder import rooms
from ladder.metrics import Gauge, Metric
from ladder.progress import GenerateProgress
from level0_naive.config import PARTS, Part, SchedulerConfig
from level0_naive.core import EngineBase
from level0_naive.kv_cache import kv_bytes_per_token
from level0_naive.llm import LLM as NaiveLLM
from level0_naive.outputs import RequestOutput
from level0_naive.sampling_params import SamplingParams
from level0_naive.stats import Timer
from level1_paged.block_table import check_fits_in_pool, num_blocks_for_budget
from level1_paged.engine import CompilationSettings, PagedCacheConfig, compilation_for
from level1_paged.model_input import ModelInput
from level1_paged.worker import Worker

from .kv_cache_manager import KVCacheManager, SimpleKVCacheManager
from .observers import StepObserver, notify
from .request import Request
from .scheduler import ModelRunnerOutput, Scheduler, SchedulerOutput

WAIT_FOR_OUTSIDE_S = 0.001  # a step with nothing admissible but requests pending sleeps this long


@dataclass
class ContinuousSchedulerConfig(SchedulerConfig):
    max_num_batched_tokens: int = 2048  # the token budget of one step (prefill chunks + decodes)
    policy: str = "fcfs"  # fcfs | priority
    kv_admission_headroom: int = 0  # admit only if this many free blocks per running request are left (0: vLLM's rule)
    step_log_size: int = 1024  # the last steps kept for timelines (a ring buffer: memory stays bounded)

    def __post_init__(self):
        super().__post_init__()
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
        if self.kv_admission_headroom < 0:
            raise ValueError(f"kv_admission_headroom={self.kv_admission_headroom} must be >= 0")
        if self.step_log_size < 0:
            raise ValueError(f"step_log_size={self.step_log_size} must be >= 0")


@dataclass
class LoRASettings(Part):
    """`enable_lora=True` (vLLM's names): adapters over the base model, mixed in one batch (the room
    features/lora); at most `max_loras` distinct adapters in a step, each of rank <= `max_lora_rank`,
    `max_cpu_loras` kept in host memory (None: max_loras). `fully_sharded_loras` shards every adapter over
    level 5's tensor-parallel ranks S-LoRA's way (features/lora/sharded.py); a whole model has nothing to shard."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    fully_sharded_loras: bool = False


@dataclass
class StepRecord:
    """What one step did (the last `step_log_size` steps are kept): for step-level analysis, such as the
    demo's share of time spent scheduling."""

    time: float
    running: int
    waiting: int
    num_batched_tokens: int
    num_prefill_tokens: int
    preempted: int
    kv_blocks_used: int
    schedule_seconds: float  # scheduler + block bookkeeping + batch building
    step_seconds: float
    request_ids: list[str]


class ContinuousEngine(EngineBase):
    config_parts = {**PARTS, "cache": PagedCacheConfig, "scheduler": ContinuousSchedulerConfig,
                    "compilation": CompilationSettings, "lora": LoRASettings}  # fmt: skip
    sequence_class = Request
    scheduler_class = Scheduler  # a subclass may swap in a subclass of it

    def __init__(self, model: str, *, observers: Iterable[StepObserver] = (), **kwargs):
        super().__init__(model, **kwargs)
        self.observers = list(observers)  # each called once per step with its record and a KV snapshot
        self.worker = self.make_worker()  # it holds the KV cache, so it says how many blocks there are
        self.num_blocks = self.worker.num_blocks
        self.kv: KVCacheManager = self.make_kv_manager()
        self.scheduler = self.make_scheduler()
        self.lora = self.make_lora()
        self.requests: dict[str, list[Request]] = {}  # request_id -> its n samples (online API)
        self.step_log: deque[StepRecord] = deque(maxlen=self.config.scheduler.step_log_size)
        self._aborted: list[RequestOutput] = []  # final outputs of aborted requests, for the next step()

    def make_worker(self) -> Worker:
        """The model and its paged KV cache, as many blocks as the budget holds."""
        c = self.config.cache
        num_blocks = num_blocks_for_budget(self.kv_budget, c.block_size, self.bytes_per_token)
        return Worker(self.loaded.model, num_blocks, c.block_size, c.attention_backend, self.config.model.batch_invariant,
                      compilation_for(self.config), **c.worker_kwargs())  # fmt: skip

    def kv_bytes_per_token(self) -> int:
        """One token's K and V in the cache's format (`kv_cache_dtype`: level 1's setting)."""
        cfg = self.model_config
        return kv_bytes_per_token(cfg, self.dtype, head_bytes=self.config.cache.kv_head_bytes(cfg.head_dim))

    def make_lora(self):
        """`enable_lora=True`: the room's manager in the model's projections, its preparer checking each
        request's adapter, its rule in the scheduler's admission (features/lora); None without."""
        c = self.config.lora
        if not c.enable_lora:
            return None
        if self.config.model.batch_invariant:
            raise ValueError("enable_lora with batch_invariant=True is not built (the adapters' matmuls are not "
                             "fixed-order)")  # fmt: skip
        lora = self.new_lora_manager(c)
        self.inputs.takes_lora = True
        self.inputs.preparers += (lora.prepare,)
        self.scheduler.admission_rule = lora.admits
        return lora

    def new_lora_manager(self, c: LoRASettings):
        """The room's manager, installed in the model's projections (a simulated engine, which has no
        weights, puts its own bookkeeping here: benchmarks/sim/lora.py)."""
        return rooms.lora_manager(self.worker.model, c.max_loras, c.max_lora_rank, c.max_cpu_loras)

    def make_kv_manager(self) -> KVCacheManager:
        """Level 1's block tables behind the `KVCacheManager` Protocol (kv_cache_manager.py)."""
        return SimpleKVCacheManager(self.num_blocks, self.config.cache.block_size)

    def make_scheduler(self) -> Scheduler:
        c = self.config.scheduler
        return self.scheduler_class(self.kv, c.max_num_batched_tokens, c.max_num_seqs, c.policy, self.append_token,
                                    c.kv_admission_headroom)  # fmt: skip

    def check_fits(self, seq: Request, i: int) -> None:
        check_fits_in_pool(seq, i, self.num_blocks, self.config.cache.block_size)

    # --- the online API ---------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, priority: int = 0,
                    arrival_time: float | None = None, lora_request=None) -> None:  # fmt: skip
        """Queue a request; a bad one raises ValueError here and nothing else is affected.
        `arrival_time` (on the engine's clock: time.perf_counter() by default) is when it really
        arrived, if earlier than now (when the caller received it, say), so TTFT counts from there."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        group = self.inputs.make_group(prompt, params or SamplingParams(), request_id=request_id,
                                       lora_request=lora_request)  # fmt: skip
        for req in group:
            req.priority = priority
            if arrival_time is not None:
                req.metrics.arrival_time = arrival_time
            self.scheduler.add(req)
        self.requests[request_id] = group

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop one request (or several) now: their blocks are free before this returns, and
        the next `step()` returns each one's final output (finish_reason "abort"). An unknown
        or already finished id is ignored."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            group = self.requests.pop(rid, None)
            if group is None:
                continue
            for req in group:
                if not req.is_finished:
                    self.scheduler.finish(req, "abort")
                    self.stats.record_finished(req)
            self._aborted.append(self.outputs.make(group))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def unfinished_request_ids(self) -> list[str]:
        """Ids of the requests added with add_request that have not finished (to abort them all, say)."""
        return list(self.requests)

    def check_health(self) -> None:
        """Raise if the engine can no longer run (vLLM's `check_health`). In one process nothing
        can die but the process itself; an engine with worker processes checks them."""

    def num_free_blocks(self) -> int:
        """KV blocks no request holds (blocks kept for reuse count as free: they can be evicted)."""
        return self.kv.num_free_blocks

    def num_waiting(self) -> int:
        """Requests (samples) not yet admitted: what a caller's backpressure watches."""
        return len(self.scheduler.waiting)

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return an output for every request that moved (and every abort),
        of the kind its `SamplingParams.output_kind` asks for."""
        moved = self._step()
        outputs, self._aborted = self._aborted, []
        for rid in dict.fromkeys(r.request_id for r in moved):
            group = self.requests.get(rid)
            if group is None:
                continue
            out = self.outputs.make(group)
            if all(r.is_finished for r in group):
                del self.requests[rid]
            if out is not None:
                outputs.append(out)
        return outputs

    def get_metrics(self) -> list[Metric]:
        used_blocks, _ = self.kv.usage()
        return super().get_metrics() + [
            Gauge("vllm:num_requests_running", value=len(self.scheduler.running)),
            Gauge("vllm:num_requests_waiting", value=len(self.scheduler.waiting)),
            Gauge("vllm:kv_cache_usage_perc", value=used_blocks / self.num_blocks),
        ] + (self.lora.metrics(self.scheduler.running, self.scheduler.waiting) if self.lora is not None else [])

    # --- one iteration: its stages ----------------------------------------------------------
    def _step(self) -> list[Request]:
        with Timer() as t_step:
            with Timer() as t_sched:
                sched = self.schedule()
                if not sched.scheduled:
                    if self.scheduler.running or sched.preempted or self.scheduler.admissible():  # a lone one fits
                        raise RuntimeError("the scheduler made no progress with requests pending (a bug)")
                    if self.scheduler.has_unfinished():  # each waits on something outside (its KV, arriving)
                        time.sleep(WAIT_FOR_OUTSIDE_S)  # rather than spin
                    return []
                model_input = self.prepare_input(sched)
            logits = self.take_prompt_logprobs(self.chunks(sched), self.worker.execute(model_input))
            output = self.sample(sched, logits)
            moved = self.scheduler.update_from_output(sched, output)
            self.post_step(sched)
        self._record(sched, t_sched.seconds, t_step.seconds)
        return moved

    def schedule(self) -> SchedulerOutput:
        """The scheduler's decision; the scheduled requests' first-scheduled times are set."""
        sched = self.scheduler.schedule()
        self.mark_scheduled([req for req, _ in sched.scheduled])
        return sched

    def prepare_input(self, sched: SchedulerOutput) -> ModelInput:
        """Each scheduled request's next tokens, from where its cache ends; logits rows where a
        chunk reaches the request's last token (a partial prefill chunk samples nothing), and
        before them the prompt logprobs' rows a request asked for (`SamplingParams.prompt_logprobs`)."""
        chunks, tables, num_logits = [], [], []
        for req, n in sched.scheduled:
            chunks.append((req.token_slice(req.num_computed_tokens, n), req.num_computed_tokens))
            tables.append(self.kv.block_table(req))
            num_logits.append(req.prompt_logprob_rows(req.num_computed_tokens, n) + req.num_logits(n))
        if self.lora is not None:  # each row's adapter slot, where the model's projections read it
            self.lora.prepare_step(sched.scheduled)
        return ModelInput.build(chunks, tables, self.config.cache.block_size, num_logits)

    @staticmethod
    def chunks(sched: SchedulerOutput) -> list[tuple[Request, int, int, int]]:
        """(request, first position, tokens, sampling rows) per scheduled chunk, for `take_prompt_logprobs`."""
        return [(req, req.num_computed_tokens, n, req.num_logits(n)) for req, n in sched.scheduled]

    @torch.inference_mode()
    def sample(self, sched: SchedulerOutput, logits: torch.Tensor) -> ModelRunnerOutput:
        """logits [S, V], one row per request whose chunk reached its end -> one token each."""
        reqs = [req for req, n in sched.scheduled if req.num_logits(n)]
        tokens, logprobs = self.sample_tokens(logits, reqs)
        return ModelRunnerOutput(reqs, [[t] for t in tokens], [[lp] for lp in logprobs])

    def post_step(self, sched: SchedulerOutput) -> None:
        """After the books are kept: nothing here (a subclass may prepare the next step's tokens)."""

    def _record(self, sched: SchedulerOutput, sched_s: float, step_s: float) -> None:
        s = self.stats
        s.prompt_tokens += sched.num_prefill_tokens
        s.preemptions += len(sched.preempted)
        s.schedule_seconds += sched_s
        used_blocks, stored = self.kv.usage()
        running = len(self.scheduler.running)
        s.record_step(
            running, used_blocks * self.config.cache.block_size * self.bytes_per_token, stored * self.bytes_per_token, step_s
        )
        waiting, ids = len(self.scheduler.waiting), [r.request_id for r, _ in sched.scheduled]
        record = StepRecord(self.clock(), running, waiting, sched.num_batched_tokens, sched.num_prefill_tokens,
                            len(sched.preempted), used_blocks, sched_s, step_s, ids)  # fmt: skip
        self.step_log.append(record)
        if self.observers:  # nothing is copied unless someone looks
            notify(self.observers, record, self.kv, list(self.scheduler.running), list(self.scheduler.waiting))

    # --- LLM.generate, on top of the step loop -----------------------------------------------
    def run(self, seqs: list[Request], bar: GenerateProgress) -> None:
        if self.has_unfinished_requests():
            raise RuntimeError(
                "generate() needs an idle engine: finish or abort the requests added with add_request first"
            )
        for req in seqs:
            self.scheduler.add(req)
        while self.scheduler.has_unfinished():
            before = self.stats.generated_tokens
            moved = self._step()
            bar.update(finished=sum(r.is_finished for r in moved), new_tokens=self.stats.generated_tokens - before)


class LLM(NaiveLLM):
    """Level 0's front end over the continuous-batching engine."""

    engine_class = ContinuousEngine


LLMEngine = ContinuousEngine  # vLLM's name; each level exports its own engine under it
