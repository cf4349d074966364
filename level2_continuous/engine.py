"""Level 2: continuous batching. The engine asks the scheduler every step.

What it is: `LLMEngine`, vLLM's online core API (`add_request`, `abort_request`,
`step`, `has_unfinished_requests`), and `LLM`, whose `generate` is built on it. One
`step()`:

    scheduler.schedule()          who runs, how many tokens each (may preempt)
    build the flattened batch     input_ids [T], positions [T], PagedMetadata
    model forward                 level 1's paged attention, unchanged
    scheduler.update()            num_computed_tokens += scheduled
    sample where a prompt ended   a partial prefill chunk samples nothing
    stop rules, free finished     their blocks go back *now*, and the very next step
                                  can admit a waiting request into the free seats

A request leaves the batch the step it finishes and a waiting one joins the next step:
nobody waits for the batch's longest member (head-of-line blocking is gone).

What it is not: asynchronous (level 6 wraps this in asyncio) or multi-device. The
static-batching hooks inherited from level 1 (`_admit_one`, `_attention`, ...) are not
used here: `_run` is replaced by the step loop.

Reference: vLLM V1 `v1/engine/core.py` (EngineCore.step), `v1/engine/llm_engine.py`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from level0_naive.outputs import RequestOutput, group_outputs
from level0_naive.progress import GenerateProgress
from level0_naive.sampling import SamplingParams
from level0_naive.stats import Timer
from level1_paged.engine import LLM as PagedLLM
from level1_paged.engine import PagedEngineConfig
from level1_paged.paged_cache import PagedAttention, PagedMetadata

from .kv_cache_manager import KVCacheManager
from .request import Request
from .scheduler import Scheduler, SchedulerOutput


@dataclass
class ContinuousEngineConfig(PagedEngineConfig):
    max_num_batched_tokens: int = 2048  # the token budget of one step (prefill chunks + decodes)
    policy: str = "fcfs"  # fcfs | priority

    def __post_init__(self):
        super().__post_init__()
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")


@dataclass
class StepRecord:
    """What one step did: the per-step stats, and the raw material of the demo's timeline."""

    time: float
    running: int
    waiting: int
    num_batched_tokens: int
    num_prefill_tokens: int
    preempted: int
    kv_blocks_used: int
    schedule_seconds: float  # scheduler + block bookkeeping + metadata building
    step_seconds: float
    request_ids: list[str]


class LLMEngine(PagedLLM):
    config_class = ContinuousEngineConfig
    sequence_class = Request

    def _init_kv_cache(self) -> None:
        super()._init_kv_cache()  # level 1: block count, KV tensors, attention impl
        self.kv = self._make_kv_manager()
        del self.blocks, self.cached  # level 1's static-batch bookkeeping: the KV manager owns blocks now
        self.scheduler = Scheduler(self.kv, self.config.max_num_batched_tokens, self.config.max_num_seqs, self.config.policy)
        self.requests: dict[str, list[Request]] = {}  # request_id -> its n samples
        self.step_log: list[StepRecord] = []

    def _make_kv_manager(self) -> KVCacheManager:
        """The hook level 3 replaces with its prefix-caching manager."""
        return KVCacheManager(self.num_blocks, self.config.block_size)

    # --- the online API ---------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, priority: int = 0) -> None:
        """Queue a request; a bad one raises ValueError here and nothing else is affected."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        group = self._make_group(prompt, params or SamplingParams(), request_id=request_id)
        for req in group:
            req.priority = priority
            self.scheduler.add(req)
        self.requests[request_id] = group

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop one request (or several) now; their blocks are free before this returns."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            for req in self.requests.pop(rid, []):
                if not req.status.finished:
                    self.scheduler.finish(req, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the (cumulative) output of every request that moved."""
        touched = self._step()
        outputs = []
        for rid in dict.fromkeys(r.request_id for r in touched):
            group = self.requests.get(rid)
            if group is None:
                continue
            outputs.append(group_outputs(group, self.tokenizer))
            if all(r.is_finished for r in group):
                del self.requests[rid]
        return outputs

    # --- one iteration --------------------------------------------------------------------
    def _step(self) -> list[Request]:
        with Timer() as t_step:
            with Timer() as t_sched:
                out = self.scheduler.schedule()
                if not out.scheduled:
                    if self.scheduler.has_unfinished():  # admission guarantees a lone request fits
                        raise RuntimeError("the scheduler made no progress with requests pending (a bug)")
                    return []
                attn, chunks, sample_rows, prefill = self._prepare(out)
            logits = self.runner.forward(chunks, attn, sample_rows)
            self.scheduler.update(out)
            sampled = [out.scheduled[i][0] for i in sample_rows]
            self.runner.sample_and_append(sampled, logits)
            for req in sampled:
                if req.is_finished:
                    self.scheduler.finish(req)
        self._record(out, sampled, prefill, t_sched.seconds, t_step.seconds)
        return sampled

    def _prepare(self, out: SchedulerOutput):
        now = time.perf_counter()
        chunks, tables, slots, sample_rows, prefill = [], [], [], [], 0
        for i, (req, n) in enumerate(out.scheduled):
            start = req.num_computed_tokens
            req.metrics.first_scheduled_time = req.metrics.first_scheduled_time or now
            is_decode = n == 1 and start == req.num_tokens - 1 and req.output_token_ids
            prefill += 0 if is_decode else n  # prompt tokens, or prompt + output again after a preemption
            chunks.append((req.token_slice(start, n), start))
            tables.append(self.kv.block_table(req))
            slots.extend(self.kv.slots(req, start, n))
            if start + n == req.num_tokens:  # the chunk reaches the end: sample the next token
                sample_rows.append(i)
        meta = PagedMetadata.build(tables, [c[1] for c in chunks], [len(c[0]) for c in chunks], slots, self.device)
        return PagedAttention(self.cache, meta, self.impl, self.scale), chunks, sample_rows, prefill

    def _record(self, out: SchedulerOutput, sampled: list[Request], prefill: int, sched_s: float, step_s: float) -> None:
        s = self.stats
        s.prompt_tokens += prefill
        s.generated_tokens += len(sampled)
        s.preemptions += len(out.preempted)
        running = len(self.scheduler.running)
        s.record_step(running, *self._kv_usage(), step_s)
        self.step_log.append(StepRecord(time.perf_counter(), running, len(self.scheduler.waiting), out.num_batched_tokens, prefill,
                                        len(out.preempted), self.kv.num_used_blocks, sched_s, step_s,
                                        [r.request_id for r, _ in out.scheduled]))  # fmt: skip

    def _kv_usage(self) -> tuple[int, int]:
        """(bytes reserved, bytes holding real tokens), from the KV manager's blocks."""
        reserved = self.kv.num_used_blocks * self.config.block_size
        used = sum(r.num_computed_tokens for r in self.scheduler.running)
        return reserved * self.bytes_per_token, used * self.bytes_per_token

    # --- LLM.generate, on top of the step loop -----------------------------------------------
    def _run(self, seqs: list[Request], bar: GenerateProgress) -> None:
        if self.scheduler.has_unfinished():
            raise RuntimeError("generate() needs an idle engine: finish or abort the requests added with add_request first")
        for req in seqs:
            self.requests.setdefault(req.request_id, []).append(req)
            self.scheduler.add(req)
        while self.scheduler.has_unfinished():
            sampled = self._step()
            bar.update(finished=sum(r.is_finished for r in sampled), new_tokens=len(sampled))
        for req in seqs:
            self.requests.pop(req.request_id, None)


class LLM(LLMEngine):
    """The offline entry point: `generate` and `chat` (inherited), run by continuous batching."""
