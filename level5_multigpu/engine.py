"""Level 5: level 4's engine whose target model is split across processes.

What it is: `ParallelEngine` (exported as `LLMEngine`) and `LLM` of level 4 with vLLM's knobs

    LLM(model, tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="mp")

and one part replaced: the target's `Worker` becomes an `Executor` over tp x pp ranks
(`executor.py`). The driver (this process, rank 0) keeps everything that is about
requests: the scheduler, the KV manager and its block tables, the draft model and its
cache (level 4), sampling and the per-request generators. Each step's `ModelInput` goes
to every rank; the logits come back. With both sizes 1 this is level 4, step for step.

With pipeline_parallel_size = p > 1 the engine keeps up to p micro-batches of *disjoint*
requests in flight (vLLM's batch queue): a request in flight is invisible to the next
`schedule()` (it can be neither scheduled again nor preempted: scheduler.py), so while stage 1 runs
micro-batch A, stage 0 runs B:

    stage 0 |A0|B0|C0|  |D0|       time ->     (each box: one micro-batch's forward on that stage)
    stage 1    |A1|B1|C1|  |D1|                the gaps are the bubble

An abort that arrives while its request is in flight frees the request's blocks at
once (every stage handles micro-batches in order, so a reused block is written later
everywhere); when that micro-batch comes back, the aborted request is skipped.

KV sizing: `kv_cache_memory` is per rank; each rank's cache holds its layers (1/pp) and
its KV heads (1/tp, or one replicated head), and the engine uses the fewest blocks any
rank can hold.

What it is not: data parallelism, expert parallelism or disaggregated prefill. One
multi-rank engine per process at a time (torch.distributed has one default group).

Reference: vLLM `v1/executor/multiproc_executor.py`, `v1/engine/core.py`
(`step_with_batch_queue`); Huang et al., "GPipe" (2019) for micro-batching.
"""

from __future__ import annotations

import os
from collections import deque

from ladder import rooms
from ladder.metrics import Counter, Metric
from level0_naive.loader import LoadedModel, load_metadata
from level0_naive.stats import Timer
from level1_paged.engine import compilation_for
from level1_paged.executor import Executor
from level1_paged.model_input import ModelInput
from level2_continuous.scheduler import ModelRunnerOutput, SchedulerOutput
from level4_speculative.engine import LLM as SpeculativeLLM
from level4_speculative.engine import SpeculativeEngine

from .config import ParallelConfig
from .executor import MultiprocExecutor
from .layers import kv_heads_of_rank
from .model import kv_bytes_per_token_of_rank, partition_layers
from .parallel_state import CommStats, check_gpus
from .rank import ParallelSpec, rank_main
from .scheduler import PipelineScheduler


class ParallelEngine(SpeculativeEngine):
    config_parts = {**SpeculativeEngine.config_parts, "parallel": ParallelConfig}
    scheduler_class = PipelineScheduler  # level 3's, with a micro-batch's requests out of sight while in flight

    def __init__(self, model: str, **kwargs):
        # per micro-batch in flight, oldest first: (SchedulerOutput, seconds to schedule it); level 4's
        # guesses travel on the requests themselves
        self.in_flight: deque[tuple[SchedulerOutput, float]] = deque()
        self.executor: Executor | None = None
        try:
            super().__init__(model, **kwargs)
        except BaseException:
            self.shutdown()  # ranks already started must not outlive a failed construction
            raise

    @property
    def tp(self) -> int:
        return self.config.parallel.tensor_parallel_size

    @property
    def pp(self) -> int:
        return self.config.parallel.pipeline_parallel_size

    @property
    def parallel(self) -> bool:
        return self.tp * self.pp > 1

    # --- construction: metadata on the driver, shards on the ranks -----------------------------
    def load_model(self) -> LoadedModel:
        if not self.parallel:
            return super().load_model()  # level 4, whole model in this process
        par = self.config.parallel
        check_gpus(self.device, self.tp * self.pp, par.oversubscribe_gpus, par.distributed_executor_backend)  # first
        loaded = load_metadata(self.config.model.model)  # the ranks read their own slices of the weights
        kv_heads_of_rank(loaded.config.num_kv_heads, self.tp, 0)  # fails now if the heads cannot be split
        if loaded.config.num_heads % self.tp:
            raise ValueError(
                f"tensor_parallel_size={self.tp} must divide num_attention_heads={loaded.config.num_heads}"
            )
        partition_layers(loaded.config.num_layers, self.pp, self.config.parallel.pipeline_partition)
        spec = self.config.speculative
        if spec is not None and spec.method == "eagle" and self.pp > 1:
            raise ValueError("speculative_config method 'eagle' at pipeline_parallel_size > 1 is not built (the head, "
                             "on the driver, reads the last stage's hidden states, which stay on that stage's ranks)")  # fmt: skip
        self.load_draft(loaded)  # level 4: the draft (or EAGLE's head, with the target's two ends) lives with the driver
        return loaded

    def kv_bytes_per_token(self) -> int:
        """One token's K and V summed over every rank (replicated KV heads count on each rank)."""
        if not self.parallel:
            return super().kv_bytes_per_token()
        cfg, draft = self.model_config, self.draft_kv_bytes_per_token()
        ranges = partition_layers(cfg.num_layers, self.pp, self.config.parallel.pipeline_partition)
        head_bytes = self.config.cache.kv_head_bytes(cfg.head_dim)
        return draft + sum(
            kv_bytes_per_token_of_rank(cfg, self.tp, t, len(r), self.dtype, head_bytes) for r in ranges for t in range(self.tp)
        )

    def make_worker(self) -> Executor:
        """Level 4's Worker, or, with tp x pp > 1, an executor over the ranks. Its constructor
        starts them; each loads its shard and sizes its cache, and they agree on the fewest
        blocks any rank holds (`executor.num_blocks`)."""
        if not self.parallel:
            return super().make_worker()
        compilation = compilation_for(self.config, parallel=True)  # each rank compiles its shard (None: eager)
        cfg = self.model_config
        if self.config.model.quantization == "int4":  # each rank quantizes its shard: a row-parallel one's inputs
            shards = {"o_proj": cfg.num_heads * cfg.head_dim // self.tp, "down_proj": cfg.intermediate_size // self.tp,
                      "the others": cfg.hidden_size}  # fmt: skip
            for name, n_in in shards.items():
                if n_in % 128:
                    raise ValueError(f"quantization='int4' at tensor_parallel_size={self.tp}: {name} has {n_in} "
                                     "inputs per rank, not a multiple of the group (128)")  # fmt: skip
        if self.config.lora.enable_lora and self.model_config.moe is not None:  # before the ranks find out
            raise ValueError("enable_lora with a mixture-of-experts model is not built (its experts' linears)")
        lora = self.config.lora
        if lora.enable_lora and lora.fully_sharded_loras and lora.max_lora_rank % self.tp:
            raise ValueError(f"fully_sharded_loras: max_lora_rank={lora.max_lora_rank} must be a multiple of "
                             f"tensor_parallel_size={self.tp} (each rank holds an equal share of every adapter's ranks)")  # fmt: skip
        if self.config.cache.kv_transfer_config is not None:
            raise ValueError("kv_transfer_config at tensor_parallel_size x pipeline_parallel_size > 1 is not built "
                             "(each rank would need its own side of the connector)")  # fmt: skip
        spec = ParallelSpec.from_config(self.config, model=str(self.loaded.path), dtype=self.dtype,
                                        device_type=self.device.type,
                                        extra_bytes_rank0=self.draft_kv_bytes_per_token(), compilation=compilation)  # fmt: skip
        if spec.ranks_started_by == "torchrun" and int(os.environ.get("RANK", "0")) != 0:
            self._serve_as_worker(spec)  # never returns: this process is a rank, not the driver
        self.executor = MultiprocExecutor(spec)
        return self.executor

    def new_lora_manager(self, c):
        """Over ranks, the room's manager keeps the books only: every rank holds its shard of the slots
        (features/lora/sharded.py) and carries out each step's adapters, sent with the step's input."""
        if not self.parallel:
            return super().new_lora_manager(c)
        return rooms.lora_books(self.model_config, self.dtype, c.max_loras, c.max_lora_rank, c.max_cpu_loras)

    def prepare_input(self, sched: SchedulerOutput) -> ModelInput:
        """Level 4's input; with LoRA over ranks, the step's adapters (`lora_step`: the mapping, and each adapter
        newly put in a slot, its weights as read when its request was added) ride along to every rank."""
        model_input = super().prepare_input(sched)
        if self.parallel and self.lora is not None:
            model_input.lora_step = self.lora.take_step()
        return model_input

    def _serve_as_worker(self, spec: ParallelSpec) -> None:
        """Under torchrun every process runs the user's script: ranks other than 0 serve the driver, then exit."""
        rank_main(int(os.environ["RANK"]), spec, "env://")
        raise SystemExit(0)

    # --- the step: micro-batches in flight -------------------------------------------------------------
    def _step(self) -> list:
        if self.pp == 1:
            return super()._step()
        with Timer() as t_step:
            while len(self.in_flight) < self.pp:  # fill the pipeline with disjoint micro-batches
                with Timer() as t_sched:
                    sched = self.schedule()
                    if not sched.scheduled:
                        break
                    model_input = self.prepare_input(sched)
                self.worker.submit(model_input)
                self.scheduler.send_off(sched)  # its requests sit out the next schedules (scheduler.py)
                self.in_flight.append((sched, t_sched.seconds))
            if not self.in_flight:
                if self.scheduler.has_unfinished():
                    raise RuntimeError("the scheduler made no progress with requests pending (a bug)")
                return []
            sched, sched_s = self.in_flight.popleft()
            self.scheduler.take_back(sched)
            logits = self.take_prompt_logprobs(self.chunks(sched), self.worker.collect())
            output = self.sample(sched, logits)
            self._skip_aborted(sched, output)
            moved = self.scheduler.update_from_output(sched, output)
            self.post_step(sched)
        self._record(sched, sched_s, t_step.seconds)
        return moved

    @staticmethod
    def _skip_aborted(sched: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """Requests aborted while their micro-batch was in flight: their blocks are gone; drop them."""
        keep = [i for i, r in enumerate(out.requests) if not r.is_finished]
        out.requests = [out.requests[i] for i in keep]
        out.token_ids = [out.token_ids[i] for i in keep]
        out.logprobs = [out.logprobs[i] for i in keep]
        sched.scheduled = [(r, n) for r, n in sched.scheduled if not r.is_finished]

    def has_unfinished_requests(self) -> bool:
        return super().has_unfinished_requests() or bool(self.in_flight)

    # --- communication, and the end ------------------------------------------------------------------
    def comm_stats(self) -> dict:
        """Per rank: calls, bytes and seconds per kind of message, and the forward timeline."""
        if not self.parallel:
            return {0: (CommStats(), [])}
        return self.executor.comm_stats()

    def get_metrics(self) -> list[Metric]:
        """Level 4's, plus the driver's (rank 0's) messages by kind: calls, bytes, seconds (ours, not vLLM's names)."""
        out = super().get_metrics()
        if self.parallel:
            for kind, (calls, nbytes, secs) in sorted(self.executor.comm.stats.settle().by_kind.items()):
                labels = {"kind": kind, "rank": "0"}
                out += [Counter("ladder:comm_calls", labels, calls), Counter("ladder:comm_bytes", labels, nbytes),
                        Counter("ladder:comm_seconds", labels, secs)]  # fmt: skip
        return out

    def check_health(self) -> None:
        """Level 2's, plus: every rank is still alive (WorkerDiedError names the one that is not)."""
        super().check_health()
        if self.parallel:
            self.executor.check_health()

    def calibrate(self) -> dict:
        """This machine's alpha (per-message latency) and beta (per-byte cost) for all-reduce and send."""
        return self.executor.calibrate() if self.parallel else {}

    def shutdown(self) -> None:
        if self.executor is not None:
            self.executor.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass


class LLM(SpeculativeLLM):
    """Level 4's front end over the parallel engine. `with LLM(...) as llm:` shuts the ranks down."""

    engine_class = ParallelEngine

    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def comm_stats(self) -> dict:
        return self.llm_engine.comm_stats()


LLMEngine = ParallelEngine  # vLLM's name
